"""Bake the template with its defaults and train on 2 CPU ranks; kill a worker midway and watch the job resume.

Run through ../demo.sh, which prepares the environment. Then the same job runs again without a kill, and the
summary says whether the two ended with the same weights, bit for bit; it also draws the loss curves.
"""

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from common import worker_pids  # noqa: E402  (shared with the benchmarks)

STEP = re.compile(r"step (\d+)/(\d+) ")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--max-restarts=3"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dir", default=os.environ.get("DEMO_DIR"), help="scratch folder (default: a new temp folder)")
    parser.add_argument(
        "--kill-at-step", type=int, default=150, help="kill a rank once this step is logged; 0 = no kill"
    )
    parser.add_argument("--rank", type=int, default=None, help="the rank to kill (default: 0 or 1 at random)")
    args = parser.parse_args()

    scratch = Path(args.dir or tempfile.mkdtemp(prefix="ddp-demo-")).resolve()
    scratch.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [sys.executable, "-m", "cookiecutter", "--no-input", "--overwrite-if-exists", str(ROOT), "-o", str(scratch)],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    project = scratch / "ddp_project"
    print(f"Baked the template into {project}\n", flush=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_SILENT": "true"}
    victim = random.choice([0, 1]) if args.rank is None else args.rank

    print(
        "$ torchrun --standalone --nproc_per_node=2 --max-restarts=3 train.py --log-every 25 --resume never", flush=True
    )
    command = TORCHRUN + ["train.py", "--log-every", "25", "--resume", "never"]
    agent = subprocess.Popen(command, cwd=project, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    killed_at, killed_time, last_logged, resumed_after, started = None, None, 0, None, time.monotonic()
    for line in agent.stdout:
        print(line, end="", flush=True)
        match = STEP.search(line)
        if killed_time is not None and resumed_after is None and "resuming from step" in line:
            resumed_after = time.monotonic() - killed_time
        if not match:
            continue
        last_logged = int(match.group(1))
        if args.kill_at_step and killed_at is None and last_logged >= args.kill_at_step:
            pid = worker_pids(agent.pid).get(victim)
            if pid:
                os.kill(pid, signal.SIGKILL)
                killed_at, killed_time = last_logged, time.monotonic()
                print(
                    f"\n>>> demo: killed rank {victim} (pid {pid}) with SIGKILL after step {last_logged}; torchrun "
                    "restarts the workers and they resume from the newest snapshot\n",
                    flush=True,
                )
    code = agent.wait()
    wall = time.monotonic() - started
    summary = _read_json(project / "export" / "summary.json")

    print("\nThe same job once more, uninterrupted, to compare the final weights...", flush=True)
    reference = TORCHRUN + [
        "train.py",
        "--resume",
        "never",
        "--snapshot-dir",
        "snapshots-uninterrupted",
        "--export-dir",
        "export-uninterrupted",
        "--metrics-file",
        "logs/metrics-uninterrupted.jsonl",
        "--log-file",
        "logs/uninterrupted.log",
        "--wandb",
        "disabled",
    ]
    reference_code = subprocess.run(
        reference, cwd=project, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    ).returncode
    equal = _same_weights(project / "export" / "model.pt", project / "export-uninterrupted" / "model.pt")
    plot = subprocess.run(
        [sys.executable, "-m", "ddp_project.machinery.plot", "--out", "logs/loss.png"],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
    )

    print("\nDemo summary")
    print(f"  exit code          {code}")
    print("  ranks              2 (CPU, gloo)")
    if summary:
        print(f"  optimizer steps    {summary['steps']}")
        print(f"  loss               {summary['first_loss']:.4f} (first logged) -> {summary['last_loss']:.4f} (last)")
        if summary.get("val_loss") is not None:
            print(
                f"  val_loss           {summary['val_loss']:.4f} (best {summary['best_val_loss']:.4f} at step "
                f"{summary['best_step']})"
            )
    if killed_at is not None:
        print(f"  killed             rank {victim} with SIGKILL, after step {killed_at} was logged")
        resumed_from = summary["resumed_from"] if summary else None
        if resumed_from is not None and resumed_from >= 0:
            print(
                f"  resumed            from the snapshot of step {resumed_from}"
                + (f", {resumed_after:.1f} s after the kill" if resumed_after is not None else "")
                + f"; steps {resumed_from + 1}-{killed_at} (at least) were trained again"
            )
    else:
        print("  killed             nothing")
    if reference_code == 0 and equal is not None:
        print(f"  final weights      {'bitwise EQUAL to' if equal else 'DIFFERENT from'} the uninterrupted run's")
    else:
        print(f"  final weights      not compared (the uninterrupted run exited {reference_code})")
    print(f"  exported           {project / 'export' / 'model.pt'} (final), best.pt (lowest val_loss)")
    print(f"  metrics            {project / 'logs' / 'metrics.jsonl'}")
    if plot.returncode == 0:
        print(f"  loss curves        {project / 'logs' / 'loss.png'}")
    else:
        print(f"  loss curves        not drawn: {(plot.stderr or plot.stdout).strip().splitlines()[-1:]}")
    print(f"  snapshots          {project / 'snapshots'}")
    print(f"  wall time          {wall:.1f} s (the killed job)")
    return code or (0 if equal in (True, None) else 1)


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _same_weights(a: Path, b: Path) -> bool | None:
    import torch

    try:
        first, second = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    except OSError:
        return None
    return first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


if __name__ == "__main__":
    sys.exit(main())
