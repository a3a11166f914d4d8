"""What --no-snapshot-copy costs in time: the training thread's wait at the snapshot steps, with and without the copy.

    python bench/snapshot_copy.py [--project /path/to/baked_project] [--repeats 2] [--out bench/SNAPSHOT_COPY.json]

The baked train.py, 2 CPU ranks (gloo), the demo MLP at --width 2048 --depth 6 (241 MiB of weights and AdamW state),
40 steps, a snapshot every 10, ddp and fsdp, --snapshot-copy and --no-snapshot-copy alternating. From each run's
summary.json: every rank's `snapshot` part of the step time (the training thread in Checkpointer.save and waiting for
the save in flight before an optimizer step; the final, blocking save is not a step's) and the steps' total.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from common import load, machine, project_in, scratch_folder

MODES = ("--snapshot-copy", "--no-snapshot-copy")
PARTS = ("data", "compute", "optimizer", "wait", "snapshot")  # summary.json's step_times, per rank


def run(project, folder, strategy, mode):
    """One run; each rank's step_times from its summary.json."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py"]
    cmd += ["--width", "2048", "--depth", "6", "--max-steps", "40", "--snapshot-every", "10", "--eval-every", "0"]
    cmd += ["--threads-per-rank", "1", "--wandb", "disabled", "--log-file", "", "--strategy", strategy, mode]
    cmd += ["--snapshot-dir", str(folder / "s"), "--export-dir", str(folder / "e"), "--metrics-file", str(folder / "m")]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "DEBUG_", "TORCHELASTIC_", "OMP_"))}
    subprocess.run(cmd, cwd=project, env=env, check=True, capture_output=True)
    return json.loads((folder / "summary.json").read_text())["step_times"]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--project", default="", help="copy this baked project instead of baking one")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "SNAPSHOT_COPY.json"))
    args = parser.parse_args()
    info = machine()
    info["load_before"] = load()[0]
    records = []
    with scratch_folder("snapshot-copy-", False) as work:
        project, _ = project_in(work, args.project)
        for repeat in range(args.repeats):
            for strategy in ("ddp", "fsdp"):
                for mode in MODES:
                    ranks = run(project, work / f"{strategy}{mode}{repeat}", strategy, mode)
                    records.append({"strategy": strategy, "mode": mode, "repeat": repeat, "ranks": ranks})
                    waits = [round(rank["snapshot"], 2) for rank in ranks]
                    print(f"{strategy} {mode} #{repeat}: snapshot wait per rank {waits} s", flush=True)
    info["load_after"] = load()[0]
    print("| strategy | mode | snapshot wait, largest rank, s (runs) | all steps, largest rank, s (runs) |")
    print("|---|---|---|---|")
    for strategy in ("ddp", "fsdp"):
        for mode in MODES:
            found = [r["ranks"] for r in records if (r["strategy"], r["mode"]) == (strategy, mode)]
            waits = [max(rank["snapshot"] for rank in ranks) for ranks in found]
            totals = [max(sum(rank[part] for part in PARTS) for rank in ranks) for ranks in found]
            print(
                f"| {strategy} | `{mode}` | {statistics.median(waits):.2f} ({', '.join(f'{w:.2f}' for w in waits)}) | "
                f"{statistics.median(totals):.2f} ({', '.join(f'{t:.2f}' for t in totals)}) |"
            )
    Path(args.out).write_text(json.dumps({"machine": info, "runs": records}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
