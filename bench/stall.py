"""Stall per snapshot, in one process: the baked project's background save vs a synchronous torch.save.

    python stall.py --project /path/to/baked_project [--width 4096 --depth 7] [--reps 3] [--json out.json]

A model of the baked project's class (about 100M parameters by default) trains with AdamW on random data,
as the baked training loop does. Alternately:
  sync    torch.save of the same state (model + AdamW state + schedule) on the training thread, as a plain
          loop saves (and, reported apart, the fsync that makes it durable);
  async   the training loop's own sequence: Snapshots.save() after an optimizer step, the next step's
          forward and backward, fence(), optimizer.step(). The stall is the time the training thread spends
          inside save() and fence(). The steps that run while the writer thread is still busy are timed too,
          so the cost of sharing the CPU with it shows as well.
"""

import argparse
import copy
import importlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--project", required=True)
    parser.add_argument("--package", default="ddp_project")
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--depth", type=int, default=7)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dir", default="", help="folder for the files (default: under --project)")
    parser.add_argument("--json", default="", help="write the results here too")
    args = parser.parse_args()

    sys.path.insert(0, os.path.abspath(args.project))
    model_module = importlib.import_module(f"{args.package}.model")
    snapshot = importlib.import_module(f"{args.package}.machinery.snapshot")
    distributed = importlib.import_module(f"{args.package}.machinery.distributed")
    folder = Path(args.dir or Path(args.project) / "stall-bench")
    folder.mkdir(parents=True, exist_ok=True)

    torch.manual_seed(0)
    model = model_module.MLP(32, 10, width=args.width, depth=args.depth, dropout=0.1)
    parameters = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    inputs = torch.randn(args.batch_size, 32)
    labels = torch.randint(0, 10, (args.batch_size,))
    snapshots = snapshot.Snapshots(str(folder / "snapshots"), distributed.DistEnv(), keep=2)
    step = [0]

    def forward_backward():
        F.cross_entropy(model(inputs), labels).backward()

    def optimizer_step():
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        step[0] += 1

    def train_step():
        start = time.perf_counter()
        forward_backward()
        optimizer_step()
        return time.perf_counter() - start

    def state():  # what the baked trainer's snapshot_state() gathers
        return {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": copy.deepcopy(scheduler.state_dict()),
            "scaler": {},
            "step": step[0],
            "progress": {"step": step[0]},
            "config": vars(args),
            "run_id": "bench",
            "torch_version": str(torch.__version__),
        }

    for _ in range(3):  # AdamW's state exists after the first step; the rest warms the allocator
        train_step()
    state_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    state_bytes += sum(
        t.numel() * t.element_size()
        for s in optimizer.state.values()
        for t in s.values()
        if isinstance(t, torch.Tensor)
    )

    plain_steps, sync, durable, blocked, save_call, fence_wait, extra, background, writer_steps = ([] for _ in range(9))
    for rep in range(args.reps):
        plain_steps += [train_step() for _ in range(2)]

        # sync: a plain torch.save on the training thread
        path = folder / f"sync-{rep}.pt"
        start = time.perf_counter()
        with open(path, "wb") as handle:
            torch.save(state(), handle)
            saved = time.perf_counter()
            handle.flush()
            os.fsync(handle.fileno())
        sync.append(saved - start)
        durable.append(time.perf_counter() - start)
        path.unlink()
        plain_steps += [train_step() for _ in range(2)]

        # async: the baked loop's sequence
        start = time.perf_counter()
        snapshots.save(step[0], state(), {"rng": snapshot.capture_rng()})
        called = time.perf_counter()
        forward_backward()
        fenced = time.perf_counter()
        snapshots.wait_until_copied()
        waited = time.perf_counter()
        optimizer_step()
        first_step = time.perf_counter() - called
        save_call.append(called - start)
        fence_wait.append(waited - fenced)
        blocked.append((called - start) + (waited - fenced))
        times = [first_step]
        while snapshots._thread is not None and snapshots._thread.is_alive():
            times.append(train_step())
        snapshots.wait()
        background.append(time.perf_counter() - start)
        writer_steps.append(times)

    base = statistics.median(plain_steps)
    for times in writer_steps:
        extra.append(sum(t - base for t in times))
    result = {
        "parameters": parameters,
        "state_bytes": state_bytes,
        "reps": args.reps,
        "plain_step_s": base,
        "sync_save_s": sync,
        "sync_save_fsync_s": durable,
        "async_blocked_s": blocked,
        "async_save_call_s": save_call,
        "async_fence_wait_s": fence_wait,
        "async_background_s": background,
        "async_steps_during_write": [len(t) for t in writer_steps],
        "async_extra_step_time_s": extra,
        "threads": torch.get_num_threads(),
    }
    text = json.dumps(result, indent=1)
    if args.json:
        Path(args.json).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
