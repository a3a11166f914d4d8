"""What the debugging flags cost when they are on but idle: --check-replicas and --profile-steps outside its steps.

Run: .venv/bin/python bench/debug_flags.py [--steps 300] [--repeats 3]
(bakes the template; ~2 minutes on 2 cores)

The demo on 2 CPU ranks (gloo), timed by bench/probe.py after every optimizer step, each kind of run `--repeats`
times, alternating:
- off: no debugging flag;
- --check-replicas 100: the replicas compared every 100 steps (3 checks in 300 steps);
- --check-replicas 1: compared after every step, so the added time per step is the cost of one check;
- --profile-steps outside: a range after the run's end, so the flag is set and no profiler ever starts.
Each run's speed is its steps/s from step 20 to the last; a kind's is the median of its runs. No snapshot falls in
the window. On a shared machine the runs' spread can exceed these costs, so the checksums of one check are also
timed alone, in one process on one thread (the all_gather of their small tensor comes on top).
Writes bench/DEBUG_FLAGS.md and bench/DEBUG_FLAGS.json.
"""

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import BENCH, CpuMeter, Run, bake, machine, scratch_dir, steps_per_second  # noqa: E402

WARMUP_STEPS = 20
KINDS = {
    "off": [],
    "--check-replicas 100": ["--check-replicas", "100"],
    "--check-replicas 1": ["--check-replicas", "1"],
    "--profile-steps outside": ["--profile-steps", "1000000:1000001"],
}


# One check's checksums of the demo model, timed in a process of the baked project (median of 5 x 100 calls).
CHECKSUM_TIMER = """
import statistics, time, torch
from ddp_project.config import parse_args
from ddp_project.data import build_datasets
from ddp_project.machinery.debugflags import checksums
from ddp_project.model import build_model
torch.set_num_threads(1)
cfg = parse_args([])
model = build_model(cfg, build_datasets(cfg)[0])
checksums(model)
times = []
for _ in range(5):
    start = time.perf_counter()
    for _ in range(100):
        checksums(model)
    times.append((time.perf_counter() - start) / 100)
print(statistics.median(times) * 1000, sum(p.numel() for p in model.parameters()))
"""


def checksum_ms(project):
    """(ms for one check's checksums of the demo model, its parameter count)."""
    out = subprocess.run(
        [sys.executable, "-c", CHECKSUM_TIMER], cwd=project, check=True, capture_output=True, text=True
    )
    ms, parameters = out.stdout.split()
    return float(ms), int(parameters)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    options = parser.parse_args()
    scratch = scratch_dir("debug-flags-")
    project, _ = bake(scratch)
    base = ["--max-steps", str(options.steps), "--snapshot-every", str(options.steps + 1), "--wandb", "disabled"]
    meter = CpuMeter()
    speeds = {kind: [] for kind in KINDS}
    for repeat in range(options.repeats):
        for index, (kind, flags) in enumerate(KINDS.items()):
            run = Run(project / "train.py", [*base, *flags], 2, scratch / f"run-{repeat}-{index}")
            code = run.wait(timeout=600)
            if code != 0:
                raise RuntimeError(f"{kind} exited {code}:\n{run.text()[-3000:]}")
            speeds[kind].append(steps_per_second(run.step_times(), WARMUP_STEPS))
            print(f"{kind:26s} {speeds[kind][-1]:7.1f} steps/s", flush=True)
    ms, parameters = checksum_ms(project)
    result = {
        "machine": machine(),
        "checksums_ms": ms,
        "parameters": parameters,
        "noise": meter.stop(),
        "steps": options.steps,
        "repeats": options.repeats,
        "steps_per_s": speeds,
    }
    (BENCH / "DEBUG_FLAGS.json").write_text(json.dumps(result, indent=2) + "\n")
    write_report(result)


def write_report(result):
    info, noise, speeds = result["machine"], result["noise"], result["steps_per_s"]
    off = statistics.median(speeds["off"])
    lines = [
        "# What the debugging flags cost when idle",
        "",
        f"{info['nproc']} cores ({info['cpu']}), torch {info['torch']}, Python {info['python']}, {info['date']}; "
        f"other processes used {noise['foreign_cores']:.2f} cores on average. Command: "
        f"`.venv/bin/python bench/debug_flags.py --steps {result['steps']} --repeats {result['repeats']}`.",
        "",
        f"The demo (defaults) on 2 CPU ranks, {result['steps']} optimizer steps, steps/s from step {WARMUP_STEPS} on, "
        f"{result['repeats']} runs of each kind, alternating; the median run of each kind against the median run "
        "without flags.",
        "",
        "| run | step (ms) | added per step (ms) | against off | runs (steps/s) |",
        "|---|---|---|---|---|",
    ]
    for kind, values in speeds.items():
        speed = statistics.median(values)
        added = "" if kind == "off" else f"{1000 / speed - 1000 / off:+.3f}"
        runs = ", ".join(f"{value:.1f}" for value in values)
        lines.append(f"| {kind} | {1000 / speed:.3f} | {added} | {speed / off:.3f}x | {runs} |")
    lines += [
        "",
        f"One check's checksums of the demo model ({result['parameters']:,} parameters), alone on one thread: "
        f"{result['checksums_ms']:.3f} ms; every 100 steps that is {result['checksums_ms'] / 100:.4f} ms a step.",
        "",
    ]
    (BENCH / "DEBUG_FLAGS.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
