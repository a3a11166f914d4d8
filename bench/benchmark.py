"""The benchmark: what the baked project costs over a bare DDP loop, on CPU ranks with gloo.

Run it through ../bench.sh (which prepares the environment). It bakes the template with its defaults into a
scratch folder and measures, alternating bare and baked runs (A B A B) and reporting medians and ratios:

  overhead   steady-state optimizer steps/s of the baked train.py vs bench/bare_ddp.py (same model class, data,
             batch and optimizer; 2 ranks), and the time from launching torchrun to the first optimizer step
  restart    SIGKILL one worker under torchrun --max-restarts=3: time from the kill to the first optimizer
             step after the resume, vs the same job's cold launch-to-first-step, phase by phase (RESTART_PHASES)
  scaling    1 rank vs 2 ranks on a compute-bound model, with the project's CPU threads per rank (cores / ranks)
             and with --threads-per-rank 1 (torchrun's OMP_NUM_THREADS=1 for several ranks)
  snapshot   training-thread stall per snapshot of a ~100M-parameter model: background save vs torch.save

Every run is timed by bench/probe.py (an optimizer step hook); neither script is changed for it. Results go to
bench/RESULTS.md (and the raw numbers to bench/RESULTS.json).
"""

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from common import (
    BARE,
    BENCH,
    FAILED,
    FAILED_ATTEMPT,
    STOPPING,
    CpuMeter,
    Run,
    agent_time,
    bake,
    load,
    machine,
    median,
    process_start,
    scratch_folder,
    steps_per_second,
    worker_pids,
)

# Overhead: a step of a few milliseconds or more, so that per-step costs show against real work.
OVERHEAD_MODEL = ["--width", "512", "--depth", "4", "--batch-size", "64", "--dataset-size", "65536"]
# Scaling: compute-bound (the all-reduce is small next to the matrix products).
SCALING_MODEL = ["--width", "1024", "--depth", "4", "--batch-size", "256", "--dataset-size", "65536"]
WARMUP_STEPS = 20  # excluded from steps/s: allocator, first all-reduces, learning-rate warmup bookkeeping


def baked_args(model_args, steps, snapshot_every):
    return [*model_args, "--max-steps", steps, "--snapshot-every", snapshot_every, "--wandb", "disabled"]


def section_overhead(project, package, work, pairs, steps, log):
    """Steady-state steps/s and launch-to-first-step, bare (A) and baked (B), alternating."""
    runs = {"bare": [], "baked": []}
    for pair in range(pairs):
        for kind in ("bare", "baked"):
            folder = work / f"overhead-{pair}-{kind}"
            if kind == "bare":
                run = Run(
                    BARE, ["--project", project, "--package", package, *OVERHEAD_MODEL, "--max-steps", steps], 2, folder
                )
            else:  # default logging (every 10 steps, to the console and logs/train.log); no snapshot in the window
                run = Run(project / "train.py", baked_args(OVERHEAD_MODEL, steps, steps + 1), 2, folder)
            code = run.wait(timeout=300)
            if code != 0:
                raise RuntimeError(f"{kind} run exited {code}:\n{run.text()[-3000:]}")
            result = {
                "launch_to_first_step_s": run.first_step() - run.launched,
                "steps_per_s": steps_per_second(run.step_times(), WARMUP_STEPS),
            }
            runs[kind].append(result)
            log(
                f"  {kind:5s} {result['steps_per_s']:7.2f} steps/s, "
                f"first step {result['launch_to_first_step_s']:.2f} s after launch"
            )
    return runs


# The phases of a recovery, each from the end of the one before: the kill -> torchrun signals the survivors
# ("closing signal"); -> the survivors have exited (torchrun's "failed (exitcode" line); -> the restarted workers'
# processes start; -> every restarted rank has done its first optimizer step.
RESTART_PHASES = ("kill -> SIGTERM", "SIGTERM -> exit", "exit -> restart", "restart -> first step")


