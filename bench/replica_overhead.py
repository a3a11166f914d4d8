"""What replica groups add per step when nothing fails, and whether torchft's runtime settings change it.

Run: .venv/bin/python bench/replica_overhead.py [--width 256] [--steps 300] [--repeats 4]
(bakes the template; needs torchft, which requirements-dev.txt installs; ~5 minutes)

The steady state of bench/replica_groups.py (one torchrun job of 2 ranks against 2 replica groups of 1 rank, the
same global batch, every step logged), with the replica groups run in several settings of torchft's own runtime,
all runs alternating: torchrun path, then each setting, `--repeats` times. Each run's speed is its median
samples/s after step 50. Settings (environment variables read by torchft's Rust side, in the workers and the
lighthouse):
- as shipped;
- RUST_LOG=warn: the lighthouse no longer logs each step's quorum (the workers already log at warn);
- TOKIO_WORKER_THREADS=1: torchft's async runtimes (manager server, manager client, lighthouse) run on one thread
  each instead of one per core.
Writes bench/REPLICA_OVERHEAD.md and bench/REPLICA_OVERHEAD.json.
"""

import argparse
import importlib.metadata
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import BENCH, CpuMeter, bake, child_env, machine, scratch_dir  # noqa: E402
from replica_groups import BASE, GLOBAL_BATCH, files, replica_run, speed, torchrun  # noqa: E402

SETTINGS = {
    "as shipped": {},
    "RUST_LOG=warn": {"RUST_LOG": "warn"},
    "TOKIO_WORKER_THREADS=1": {"TOKIO_WORKER_THREADS": "1"},
}


def replica_run_with(project, args, folder, name, extra):
    """replica_run with `extra` in the environment of the lighthouse and both groups."""
    saved = dict(os.environ)
    os.environ.update(extra)
    try:
        return replica_run(project, args, folder, name)
    finally:
        os.environ.clear()
        os.environ.update(saved)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=4)
    options = parser.parse_args()
    scratch = scratch_dir("replica-overhead-")
    project, _ = bake(scratch, replica_groups="yes")
    folder = scratch / "runs"
    folder.mkdir()
    args = BASE + ["--max-steps", str(options.steps), "--width", str(options.width)]
    args += ["--snapshot-every", str(options.steps)]
    meter = CpuMeter()
    runs = {"torchrun path": [], **{name: [] for name in SETTINGS}}
    for repeat in range(options.repeats):
        name = f"torchrun{repeat}"
        job = torchrun(project, 2, args + files(folder, name), folder / f"{name}.out", child_env(folder / "probe"))
        assert job.wait(600) == 0, (folder / f"{name}.out").read_text()[-3000:]
        runs["torchrun path"].append(speed(folder / f"{name}.jsonl"))
        for index, (setting, extra) in enumerate(SETTINGS.items()):
            runs[setting].append(replica_run_with(project, args, folder, f"ft{index}-{repeat}", extra))
        print(repeat, {k: round(v[-1]) for k, v in runs.items()}, flush=True)
    result = {"machine": machine(), "noise": meter.stop(), "options": vars(options), "runs": runs}
    result["torchft"] = importlib.metadata.version("torchft")
    (BENCH / "REPLICA_OVERHEAD.json").write_text(json.dumps(result, indent=2) + "\n")
    write_report(result)


def write_report(result):
    info, runs, options = result["machine"], result["runs"], result["options"]
    plain = runs["torchrun path"]
    plain_ms = 1000 * GLOBAL_BATCH / statistics.median(plain)
    lines = [
        "# What replica groups add per step, and torchft's runtime settings",
        "",
        f"{info['nproc']} cores ({info['cpu']}), torch {info['torch']}, Python {info['python']}, {info['date']}; "
        f"other processes used {result['noise']['foreign_cores']:.2f} cores on average. torchft {result['torchft']}. "
        "Command: "
        f"`.venv/bin/python bench/replica_overhead.py --width {options['width']} --steps {options['steps']} "
        f"--repeats {options['repeats']}`.",
        "",
        f"Demo model at `--width {options['width']}`: one torchrun job of 2 ranks against 2 replica groups of 1 rank, "
        f"{GLOBAL_BATCH} samples a step, {options['repeats']} runs of each kind, alternating. Step: from the median "
        "of the runs' samples/s; per pair: each replica-group run against the torchrun run of the same round.",
        "",
        "| run | step (ms) | added per step (ms) | against the torchrun path | per pair |",
        "|---|---|---|---|---|",
        f"| torchrun path | {plain_ms:.2f} | | 1.00x | |",
    ]
    for setting in SETTINGS:
        values = runs[setting]
        step_ms = 1000 * GLOBAL_BATCH / statistics.median(values)
        pairs = ", ".join(f"{v / p:.2f}" for v, p in zip(values, plain, strict=True))
        lines.append(
            f"| replica groups, {setting} | {step_ms:.2f} | {step_ms - plain_ms:.2f} | "
            f"{statistics.median(values) / statistics.median(plain):.2f}x | {pairs} |"
        )
    (BENCH / "REPLICA_OVERHEAD.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
