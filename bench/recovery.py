"""Recovery: what one SIGKILLed worker costs a torchrun job, phase by phase, at 2 and 4 CPU ranks, cold and warm.

Run: .venv/bin/python bench/recovery.py [--kills N] [--ranks 2 4]   (bakes the template; ~30 s per kill)

Each kill: `torchrun --standalone --nproc_per_node=R --max-restarts=3` runs the baked demo under recovery_probe.py
(a clock on each phase of a worker's start), logging every step; 1-2 s after the first step a random rank gets
SIGKILL. The phases, from the kill to the restarted job's first step (the slowest rank's clock at each point):
    detect          the kill -> torchrun's "closing signal" line (its monitor polls every 0.1 s)
    stop survivors  -> its "failed (exitcode" line, logged once the survivors have exited
    respawn         -> the new worker processes exist (the agent's new rendezvous round, its new store)
    import torch    -> `import torch` done in the new workers (interpreter start included; warm: the hand-off to
                       the zygote, its fork, and the project's own modules imported again in the fork)
    rendezvous + pg -> init_process_group returned (the package's imports, settings, the job lock, the store)
    snapshot load   -> the snapshot read (torch.load) returned (model and data built before it)
    first step      -> the first optimizer step done (DDP and its dynamo import, bucket settling, the step)
plus the steps trained again (the kill came after step K was logged; the job resumed from its snapshot S < K) in
seconds at the measured step rate. Cold start: launch -> first step of the first attempt, with the same phases.
Each kill runs twice: with WARM_RESTART=0 (the restarted workers are new interpreters: the cold restart, as before
machinery/warmstart.py) and as shipped (warm: each restarted rank runs in a fork of the job's zygote).
Writes bench/RECOVERY.md and bench/RECOVERY.json.
"""

import argparse
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    BENCH,
    FAILED,
    STOPPING,
    CpuMeter,
    agent_time,
    bake,
    child_env,
    machine,
    scratch_dir,
    wait_for,
    worker_pids,
)

PROBE = BENCH / "recovery_probe.py"
ARGS = ["--max-steps", "1000000", "--snapshot-every", "20", "--log-every", "1", "--wandb", "disabled"]
WORKER_PHASES = ["torch_imported", "process_group", "snapshot_loaded", "first_step"]


def logged_steps(metrics):
    try:
        return [json.loads(line)["step"] for line in metrics.read_text().splitlines() if line.endswith("}")]
    except OSError:
        return []


def phases(probe_dir, attempt):
    """{phase: latest time over the ranks} of one attempt, and the ranks' resumed step."""
    files = sorted(probe_dir.glob(f"phases-rank*-attempt{attempt}.json"))
    records = [json.loads(f.read_text()) for f in files]
    result = {"process_start": max(r["process_start"] for r in records)}
    for phase in WORKER_PHASES:
        values = [r[phase] for r in records if phase in r]
        if values:
            result[phase] = max(values)
    result["resumed_from"] = records[0]["step_count"] - 1
    result["warm"] = sum(bool(r.get("warm")) for r in records)  # ranks that ran in a fork of the zygote
    return result, len(records)


def zygote_memory(agent):
    """{"rss": MB, "pss": MB} of the zygote of the torchrun agent `agent` (machinery/warmstart.py; its copy-on-write
    pages shared with the worker it was forked from count half in pss), or None without one."""
    title = f"warm-restart for torchrun pid {agent}".encode()
    for entry in os.listdir("/proc"):
        try:
            if not entry.isdigit() or not Path(f"/proc/{entry}/cmdline").read_bytes().startswith(title):
                continue
            rollup = Path(f"/proc/{entry}/smaps_rollup").read_text().splitlines()[1:]
            fields = dict(line.split(":", 1) for line in rollup)
        except OSError:
            continue
        return {name.lower(): int(fields[name].split()[0]) / 1024 for name in ("Rss", "Pss")}
    return None