def section_restart(project, work, kills, log):
    """Kill one worker (rank 1, then rank 0, ...) after a random time; time the job's way back to training."""
    results = []
    for index in range(kills):
        victim = 1 if index % 2 == 0 else 0
        folder = work / f"restart-{index}"
        run = Run(
            project / "train.py",
            baked_args(OVERHEAD_MODEL, 1_000_000, 20),
            2,
            folder,
            torchrun_args=["--max-restarts=3"],
        )
        try:
            cold = run.first_step(0, timeout=300) - run.launched
            time.sleep(random.uniform(1.0, 2.0))
            first_workers = worker_pids(run.proc.pid)
            pid = first_workers.get(victim)
            if pid is None:
                raise RuntimeError(f"rank {victim} not found; output in {run.output}")
            killed = time.time()
            os.kill(pid, signal.SIGKILL)
            resumed_at = run.first_step(1, timeout=300)
            restarted = min(process_start(p) for p in worker_pids(run.proc.pid).values())
        finally:
            run.stop()
        text = run.text()
        # No "closing signal" line: the survivors had left before torchrun signalled them.
        failed_at = agent_time(FAILED, text)
        signalled = min(agent_time(STOPPING, text) or failed_at, failed_at)
        marks = [killed, signalled, failed_at, restarted, resumed_at]
        phases = {name: marks[i + 1] - marks[i] for i, name in enumerate(RESTART_PHASES)}
        resumed = resumed_at - killed
        failed = text.count(FAILED_ATTEMPT)
        results.append(
            {
                "victim": victim,
                "cold_launch_to_first_step_s": cold,
                "kill_to_resumed_step_s": resumed,
                "phases_s": phases,
                "failed_attempts": failed,
            }
        )
        log(
            f"  killed rank {victim}: back to training {resumed:.2f} s after the kill (cold start {cold:.2f} s; "
            + ", ".join(f"{name} {seconds:.2f}" for name, seconds in phases.items())
            + f"), {failed} failed attempt(s)"
        )
    return results


SCALING_CONFIGS = [  # (ranks, --threads-per-rank; 0 = the project's default, cores // ranks)
    (1, 0),
    (1, 1),
    (2, 0),
    (2, 1),
]


