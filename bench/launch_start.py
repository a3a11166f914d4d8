"""Start-up: seconds from a launch to the first training step, launch() against torchrun, on 2 CPU ranks.

Run: .venv/bin/python bench/launch_start.py [--pairs N]   (bakes the template; about 2 minutes for 5 pairs)

Three ways to start the same 2-rank job of the baked demo, in alternating order, each measured from the moment the
caller starts it to the first record in its metrics file (rank 0 logs every step):
- torchrun:         `python -m torch.distributed.run --standalone --nproc_per_node=2 train.py ...` from a shell;
- launch, cold:     `python script.py`, a fresh interpreter whose script imports the package and calls launch();
- launch, warm:     launch() called again in a process that already ran one (a notebook's second cell run).
Writes bench/LAUNCH.md and bench/LAUNCH.json.
"""

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import BENCH, CpuMeter, bake, child_env, machine, median, scratch_dir  # noqa: E402

ARGS = ["--max-steps", "5", "--log-every", "1", "--wandb", "disabled", "--eval-every", "1000"]


def folders(run_dir):
    return [
        *("--snapshot-dir", f"{run_dir}/snapshots"),
        *("--export-dir", f"{run_dir}/export"),
        *("--metrics-file", f"{run_dir}/metrics.jsonl"),
        *("--log-file", f"{run_dir}/train.log"),
    ]


def first_record(path, started, proc=None, timeout=120):
    """Seconds from `started` (time.time()) to the first line in the metrics file."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if path.read_text().strip():
                return time.time() - started
        except OSError:
            pass
        if proc is not None and proc.poll() is not None and not path.exists():
            raise RuntimeError(f"exited {proc.returncode} before its first step")
        time.sleep(0.01)
    raise TimeoutError(path)


def torchrun(project, run_dir):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py"]
    started = time.time()
    proc = subprocess.Popen(
        cmd + ARGS + folders(run_dir),
        cwd=project,
        env=child_env(run_dir / "probe"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    seconds = first_record(run_dir / "metrics.jsonl", started, proc)
    assert proc.wait(120) == 0
    return seconds


# The launching script: one cold launch, then warm ones on request (a line on stdin names the run folder).
LAUNCHER = """
import os, sys
sys.path.insert(0, os.getcwd())
from {package}.launch import launch
args = {args!r}
folder = sys.argv[2]
while folder:
    launch(nproc_per_node=2, args=args + ["--snapshot-dir", folder + "/snapshots", "--export-dir", folder + "/export",
           "--metrics-file", folder + "/metrics.jsonl", "--log-file", folder + "/train.log"])
    print("DONE", flush=True)
    folder = sys.stdin.readline().strip()
"""


def launches(project, package, cold_dir, warm_dirs):
    """(cold seconds, [warm seconds]) from one caller process."""
    script = cold_dir.parent / f"{cold_dir.name}-launcher.py"
    script.write_text(LAUNCHER.format(package=package, args=ARGS))
    started = time.time()
    proc = subprocess.Popen(
        [sys.executable, str(script), str(started), str(cold_dir)],
        cwd=project,
        env=child_env(cold_dir / "probe"),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    cold = first_record(cold_dir / "metrics.jsonl", started, proc)
    assert proc.stdout.readline().strip() == "DONE"
    warm = []
    for folder in warm_dirs:
        started = time.time()
        proc.stdin.write(f"{folder}\n")
        proc.stdin.flush()
        warm.append(first_record(folder / "metrics.jsonl", started, proc))
        assert proc.stdout.readline().strip() == "DONE"
    proc.stdin.write("\n")
    proc.stdin.close()
    assert proc.wait(60) == 0
    return cold, warm


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=5)
    options = parser.parse_args()
    scratch = scratch_dir("launch-start-")
    project, package = bake(scratch / "bake")
    results = {"torchrun": [], "launch_cold": [], "launch_warm": []}
    meter = CpuMeter()
    for pair in range(options.pairs):
        order = ["torchrun", "launch"] if pair % 2 == 0 else ["launch", "torchrun"]
        for kind in order:
            if kind == "torchrun":
                results["torchrun"].append(torchrun(project, scratch / f"torchrun-{pair}"))
            else:
                cold, warm = launches(project, package, scratch / f"cold-{pair}", [scratch / f"warm-{pair}"])
                results["launch_cold"].append(cold)
                results["launch_warm"].extend(warm)
        print(f"pair {pair}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in results.items()), flush=True)
    noise = meter.stop()
    info = machine()
    medians = {kind: median(values) for kind, values in results.items()}
    (BENCH / "LAUNCH.json").write_text(json.dumps({"machine": info, "noise": noise, "seconds": results}, indent=1))
    ratio = lambda kind: medians[kind] / medians["torchrun"]  # noqa: E731
    lines = [
        "# Start-up: launch() against torchrun",
        "",
        "Seconds from starting a 2-rank job of the baked demo to its first training step (the first record in its",
        f"metrics file), {options.pairs} alternating pairs, on {info['cores']} cores ({info['cpu']}),",
        f"torch {info['torch']}, Python {info['python']}, {info['date']}. Other processes used",
        f"{noise['foreign_cores']:.2f} cores on average.",
        f"Command: `.venv/bin/python bench/launch_start.py --pairs {options.pairs}`.",
        "",
        "| start | median s | min s | max s | x torchrun |",
        "|---|---|---|---|---|",
    ]
    labels = {
        "torchrun": "torchrun from a shell",
        "launch_cold": "launch() in a fresh interpreter (a script)",
        "launch_warm": "launch() again in the same process (a notebook's next run)",
    }
    for kind, values in results.items():
        lines.append(
            f"| {labels[kind]} | {medians[kind]:.2f} | {min(values):.2f} | {max(values):.2f} | {ratio(kind):.2f} |"
        )
    (BENCH / "LAUNCH.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
