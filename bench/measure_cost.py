"""What measuring costs per step, in one process (machinery/measure.py): less noisy than whole runs on a busy machine.

    python bench/measure_cost.py [--blocks 40] [--steps 25] [--json bench/MEASURE_COST.json]

Bakes the template and imports its machinery. A model the size of the demo (32 -> 256 x 3 -> 10, AdamW, batch 32)
trains in blocks of `--steps` steps, alternately with the measuring of each step (the six marks of the loop, token
counting, and the gradient hooks that ddp on CPU gets) and without; each reports the median and the fastest time
per step over its blocks (on a busy machine both swing more than the measuring costs). Apart, each the fastest of
many repetitions: one mark (done()), one gradient hook (256 scalar parameters' backward with and without hooks),
and the per-step cost they make for this model (6 marks, a hook per parameter) against its fastest step; the time
of interval() (what a logged step adds: reading and resetting the peak memory, in one process) and of the
all-gather it makes on 2 gloo ranks (2 processes on this machine).
"""

import argparse
import importlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path

import torch
import torch.multiprocessing as mp
from common import bake


def gather_times(rank, store, reps, results):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    values, rows = torch.zeros(2, dtype=torch.float64), [torch.zeros(2, dtype=torch.float64) for _ in range(2)]
    for _ in range(20):
        dist.all_gather(rows, values)
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        dist.all_gather(rows, values)
        times.append(time.perf_counter() - started)
    results[rank] = statistics.median(times)
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=40)
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="measure-cost-") as scratch:
        project, package = bake(Path(scratch) / "bake")
        sys.path.insert(0, str(project))
        measure = importlib.import_module(f"{package}.machinery.measure")
        distributed = importlib.import_module(f"{package}.machinery.distributed")

        torch.manual_seed(0)
        layers = [torch.nn.Linear(32, 256), torch.nn.ReLU()]
        for _ in range(2):
            layers += [torch.nn.Linear(256, 256), torch.nn.ReLU()]
        model = torch.nn.Sequential(*layers, torch.nn.Linear(256, 10))
        optimizer = torch.optim.AdamW(model.parameters())
        batch = (torch.randn(32, 32), torch.randint(0, 10, (32,)))
        stepper = types.SimpleNamespace(
            parallel=types.SimpleNamespace(model=model, sharded=False), optimizer=optimizer, step_count=None
        )
        # the hooks ddp on CPU gets (a process group of 2 is not needed to register them)
        marks = measure.Measure(types.SimpleNamespace(amp="off"), distributed.DistEnv(world_size=2), stepper)
        marks._first_step = False  # its one-off line gathers over ranks: left out here

        def step(measured):
            if measured:
                marks.begin_step()
                marks.done("data")
            loss = torch.nn.functional.cross_entropy(model(batch[0]), batch[1])
            loss.backward()
            if measured:
                marks.done("compute", [batch])
                marks.done("snapshot")
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if measured:
                marks.done("optimizer")
                marks.done(None)
                marks.done("snapshot")

        for _ in range(50):
            step(True)
        per_step = {True: [], False: []}
        for block in range(2 * args.blocks):
            measured = block % 2 == 0
            started = time.perf_counter()
            for _ in range(args.steps):
                step(measured)
            per_step[measured].append((time.perf_counter() - started) / args.steps)

        # The parts alone, each the fastest of many repetitions (the least disturbed by a busy machine)
        def fastest(function, reps=30, calls=1000):
            best = float("inf")
            for _ in range(reps):
                started = time.perf_counter()
                for _ in range(calls):
                    function()
                best = min(best, (time.perf_counter() - started) / calls)
            return best

        mark = fastest(lambda: marks.done("data"))
        scalars = [torch.zeros((), requires_grad=True) for _ in range(256)]

        def backward():
            torch.stack(scalars).sum().backward()

        plain_backward = fastest(backward, calls=20)
        handles = [scalar.register_post_accumulate_grad_hook(marks._gradients.accumulated) for scalar in scalars]
        hooked_backward = fastest(backward, calls=20)
        for handle in handles:
            handle.remove()
        hook = (hooked_backward - plain_backward) / len(scalars)

        single = measure.Measure(types.SimpleNamespace(amp="off"), distributed.DistEnv(), stepper)
        interval = []
        for _ in range(200):
            started = time.perf_counter()
            single.interval(1.0, 1)
            interval.append(time.perf_counter() - started)

        results = mp.Manager().dict()
        mp.spawn(gather_times, args=(Path(scratch) / "store", 500, results), nprocs=2)
        gather = max(results.values())

    parameters = len(list(model.parameters()))
    report = {
        "machine": f"{os.cpu_count()} cores, torch {torch.__version__}, Python {platform.python_version()}",
        "load_average": round(os.getloadavg()[0], 1),
        "step_ms_without_median": round(statistics.median(per_step[False]) * 1e3, 3),
        "step_ms_with_median": round(statistics.median(per_step[True]) * 1e3, 3),
        "step_ms_without_fastest": round(min(per_step[False]) * 1e3, 3),
        "step_ms_with_fastest": round(min(per_step[True]) * 1e3, 3),
        "mark_us": round(mark * 1e6, 3),
        "hook_us": round(hook * 1e6, 3),
        # the loop's 6 marks and one hook per parameter, against the fastest step without measuring
        "per_step_cost_us": round((6 * mark + parameters * hook) * 1e6, 1),
        "per_step_cost_share": round((6 * mark + parameters * hook) / min(per_step[False]), 5),
        "interval_ms": round(statistics.median(interval) * 1e3, 3),
        "all_gather_ms_2_ranks": round(gather * 1e3, 3),
    }
    print(json.dumps(report, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