def section_scaling(project, work, reps, steps, log):
    cores = len(os.sched_getaffinity(0))
    results = {f"{n}x{t}": [] for n, t in SCALING_CONFIGS}
    for rep in range(reps):
        for nproc, threads in SCALING_CONFIGS:
            key = f"{nproc}x{threads}"
            folder = work / f"scaling-{rep}-{key}"
            args = baked_args(SCALING_MODEL, steps, steps + 1) + ["--threads-per-rank", threads]
            run = Run(project / "train.py", args, nproc, folder)
            code = run.wait(timeout=300)
            if code != 0:
                raise RuntimeError(f"scaling run {key} exited {code}:\n{run.text()[-3000:]}")
            rate = steps_per_second(run.step_times(), 5)
            batch = int(SCALING_MODEL[SCALING_MODEL.index("--batch-size") + 1])
            results[key].append(rate * batch * nproc)
            used = threads or max(1, cores // nproc)
            log(
                f"  {nproc} rank(s) x {used} thread(s){' (default)' if not threads else ''}: "
                f"{rate * batch * nproc:8.0f} samples/s"
            )
    return results


def section_snapshot(project, package, work, reps, log):
    out = work / "stall.json"
    subprocess.run(
        [
            sys.executable,
            str(BENCH / "stall.py"),
            "--project",
            str(project),
            "--package",
            package,
            "--reps",
            str(reps),
            "--dir",
            str(work / "stall"),
            "--json",
            str(out),
        ],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    result = json.loads(out.read_text())
    shutil.rmtree(work / "stall", ignore_errors=True)
    log(
        f"  {result['parameters'] / 1e6:.1f}M parameters: async stall {median(result['async_blocked_s']):.3f} s, "
        f"sync torch.save {median(result['sync_save_s']):.2f} s"
    )
    return result


def summarize_overhead(overhead):
    rows = []
    bare_rate = median([r["steps_per_s"] for r in overhead["bare"]])
    baked_rate = median([r["steps_per_s"] for r in overhead["baked"]])
    rows.append(
        {
            "metric": "steady-state steps/s, baked / bare (2 ranks)",
            "a": f"{bare_rate:.2f} steps/s",
            "b": f"{baked_rate:.2f} steps/s",
            "ratio": baked_rate / bare_rate,
            "goal": ">= 0.98",
            "pass": baked_rate / bare_rate >= 0.98,
        }
    )
    bare_first = median([r["launch_to_first_step_s"] for r in overhead["bare"]])
    baked_first = median([r["launch_to_first_step_s"] for r in overhead["baked"]])
    rows.append(
        {
            "metric": "launch to first optimizer step, baked / bare",
            "a": f"{bare_first:.2f} s",
            "b": f"{baked_first:.2f} s",
            "ratio": baked_first / bare_first,
            "goal": "<= 1.3",
            "pass": baked_first / bare_first <= 1.3,
        }
    )
    return rows


def summarize(overhead, restart, scaling, snapshot):
    """Each metric: median values, ratio, goal, pass/fail."""
    rows = []
    if overhead:
        rows += summarize_overhead(overhead)
    if restart:
        cold = median([r["cold_launch_to_first_step_s"] for r in restart])
        back = median([r["kill_to_resumed_step_s"] for r in restart])
        rows.append(
            {
                "metric": "SIGKILL to resumed step / cold launch to first step",
                "a": f"{cold:.2f} s",
                "b": f"{back:.2f} s",
                "ratio": back / cold,
                "goal": "<= 0.2",
                "pass": back / cold <= 0.2,
            }
        )
    if snapshot:
        sync = median(snapshot["sync_save_s"])
        stall = median(snapshot["async_blocked_s"])
        rows.append(
            {
                "metric": f"stall per snapshot, {snapshot['parameters'] / 1e6:.0f}M parameters: async / sync",
                "a": f"{sync:.2f} s",
                "b": f"{stall:.3f} s",
                "ratio": stall / sync,
                "goal": "<= 0.10",
                "pass": stall / sync <= 0.10,
            }
        )
    if scaling:
        one_project, one_single = median(scaling["1x0"]), median(scaling["1x1"])
        two_project, two_single = median(scaling["2x0"]), median(scaling["2x1"])
        rows.append(
            {
                "metric": "2 ranks / (2 x 1 rank), 1 thread per rank",
                "a": f"{one_single:.0f} samples/s",
                "b": f"{two_single:.0f} samples/s",
                "ratio": two_single / (2 * one_single),
                "goal": "report",
                "pass": None,
            }
        )
        rows.append(
            {
                "metric": "2 ranks / 1 rank, project threads (cores / ranks)",
                "a": f"{one_project:.0f} samples/s",
                "b": f"{two_project:.0f} samples/s",
                "ratio": two_project / one_project,
                "goal": "report",
                "pass": None,
            }
        )
    return rows


def write_report(path, info, rows, sections, raw, command):
    lines = [
        "# Benchmark results",
        "",
        f"Written by `{command}` on {info['date']}. Medians over alternating runs; A is the baseline, B the "
        "baked project (or the async/resumed case).",
        "",
        "| machine | |",
        "|---|---|",
        f"| CPU | {info['cpu']} |",
        f"| cores (`nproc`) | {info['nproc']} |",
        f"| torch | {info['torch']} |",
        f"| python | {info['python']} |",
        f"| 1-minute load before | {info['load_before']:.2f} |",
        f"| CPU used by other processes during the run | {info['foreign_cpu_s']:.0f} s over {info['wall_s']:.0f} s "
        f"({info['foreign_cores']:.2f} cores on average) |",
        "",
        "| metric | A | B | ratio | goal | result |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        verdict = "-" if row["pass"] is None else ("pass" if row["pass"] else "FAIL")
        lines.append(f"| {row['metric']} | {row['a']} | {row['b']} | {row['ratio']:.3f} | {row['goal']} | {verdict} |")
    lines += ["", "## Sections", "", "| section | wall | other processes' CPU | load after |", "|---|---|---|---|"]
    for name, meter in sections.items():
        lines.append(
            f"| {name} | {meter['wall_s']:.0f} s | {meter['foreign_cpu_s']:.0f} s "
            f"({meter['foreign_cores']:.2f} cores) | {meter['load_after']:.2f} |"
        )
    lines += ["", "## Every run", ""]
    overhead = raw.get("overhead")
    if overhead:
        lines += [
            "Overhead (2 ranks, `" + " ".join(OVERHEAD_MODEL) + "`, steps/s after step "
            f"{WARMUP_STEPS}), in launch order:",
            "",
            "| pair | bare steps/s | baked steps/s | ratio | bare first step | baked first step | ratio |",
            "|---|---|---|---|---|---|---|",
        ]
        for i, (a, b) in enumerate(zip(overhead["bare"], overhead["baked"], strict=True)):
            lines.append(
                f"| {i} | {a['steps_per_s']:.2f} | {b['steps_per_s']:.2f} | "
                f"{b['steps_per_s'] / a['steps_per_s']:.3f} | {a['launch_to_first_step_s']:.2f} s | "
                f"{b['launch_to_first_step_s']:.2f} s | "
                f"{b['launch_to_first_step_s'] / a['launch_to_first_step_s']:.3f} |"
            )
        lines.append("")
    if raw.get("restart"):
        lines += [
            "Restart (`torchrun --max-restarts=3`, SIGKILL 1-2 s after the first step):",
            "",
            "| killed rank | cold launch to first step | kill to resumed step | x cold | "
            + " | ".join(RESTART_PHASES)
            + " | failed attempts |",
            "|---|---|---|---|" + "---|" * len(RESTART_PHASES) + "---|",
        ]
        for r in raw["restart"]:
            cold, back = r["cold_launch_to_first_step_s"], r["kill_to_resumed_step_s"]
            lines.append(
                f"| {r['victim']} | {cold:.2f} s | {back:.2f} s | {back / cold:.2f} | "
                + " | ".join(f"{r['phases_s'][name]:.2f} s" for name in RESTART_PHASES)
                + f" | {r['failed_attempts']} |"
            )
        lines.append("")
    if raw.get("scaling"):
        cores = info["nproc"]
        single = median(raw["scaling"]["1x1"])
        lines += [
            "Scaling (`" + " ".join(SCALING_MODEL) + "`, samples/s over all ranks; efficiency = samples/s / "
            "(cores busy x 1 rank with 1 thread)):",
            "",
            "| ranks x threads per rank | runs (samples/s) | median | efficiency per core |",
            "|---|---|---|---|",
        ]
        for nproc, threads in SCALING_CONFIGS:
            values = raw["scaling"][f"{nproc}x{threads}"]
            used = threads or max(1, cores // nproc)
            busy = min(cores, nproc * used)
            label = f"{nproc} x {used}" + (" (project default)" if not threads else " (`--threads-per-rank 1`)")
            lines.append(
                f"| {label} | {', '.join(f'{v:.0f}' for v in values)} | {median(values):.0f} | "
                f"{median(values) / (busy * single):.2f} |"
            )
        lines += [
            "",
            "torchrun sets `OMP_NUM_THREADS=1` only when it starts several ranks per machine; the project "
            "sets cores // ranks per machine instead (`--threads-per-rank` overrides it).",
            "",
        ]
    snap = raw.get("snapshot")
    if snap:
        gib = snap["state_bytes"] / 2**30
        lines += [
            f"Snapshot ({snap['parameters'] / 1e6:.1f}M parameters, {gib:.2f} GiB of model and AdamW state, "
            f"{snap['threads']} threads, plain training step {snap['plain_step_s']:.2f} s):",
            "",
            "| rep | sync torch.save | + fsync | async save() | async fence() | async stall | background write "
            "| steps during it | their extra time |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for i in range(snap["reps"]):
            lines.append(
                f"| {i} | {snap['sync_save_s'][i]:.2f} s | {snap['sync_save_fsync_s'][i]:.2f} s | "
                f"{snap['async_save_call_s'][i]:.3f} s | {snap['async_fence_wait_s'][i]:.3f} s | "
                f"{snap['async_blocked_s'][i]:.3f} s | {snap['async_background_s'][i]:.2f} s | "
                f"{snap['async_steps_during_write'][i]} | {snap['async_extra_step_time_s'][i]:+.2f} s |"
            )
        lines += [
            "",
            "The stall is the time the training thread spends in `Snapshots.save()` and `fence()`. The steps "
            "that run while the writer thread copies, serializes, checksums and fsyncs share the CPU with it; "
            "their extra time over a plain step is shown apart.",
            "",
        ]
    Path(path).write_text("\n".join(lines))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=6, help="bare/baked pairs for the overhead metrics")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps per overhead run")
    parser.add_argument("--kills", type=int, default=3, help="SIGKILLed jobs for the restart metric")
    parser.add_argument("--scaling-reps", type=int, default=2)
    parser.add_argument("--scaling-steps", type=int, default=40)
    parser.add_argument("--snapshot-reps", type=int, default=3)
    parser.add_argument("--only", default="overhead,restart,scaling,snapshot", help="sections to run, comma-separated")
    parser.add_argument("--quick", action="store_true", help="fewer and shorter runs, to try the benchmark out")
    parser.add_argument(
        "--wait-quiet",
        type=float,
        default=0.0,
        help="wait up to this many minutes for the 1-minute load to drop below 0.5 before starting",
    )
    parser.add_argument("--out", default=str(BENCH / "RESULTS.md"))
    parser.add_argument("--keep", action="store_true", help="keep the scratch folder")
    parser.add_argument("--project", default="", help="measure this baked project instead of baking one")
    args = parser.parse_args()
    if args.quick:
        args.pairs, args.steps, args.kills, args.scaling_reps, args.scaling_steps, args.snapshot_reps = (
            1,
            150,
            1,
            1,
            15,
            1,
        )
    sections_wanted = set(args.only.split(","))

    def log(text):
        print(text, flush=True)

    deadline = time.monotonic() + 60 * args.wait_quiet
    while load()[0] >= 0.5 and time.monotonic() < deadline:
        time.sleep(10)
    started = time.monotonic()
    info = machine()
    info["load_before"] = load()[0]
    log(f"{info['cpu']}, {info['nproc']} cores, torch {info['torch']}, 1-minute load {info['load_before']:.2f}")
    whole = CpuMeter()
    raw, meters = {}, {}
    with scratch_folder("ddp-bench-", args.keep, log) as work:
        project, package = (
            (Path(args.project).resolve(), Path(args.project).resolve().name) if args.project else bake(work / "bake")
        )
        log(f"baked {project}")
        plan = [
            ("overhead", lambda: section_overhead(project, package, work, args.pairs, args.steps, log)),
            ("restart", lambda: section_restart(project, work, args.kills, log)),
            ("scaling", lambda: section_scaling(project, work, args.scaling_reps, args.scaling_steps, log)),
            ("snapshot", lambda: section_snapshot(project, package, work, args.snapshot_reps, log)),
        ]
        for name, section in plan:
            if name not in sections_wanted:
                continue
            log(f"{name}:")
            meter = CpuMeter()
            raw[name] = section()
            meters[name] = meter.stop()
    info.update(whole.stop())
    rows = summarize(raw.get("overhead"), raw.get("restart"), raw.get("scaling"), raw.get("snapshot"))
    command = "./bench.sh" + "".join(f" {a}" for a in sys.argv[1:])
    write_report(args.out, info, rows, meters, raw, command)
    Path(args.out).with_suffix(".json").write_text(
        json.dumps({"machine": info, "rows": rows, "sections": meters, "raw": raw}, indent=1, default=str)
    )
    log("")
    for row in rows:
        verdict = "" if row["pass"] is None else ("pass" if row["pass"] else "FAIL")
        log(f"{row['metric']:60s} {row['a']:>16s} {row['b']:>16s} {row['ratio']:7.3f} {row['goal']:>8s} {verdict}")
    log(f"\n{time.monotonic() - started:.0f} s; written to {args.out}")


if __name__ == "__main__":
    main()
