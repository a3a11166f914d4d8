"""Fault-tolerance stress test: SIGKILL a worker at a random time, many times, and check every job ends exact.

    python bench/kill_stress.py --runs 20          (or through ../bench.sh's environment: .venv/bin/python)

Bakes the template, runs one uninterrupted reference job, then `--runs` jobs under
`torchrun --standalone --nproc_per_node=2 --max-restarts=3`, each with one worker SIGKILLed (rank 0 and a
non-zero rank in turn) at a random moment of its training. For each job: torchrun's exit code, the failed
attempts in its log (lines with "failed (exitcode: "), the time from the kill to the first optimizer step
after the resume, and whether the final weights are torch.equal to the reference's. Writes a table and a
summary to bench/KILL_STRESS.md.
"""

import argparse
import importlib
import json
import os
import random
import re
import signal
import sys
import time
from pathlib import Path

from common import BENCH, FAILED_ATTEMPT, CpuMeter, Run, bake, load, machine, median, scratch_folder, worker_pids

ARGS = [
    "--wandb",
    "disabled",
    "--width",
    "256",
    "--depth",
    "3",
    "--dataset-size",
    "8192",
    "--batch-size",
    "32",
    "--max-steps",
    "600",
    "--snapshot-every",
    "25",
    "--log-every",
    "25",
]
TORCHRUN = ["--max-restarts=3"]


def final_weights(snapshot, folder):
    state = snapshot.load_latest(str(folder / "snapshots"))
    if state is None:
        raise RuntimeError(f"no snapshot in {folder / 'snapshots'}")
    return state["model"], state["step"]


def same(a, b):
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def last_attempt_first_step(run):
    """(attempt, wall time of its first optimizer step) of the newest attempt that took one."""
    found = None
    for path in run.probe_dir.glob("first-rank*-attempt*.json"):
        attempt = int(re.search(r"attempt(\d+)", path.name).group(1))
        if found is None or attempt > found[0]:
            found = (attempt, run.first_step(attempt))
    return found


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20, help="jobs to kill a worker in")
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill times")
    parser.add_argument("--out", default=str(BENCH / "KILL_STRESS.md"))
    parser.add_argument("--keep", action="store_true", help="keep the scratch folder")
    parser.add_argument("--project", default="", help="measure this baked project instead of baking one")
    args = parser.parse_args()
    rng = random.Random(args.seed)

    def log(text):
        print(text, flush=True)

    info = machine()
    info["load_before"] = load()[0]
    meter = CpuMeter()
    rows = []
    with scratch_folder("ddp-kill-stress-", args.keep, log) as work:
        project, package = (
            (Path(args.project).resolve(), Path(args.project).resolve().name) if args.project else bake(work / "bake")
        )
        sys.path.insert(0, str(project))
        snapshot = importlib.import_module(f"{package}.machinery.snapshot")

        reference = Run(project / "train.py", ARGS, 2, work / "reference", torchrun_args=TORCHRUN)
        if reference.wait(timeout=600) != 0:
            raise RuntimeError(f"the reference job failed:\n{reference.text()[-3000:]}")
        reference_weights, reference_step = final_weights(snapshot, work / "reference")
        steps = reference.step_times()
        training_s = steps[-1] - steps[0]
        log(f"reference: {len(steps)} steps in {training_s:.1f} s of training, final step {reference_step}")

        for index in range(args.runs):
            victim = index % 2  # rank 0, then rank 1, ...
            folder = work / f"run-{index:02d}"
            run = Run(project / "train.py", ARGS, 2, folder, torchrun_args=TORCHRUN)
            delay = rng.uniform(0.0, 0.9 * training_s)
            row = {"run": index, "victim": victim, "kill_after_first_step_s": delay}
            try:
                first = run.first_step(0, timeout=300)
                time.sleep(max(0.0, first + delay - time.time()))
                pid = worker_pids(run.proc.pid).get(victim)
                if pid is None:
                    raise RuntimeError(f"rank {victim} was not running")
                killed = time.time()
                os.kill(pid, signal.SIGKILL)
                row["exit_code"] = run.wait(timeout=600)
            finally:
                run.stop()
            text = run.text()
            row["failed_attempts"] = text.count(FAILED_ATTEMPT)
            resumed_from = re.findall(r"resuming run \S+ from step (\d+)", text)
            row["resumed_from"] = int(resumed_from[-1]) if resumed_from else None
            attempt = last_attempt_first_step(run)
            row["attempts"] = attempt[0] + 1 if attempt else 0
            row["kill_to_resumed_step_s"] = attempt[1] - killed if attempt and attempt[0] > 0 else None
            try:
                weights, step = final_weights(snapshot, folder)
                row["final_step"] = step
                row["equal"] = step == reference_step and same(weights, reference_weights)
            except Exception as exc:  # reported in the table: a job that left no usable snapshot
                row["final_step"], row["equal"], row["error"] = None, False, f"{type(exc).__name__}: {exc}"
            rows.append(row)
            back = row["kill_to_resumed_step_s"]
            log(
                f"run {index:2d}: killed rank {victim} {delay:.2f} s after the first step; exit {row['exit_code']}, "
                f"{row['failed_attempts']} failed attempt(s), resumed from step {row['resumed_from']}, "
                f"back {'-' if back is None else f'{back:.2f} s'} after the kill, "
                f"weights {'equal' if row['equal'] else 'DIFFERENT'}"
            )

    info.update(meter.stop())
    write_report(args.out, info, rows, training_s, " ".join(["python bench/kill_stress.py", *sys.argv[1:]]))
    Path(args.out).with_suffix(".json").write_text(json.dumps({"machine": info, "runs": rows}, indent=1))
    ok = all(r["exit_code"] == 0 and r["failed_attempts"] == 1 and r["equal"] for r in rows)
    log(f"\n{sum(r['equal'] for r in rows)}/{len(rows)} jobs ended with the reference's weights; written to {args.out}")
    return 0 if ok else 1


