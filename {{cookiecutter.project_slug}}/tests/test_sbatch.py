"""scripts/train.sbatch, run by bash under stand-ins for srun, scontrol and scancel recording what it asks of SLURM."""

import os
import signal
import subprocess
import time

import pytest
from conftest import ROOT, wait_for

from {{ cookiecutter.project_slug }}.machinery import baked

SCRIPT = ROOT / "scripts" / "train.sbatch"

# srun records its arguments and pid, then exits with $FAKE_SRUN_STATUS, or, with FAKE_SRUN_STAYS set, runs until
# SIGTERM (what SLURM sends the job's tasks) and exits 143 like the trainer does.
FAKE_SRUN = """#!/bin/bash
printf '%s\\0' "$@" > "$FAKE_SLURM/srun.args"
echo $$ > "$FAKE_SLURM/srun.pid"
if [[ -n "${FAKE_SRUN_STAYS:-}" ]]; then
    trap 'echo TERM >> "$FAKE_SLURM/srun.signals"; exit 143' TERM
    while :; do sleep 0.05; done
fi
exit "${FAKE_SRUN_STATUS:-0}"
"""
FAKE_SCONTROL = """#!/bin/bash
echo "scontrol $*" >> "$FAKE_SLURM/calls"
if [[ "$1 $2" == "show hostnames" ]]; then
    printf '%s\\n' $FAKE_NODES
fi
"""
# scancel --signal=TERM <job>: SLURM passes the signal to the job's tasks, here the stand-in srun.
FAKE_SCANCEL = """#!/bin/bash
echo "scancel $*" >> "$FAKE_SLURM/calls"
kill -TERM "$(cat "$FAKE_SLURM/srun.pid")"
"""


@pytest.fixture
def slurm(tmp_path):
    """Environment of a 2-node job with 4 GPUs per node, with the stand-ins first on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL), ("scancel", FAKE_SCANCEL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k != "NPROC_PER_NODE"}
    env.update(
        {
            "PATH": f"{bin_dir}{os.pathsep}{env['PATH']}",
            "FAKE_SLURM": str(tmp_path),
            "FAKE_NODES": "gpu-a01 gpu-a02",
            "SLURM_JOB_ID": "4242",
            "SLURM_JOB_NAME": "train",
            "SLURM_NNODES": "2",
            "SLURM_JOB_NODELIST": "gpu-a[01-02]",
            "SLURM_GPUS_ON_NODE": "4",
            "SLURM_CPUS_PER_TASK": "16",
            "SLURM_SUBMIT_DIR": str(ROOT),
        }
    )
    return env


def srun_args(tmp_path):
    return (tmp_path / "srun.args").read_bytes().decode().split("\0")[:-1]


def calls(tmp_path):
    path = tmp_path / "calls"
    return path.read_text().splitlines() if path.exists() else []


def torchrun_command(args):
    return args[args.index("torchrun") :]


def test_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_one_torchrun_per_node_with_the_rendezvous_on_the_first(slurm, tmp_path):
    result = subprocess.run(
        ["bash", str(SCRIPT), "--epochs", "5", "--lr", "0.001"], env=slurm, capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 0, result.stderr
    args = srun_args(tmp_path)
    assert args[: args.index("torchrun")] == ["--nodes=2", "--ntasks-per-node=1", "--label"]
    assert torchrun_command(args) == [
        "torchrun",
        "--nnodes=2",
        "--nproc_per_node=4",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=gpu-a01:24242",
        "--rdzv-id=4242",
        "--max-restarts=3",
        "train.py",
        "--epochs",
        "5",
        "--lr",
        "0.001",
    ]
    assert "scontrol show hostnames gpu-a[01-02]" in calls(tmp_path)
    assert not any("requeue" in call for call in calls(tmp_path))  # a finished job is not requeued


@pytest.mark.parametrize(
    "gpus, expected",
    [
        ({"SLURM_GPUS_PER_NODE": "h100:8"}, 8),  # --gpus-per-node=h100:8
        ({}, baked.NPROC_PER_NODE),  # CPU nodes: the project's ranks per machine
        ({"SLURM_GPUS_ON_NODE": "4", "NPROC_PER_NODE": "1"}, 1),  # chosen by hand
    ],
)
def test_ranks_per_node_follow_the_allocation(slurm, tmp_path, gpus, expected):
    del slurm["SLURM_GPUS_ON_NODE"]
    slurm.update(gpus)
    subprocess.run(["bash", str(SCRIPT)], env=slurm, capture_output=True, timeout=30, check=True)
    assert f"--nproc_per_node={expected}" in torchrun_command(srun_args(tmp_path))


def test_a_failed_run_fails_the_job(slurm, tmp_path):
    slurm["FAKE_SRUN_STATUS"] = "1"
    result = subprocess.run(["bash", str(SCRIPT)], env=slurm, capture_output=True, timeout=30)
    assert result.returncode == 1
    assert not any("requeue" in call for call in calls(tmp_path))


def start_job(slurm, tmp_path):
    slurm["FAKE_SRUN_STAYS"] = "1"
    job = subprocess.Popen(
        ["bash", str(SCRIPT)], env=slurm, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    wait_for(lambda: (tmp_path / "srun.pid").exists(), timeout=20, what="srun to start")
    return job


def test_time_limit_warning_stops_training_then_requeues(slurm, tmp_path):
    job = start_job(slurm, tmp_path)
    job.send_signal(signal.SIGUSR1)  # what --signal=B:USR1@... sends before the time limit
    out, _ = job.communicate(timeout=20)
    assert (tmp_path / "srun.signals").read_text().split() == ["TERM"], out
    assert calls(tmp_path)[-2:] == ["scancel --signal=TERM 4242", "scontrol requeue 4242"]
    assert job.returncode == 143  # the stopped run's status: the job is not reported as a success


def test_sigterm_waits_for_the_snapshot_and_leaves_requeueing_to_slurm(slurm, tmp_path):
    job = start_job(slurm, tmp_path)
    job.send_signal(signal.SIGTERM)  # preemption or scancel: SLURM signals the tasks itself
    time.sleep(0.5)
    assert job.poll() is None, "the batch script must wait while the ranks save"
    os.kill(int((tmp_path / "srun.pid").read_text()), signal.SIGTERM)
    out, _ = job.communicate(timeout=20)
    assert job.returncode == 143, out
    assert not any("requeue" in call or "scancel" in call for call in calls(tmp_path))