def one_kill(project, folder, ranks, mode):
    probe_dir = folder / "probe"
    probe_dir.mkdir(parents=True)
    metrics = folder / "metrics.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
    cmd += ["--max-restarts=3", str(PROBE), str(project / "train.py"), *ARGS]
    cmd += ["--snapshot-dir", str(folder / "snapshots"), "--metrics-file", str(metrics)]
    cmd += ["--export-dir", str(folder / "export"), "--log-file", str(folder / "train.log")]
    output = folder / "torchrun.out"
    launched = time.time()
    with open(output, "w") as out:
        env = child_env(probe_dir, **({"WARM_RESTART": "0"} if mode == "cold" else {}))
        proc = subprocess.Popen(cmd, cwd=folder, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: list(probe_dir.glob("phases-rank*-attempt0.json")), 300, "the first step")
        time.sleep(random.uniform(1.0, 2.0))
        zygote = zygote_memory(proc.pid)
        pids = worker_pids(proc.pid)
        victim = random.randrange(ranks)
        before = logged_steps(metrics)
        killed = time.time()
        os.kill(pids[victim], signal.SIGKILL)
        wait_for(lambda: len(list(probe_dir.glob("phases-rank*-attempt1.json"))) == ranks, 300, "the resumed step")
        time.sleep(1.0)  # a few steps of the resumed job, for the step rate
        steps_at_kill = max(before) if before else 0
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    cold, _ = phases(probe_dir, 0)
    warm, _ = phases(probe_dir, 1)
    text = output.read_text(errors="replace")
    rates = _step_seconds(folder / "train.log")
    redone = max(0, steps_at_kill - warm["resumed_from"])
    return {
        "ranks": ranks,
        "mode": mode,
        "victim": victim,
        "cold": {"launch": launched, **cold},
        "kill": killed,
        "stopping": agent_time(STOPPING, text),
        "failed": agent_time(FAILED, text),
        "restart": warm,
        "zygote_mb": zygote,
        "steps_at_kill": steps_at_kill,
        "steps_redone": redone,
        "step_s": rates,
        "redone_s": redone * rates,
    }


def _step_seconds(log):
    """Median seconds per optimizer step, from rank 0's samples/s lines in the log."""
    text = log.read_text(errors="replace")
    rates = [float(m) for m in re.findall(r"(\d+) samples/s", text)]
    batch = re.search(r"= (\d+) samples/step", text)
    if not rates or not batch:
        return 0.0
    return int(batch.group(1)) / statistics.median(rates)


def breakdown(result):
    """[(phase, seconds)] from the kill to the first resumed step, and of the cold start."""
    warm, cold = result["restart"], result["cold"]
    # No "closing signal" line before the failure: the survivors had left before the agent signalled them.
    stopping = min(result["stopping"] or result["failed"], result["failed"])
    restart = [
        ("detect", stopping - result["kill"]),
        ("stop survivors", result["failed"] - stopping),
        ("respawn", warm["process_start"] - result["failed"]),
        ("import torch", warm["torch_imported"] - warm["process_start"]),
        ("rendezvous + pg", warm["process_group"] - warm["torch_imported"]),
        ("snapshot load", warm.get("snapshot_loaded", warm["process_group"]) - warm["process_group"]),
        ("first step", warm["first_step"] - warm.get("snapshot_loaded", warm["process_group"])),
    ]
    start = [
        ("launch -> workers", cold["process_start"] - cold["launch"]),
        ("import torch", cold["torch_imported"] - cold["process_start"]),
        ("rendezvous + pg", cold["process_group"] - cold["torch_imported"]),
        ("first step", cold["first_step"] - cold["process_group"]),
    ]
    return restart, start


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    options = parser.parse_args()
    scratch = scratch_dir("recovery-")
    project, _ = bake(scratch / "bake")
    meter = CpuMeter()
    results = []
    for ranks in options.ranks:
        for index in range(options.kills):
            for mode in ("cold", "warm"):  # interleaved: both modes see the same machine
                result = one_kill(project, scratch / f"r{ranks}-{index}-{mode}", ranks, mode)
                results.append(result)
                restart, _ = breakdown(result)
                total = result["restart"]["first_step"] - result["kill"]
                cold = result["cold"]["first_step"] - result["cold"]["launch"]
                print(
                    f"{ranks} ranks, kill {index}, {mode} restart ({result['restart']['warm']} ranks warm): "
                    f"kill -> step {total:.2f} s, cold start {cold:.2f} s, "
                    + ", ".join(f"{name} {seconds:.2f}" for name, seconds in restart)
                    + f", redone {result['steps_redone']} steps {result['redone_s']:.2f} s",
                    flush=True,
                )
    noise = meter.stop()
    info = machine()
    (BENCH / "RECOVERY.json").write_text(json.dumps({"machine": info, "noise": noise, "runs": results}, indent=1))
    write_report(results, info, noise, options)
    shutil.rmtree(scratch, ignore_errors=True)