def write_report(path, info, rows, training_s, command):
    lines = [
        "# Kill stress test",
        "",
        f"Written by `{command}` on {info['date']}: {info['cpu']}, {info['nproc']} cores, torch {info['torch']}, "
        f"1-minute load {info['load_before']:.2f} before; {info['wall_s'] / 60:.1f} min, during which other "
        f"processes used {info['foreign_cpu_s']:.0f} s of CPU ({info['foreign_cores']:.2f} cores on average).",
        "",
        "Each job: `torchrun --standalone --nproc_per_node=2 --max-restarts=3 train.py " + " ".join(ARGS) + "`, "
        f"one worker SIGKILLed at a random time in the first 90% of its training ({training_s:.1f} s in the "
        'uninterrupted reference job). "Back" is the time from the kill to the first optimizer step after the '
        'resume. "Equal": the final weights are torch.equal to the reference\'s, tensor by tensor.',
        "",
        "## Summary",
        "",
        "| killed rank | jobs | exit 0 | exactly 1 failed attempt | weights equal | back: min / median / max |",
        "|---|---|---|---|---|---|",
    ]
    for victim in sorted({r["victim"] for r in rows}):
        mine = [r for r in rows if r["victim"] == victim]
        back = [r["kill_to_resumed_step_s"] for r in mine if r["kill_to_resumed_step_s"] is not None]
        spread = f"{min(back):.2f} / {median(back):.2f} / {max(back):.2f} s" if back else "-"
        lines.append(
            f"| {victim} | {len(mine)} | {sum(r['exit_code'] == 0 for r in mine)} | "
            f"{sum(r['failed_attempts'] == 1 for r in mine)} | {sum(bool(r['equal']) for r in mine)} | {spread} |"
        )
    attempts = {}
    for r in rows:
        attempts[r["failed_attempts"]] = attempts.get(r["failed_attempts"], 0) + 1
    lines += [
        "",
        "Failed attempts per job: " + ", ".join(f"{n} in {count} job(s)" for n, count in sorted(attempts.items())),
        "",
        "## Every job",
        "",
        "| job | killed rank | kill after first step | exit code | failed attempts | resumed from step | back "
        "| final step | weights equal |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        back = "-" if r["kill_to_resumed_step_s"] is None else f"{r['kill_to_resumed_step_s']:.2f} s"
        equal = "yes" if r["equal"] else ("NO" + (f" ({r['error']})" if r.get("error") else ""))
        lines.append(
            f"| {r['run']} | {r['victim']} | {r['kill_after_first_step_s']:.2f} s | {r['exit_code']} | "
            f"{r['failed_attempts']} | {r['resumed_from']} | {back} | {r['final_step']} | {equal} |"
        )
    Path(path).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
