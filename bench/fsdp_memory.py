"""Memory per rank and training-thread stall per snapshot, --strategy ddp vs fsdp, at 1, 2 and 4 ranks.

    python bench/fsdp_memory.py [--project /path/to/baked_project] [--sizes demo,wide] [--out bench/FSDP.md]

Each configuration runs the baked train.py under torchrun (gloo, CPU) through a small wrapper that reads, when
training is over, the rank's peak resident memory (VmHWM in /proc/self/status) and the time the training thread
spent inside Checkpointer.save() and wait_until_copied() (the stall a snapshot costs it). A bare process that only
imports torch and starts a process group gives the baseline every rank pays before any model exists.
"""

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

from common import bake, machine, rank_files

SIZES = {
    "demo": [],  # the demo model as baked: width 256, depth 3
    "wide": ["--width", "2048", "--depth", "6"],
}

WRAPPER = """
import json, os, sys, time
import train
from {package}.machinery import checkpointer, snapshot, trainer

stalls = []

def timed(function):
    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            stalls.append(time.perf_counter() - started)
    return wrapper

checkpointer.Checkpointer.save = timed(checkpointer.Checkpointer.save)
snapshot.Snapshots.wait_until_copied = timed(snapshot.Snapshots.wait_until_copied)
saves = []
original_save = snapshot.Snapshots.save
def counted_save(self, *args, **kwargs):
    saves.append(1)
    return original_save(self, *args, **kwargs)
snapshot.Snapshots.save = counted_save
held = {{}}
original_close = trainer.Trainer.close
def measured_close(self):
    def local_bytes(tensor):
        tensor = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        return tensor.numel() * tensor.element_size()
    tensors = list(self.model.parameters())
    optimizer_state = self.stepper.optimizer.state.values()
    tensors += [value for state in optimizer_state for value in state.values() if hasattr(value, "numel")]
    held["state_mib"] = sum(local_bytes(tensor) for tensor in tensors) / 2**20
    held["rss_end_mib"] = int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) / 1024
    return original_close(self)
trainer.Trainer.close = measured_close
summary = train.main(sys.argv[1:])
status = open("/proc/self/status").read()
peak_kib = int(status.split("VmHWM:")[1].split()[0])
record = {{"rank": int(os.environ.get("RANK", 0)), "peak_mib": peak_kib / 1024, "stall_s": sum(stalls),
          "snapshots": len(saves), **held}}
with open(os.path.join(os.environ["MEMORY_OUT"], f"rank{{record['rank']}}.json"), "w") as handle:
    json.dump(record, handle)
"""

BASELINE = """
import os, torch, torch.distributed as dist
dist.init_process_group("gloo")
import importlib; importlib.import_module("torch._dynamo")
status = open("/proc/self/status").read()
with open(os.path.join(os.environ["MEMORY_OUT"], f"rank{os.environ['RANK']}.json"), "w") as handle:
    handle.write(str(int(status.split("VmHWM:")[1].split()[0]) / 1024))
dist.destroy_process_group()
"""


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--project", default="")
    parser.add_argument("--sizes", default="demo,wide")
    parser.add_argument("--ranks", default="1,2,4")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--snapshot-every", type=int, default=10)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "FSDP.md"))
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="fsdp-memory-"))
    project, package = (
        (Path(args.project).resolve(), Path(args.project).resolve().name) if args.project else bake(work / "bake")
    )
    wrapper, baseline = work / "measure.py", work / "baseline.py"
    wrapper.write_text(WRAPPER.format(package=package))
    baseline.write_text(BASELINE)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "DEBUG_", "TORCHELASTIC_"))}
    env.update({"PYTHONPATH": str(project), "PYTHONUNBUFFERED": "1"})

    rows, records = [], []
    base = {
        n: max(map(float, rank_files(n, str(baseline), [], project, env, work / f"baseline-{n}", timeout=1800)))
        for n in map(int, args.ranks.split(","))
    }
    for size in args.sizes.split(","):
        for nproc in map(int, args.ranks.split(",")):
            for strategy in ("ddp", "fsdp"):
                folder = work / f"{size}-{strategy}-{nproc}"
                run_args = [
                    *SIZES[size],
                    *("--strategy", strategy, "--max-steps", str(args.steps)),
                    *("--snapshot-every", str(args.snapshot_every), "--eval-every", "0", "--threads-per-rank", "1"),
                    *("--wandb", "disabled", "--log-file", "", "--metrics-file", ""),
                    *("--snapshot-dir", str(folder / "snapshots"), "--export-dir", str(folder / "export")),
                ]
                found = [
                    json.loads(text)
                    for text in rank_files(nproc, str(wrapper), run_args, project, env, folder, timeout=1800)
                ]
                peak = max(r["peak_mib"] for r in found)
                state = max(r["state_mib"] for r in found)
                stall = statistics.median(r["stall_s"] / max(1, r["snapshots"]) for r in found)
                record = {
                    "size": size,
                    "strategy": strategy,
                    "ranks": nproc,
                    "state_mib_per_rank": round(state, 1),
                    "peak_rss_mib_max_rank": round(peak, 1),
                    "baseline_mib": round(base[nproc], 1),
                    "stall_ms_per_snapshot": round(stall * 1000, 1),
                    "per_rank": found,
                }
                records.append(record)
                rows.append(
                    f"| {size} | {strategy} | {nproc} | {state:.1f} | {peak:.0f} | {peak - base[nproc]:.0f} | "
                    f"{stall * 1000:.1f} |"
                )
                print(rows[-1], flush=True)
    text = "\n".join(
        [
            "# --strategy ddp vs fsdp: memory per rank and snapshot stall (CPU, gloo)",
            "",
            f"Machine: {machine()}. {args.steps} steps, a snapshot every {args.snapshot_every}, one thread per rank.",
            f"Sizes: demo = the baked demo model (width 256, depth 3); wide = {' '.join(SIZES['wide'])}.",
            "State = the parameters and AdamW's two moments this rank holds at the end (its shards under fsdp), the",
            "memory sharding divides. Peak RSS = the largest VmHWM (peak resident memory) among the ranks, whole",
            "process; above baseline = minus the peak of a rank that only imports torch (and dynamo) and starts a",
            "process group. Stall = the training thread's time inside Checkpointer.save() and wait_until_copied(), per",
            "snapshot (median over ranks).",
            "",
            "| model | strategy | ranks | state MiB per rank | peak RSS MiB | above baseline MiB | stall ms/snapshot |",
            "|---|---|---|---|---|---|---|",
            *rows,
            "",
            "```json",
            json.dumps(records, indent=1),
            "```",
            "",
        ]
    )
    Path(args.out).write_text(text)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
