"""Bake the template with its defaults and train on 2 CPU ranks; kill a worker midway and watch the job resume.

Run through ../demo.sh, which prepares the environment. Prints a short summary at the end.
"""

import argparse
import os
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

STEP = re.compile(r"step (\d+)/(\d+) .*loss ([\d.]+)")


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dir", default=os.environ.get("DEMO_DIR"), help="scratch folder (default: a new temp folder)")
    parser.add_argument("--kill-at-step", type=int, default=150, help="kill rank 1 once this step is logged; 0 = no kill")
    args = parser.parse_args()

    scratch = Path(args.dir or tempfile.mkdtemp(prefix="ddp-demo-")).resolve()
    scratch.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "cookiecutter", "--no-input", "--overwrite-if-exists", str(ROOT), "-o",
                    str(scratch)], check=True, stdout=subprocess.DEVNULL)
    project = scratch / "ddp_project"
    print(f"Baked the template into {project}\n", flush=True)

    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--max-restarts=3",
               "train.py", "--log-every", "25"]
    print("$ torchrun --standalone --nproc_per_node=2 --max-restarts=3 train.py --log-every 25", flush=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_SILENT": "true"}
    agent = subprocess.Popen(command, cwd=project, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    killed_at, losses, steps, resumed_at, started = None, [], 0, None, time.monotonic()
    for line in agent.stdout:
        print(line, end="", flush=True)
        resumed = re.search(r"resuming from step (\d+)", line)
        resumed_at = int(resumed.group(1)) if resumed else resumed_at
        match = STEP.search(line)
        if match:
            losses.append(float(match.group(3)))
            step = steps = int(match.group(1))
            if args.kill_at_step and killed_at is None and step >= args.kill_at_step:
                victim = worker_pids(agent.pid).get(1)
                if victim:
                    os.kill(victim, signal.SIGKILL)
                    killed_at = step
                    print(f"\n>>> demo: killed rank 1 (pid {victim}) with SIGKILL after step {step}; torchrun restarts "
                          "the workers and they resume from the newest snapshot\n", flush=True)
    code = agent.wait()
    output_dir = project / "snapshots"
    print("\nDemo summary")
    print(f"  exit code        {code}")
    print("  ranks            2 (CPU, gloo)")
    print(f"  optimizer steps  {steps}")
    if losses:
        print(f"  loss             {losses[0]:.4f} (first step) -> {losses[-1]:.4f} (last step)")
    print(f"  killed           {'rank 1 after step ' + str(killed_at) if killed_at else 'nothing'}")
    if resumed_at is not None:
        print(f"  resumed          from the snapshot of step {resumed_at}")
    newest = sorted(output_dir.glob("step-*"))
    print(f"  snapshots        {output_dir} (newest {newest[-1].name if newest else 'none'})")
    print(f"  log file         {project / 'logs' / 'train.log'}")
    print(f"  wall time        {time.monotonic() - started:.1f} s")
    return code


if __name__ == "__main__":
    sys.exit(main())