def _median_phases(runs, which):
    names = [name for name, _ in breakdown(runs[0])[which]]
    return {name: statistics.median(dict(breakdown(r)[which])[name] for r in runs) for name in names}


def write_report(results, info, noise, options):
    ranks_text = " ".join(map(str, options.ranks))
    lines = [
        "# Recovery: one SIGKILLed worker, phase by phase",
        "",
        f"`torchrun --standalone --max-restarts=3` on the baked demo, {options.kills} kills per rank count and mode",
        "(a random rank, 1-2 s after the first step), snapshots every 20 steps. Cold restart: `WARM_RESTART=0`, the",
        "restarted workers are new interpreters (the only kind before machinery/warmstart.py). Warm restart: as",
        "shipped, each restarted rank runs in a fork of the job's zygote, which has torch imported. Medians; the",
        f"slowest rank's clock at each point. {info['cores']} cores ({info['cpu']}), torch {info['torch']}, Python",
        f"{info['python']}, {info['date']}; other processes used {noise['foreign_cores']:.2f} cores on average.",
        f"Command: `.venv/bin/python bench/recovery.py --kills {options.kills} --ranks {ranks_text}`.",
        "",
    ]
    for ranks in options.ranks:
        runs = {mode: [r for r in results if r["ranks"] == ranks and r["mode"] == mode] for mode in ("cold", "warm")}
        every = runs["cold"] + runs["warm"]
        cold_start = statistics.median(r["cold"]["first_step"] - r["cold"]["launch"] for r in every)
        start = _median_phases(every, 1)
        lines += [f"## {ranks} ranks", "", f"Cold start (launch -> first step): **{cold_start:.2f} s**.", ""]
        totals = {}
        for mode, mode_runs in runs.items():
            total = statistics.median(r["restart"]["first_step"] - r["kill"] for r in mode_runs)
            own_cold = statistics.median(r["cold"]["first_step"] - r["cold"]["launch"] for r in mode_runs)
            redone = statistics.median(r["redone_s"] for r in mode_runs)
            steps = statistics.median(r["steps_redone"] for r in mode_runs)
            warm_ranks = min(r["restart"]["warm"] for r in mode_runs)
            totals[mode] = total
            lines.append(
                f"- {mode} restart: kill -> first resumed step **{total:.2f} s** = **{total / own_cold:.2f}x** the "
                f"cold start of the same runs ({own_cold:.2f} s); with the {steps:.0f} steps trained again "
                f"({redone:.2f} s): {(total + redone) / own_cold:.2f}x. Ranks in a fork of the zygote after the "
                f"restart: {warm_ranks} of {ranks}."
            )
        memory = [r["zygote_mb"] for r in runs["warm"] if r["zygote_mb"]]
        if memory:
            lines.append(
                f"- the zygote's memory before the kill: rss {statistics.median(m['rss'] for m in memory):.0f} MB, "
                f"pss {statistics.median(m['pss'] for m in memory):.0f} MB (pages it shares with the worker it was "
                "forked from count half)."
            )
        phase_rows = {mode: _median_phases(mode_runs, 0) for mode, mode_runs in runs.items()}
        lines += [
            "",
            "| phase of the recovery | cold restart s | warm restart s | | phase of the cold start | s |",
            "|---|---|---|---|---|---|",
        ]
        start_rows = list(start.items())
        for i, name in enumerate(phase_rows["cold"]):
            right = f"| {start_rows[i][0]} | {start_rows[i][1]:.2f} |" if i < len(start_rows) else "| | |"
            lines.append(f"| {name} | {phase_rows['cold'][name]:.2f} | {phase_rows['warm'][name]:.2f} | {right}")
        lines.append(f"| **kill -> first resumed step** | **{totals['cold']:.2f}** | **{totals['warm']:.2f}** | | | |")
        lines.append("")
    (BENCH / "RECOVERY.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
