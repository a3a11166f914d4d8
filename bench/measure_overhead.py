"""What measuring a run costs (machinery/measure.py): steps/s of the baked project with and without it.

    python bench/measure_overhead.py [--steps 400] [--pairs 3] [--json bench/MEASURE.json]

Bakes the template, then runs train.py on 2 CPU ranks (torchrun, gloo) in pairs, one run with the measuring and
one with it replaced by a part that does nothing (a script in the bake swaps it in before train.main; the product
has no switch for it). Each run times its own steps on rank 0 (the time from the end of step `--skip` to the end of
the last, logging included) and writes steps/s and rank 0's CPU time per step (process_time: its threads too,
which a busy machine disturbs far less than the wall clock); each configuration reports the median of the pairs
and each pair's ratio (with / without). Configurations: the demo model (about 143k parameters, the worst case: a
step of a few ms, so the fixed cost per step weighs most) at --log-every 10 and at --log-every 1 (a log, and so an
all-gather, every step), and with --wide a wider model (--width 1024 --depth 4).
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from common import bake, child_env

# Run in the bake in place of train.py: times the steps on rank 0; MEASURE=off swaps in a measure that does nothing.
TIMED = """
import os, sys, time
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train
from ddp_project.machinery import measure, trainer

if os.environ.get("MEASURE") == "off":
    import contextlib

    class Unmeasured(measure.Measure):
        def __init__(self, cfg, env, stepper):
            pass

        def done(self, part, micro_batches=None):
            pass

        def counting_flops(self):
            return contextlib.nullcontext()

        def interval(self, seconds, steps):
            return {"peak_memory_mib": 0.0, "peak_memory_rank": 0}

        def summary(self):
            return [], None

    trainer.Measure = Unmeasured

ends, cpu = [], []
step = trainer.Trainer.optimizer_step


def timed(self):
    stepped = step(self)
    ends.append(time.perf_counter())
    cpu.append(time.process_time())
    return stepped


trainer.Trainer.optimizer_step = timed
train.main(sys.argv[1:])
if os.environ.get("RANK", "0") == "0":
    skip = int(os.environ["SKIP_STEPS"])
    steps = len(ends) - 1 - skip
    with open(os.environ["STEPS_OUT"], "w") as out:
        out.write(f"{steps / (ends[-1] - ends[skip])} {(cpu[-1] - cpu[skip]) / steps * 1000}")
"""


def steps_per_s(project, scratch, args, measuring, skip):
    out = scratch / "steps.txt"
    env = child_env(scratch, MEASURE="on" if measuring else "off", STEPS_OUT=out, SKIP_STEPS=skip)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "timed_train.py"]
    cmd += args + ["--resume", "never", "--wandb", "disabled", "--snapshot-every", "100000"]
    cmd += ["--snapshot-dir", str(scratch / "snapshots"), "--export-dir", str(scratch / "export")]
    cmd += ["--metrics-file", str(scratch / "metrics.jsonl"), "--log-file", str(scratch / "train.log")]
    subprocess.run(cmd, cwd=project, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rate, cpu_ms = out.read_text().split()
    return float(rate), float(cpu_ms)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--skip", type=int, default=50, help="steps left out at the start (warm-up)")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--json", default="")
    parser.add_argument("--wide", action="store_true", help="also the wider model")
    args = parser.parse_args()
    configurations = {"demo, --log-every 10": ["--log-every", "10"], "demo, --log-every 1": ["--log-every", "1"]}
    if args.wide:
        configurations["--width 1024 --depth 4, --log-every 10"] = [
            "--log-every",
            "10",
            "--width",
            "1024",
            "--depth",
            "4",
        ]
    results = {}
    with tempfile.TemporaryDirectory(prefix="measure-bench-") as scratch:
        scratch = Path(scratch)
        project, _ = bake(scratch / "bake")
        (project / "timed_train.py").write_text(TIMED)
        for name, extra in configurations.items():
            run_args = ["--max-steps", str(args.steps), "--eval-every", "0", *extra]
            pairs = []
            for _ in range(args.pairs):
                with_it = steps_per_s(project, scratch, run_args, True, args.skip)
                without = steps_per_s(project, scratch, run_args, False, args.skip)
                pairs.append((with_it, without))
                print(f"{name}: with {with_it}, without {without} (steps/s, CPU ms per step)", flush=True)
            median = lambda index, which, pairs=pairs: statistics.median(p[which][index] for p in pairs)  # noqa: E731
            results[name] = {
                "steps_per_s_with": round(median(0, 0), 2),
                "steps_per_s_without": round(median(0, 1), 2),
                "steps_per_s_ratio": round(median(0, 0) / median(0, 1), 4),
                "cpu_ms_per_step_with": round(median(1, 0), 3),
                "cpu_ms_per_step_without": round(median(1, 1), 3),
                "cpu_ratio": round(median(1, 0) / median(1, 1), 4),
                "pair_ratios_steps_per_s": [round(a[0] / b[0], 4) for a, b in pairs],
                "pair_ratios_cpu": [round(a[1] / b[1], 4) for a, b in pairs],
            }
            print(name, results[name], flush=True)
    machine = f"{os.cpu_count()} cores, torch {torch.__version__}, Python {platform.python_version()}"
    report = {"machine": machine, "steps": args.steps, "skip": args.skip, "pairs": args.pairs, "results": results}
    print(json.dumps(report, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
