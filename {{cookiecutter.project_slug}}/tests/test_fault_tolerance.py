"""Faults for real: SIGKILLed workers, crashes inside a save, damaged snapshots, SIGTERM, another world size.

Each recovered run must end with weights bitwise-equal to an uninterrupted run with the same arguments.
"""

import json
import os
import random
import re
import signal
import sys
import time

import pytest
import torch

from conftest import (QUICK, ROOT, assert_same_weights, child_env, final_model, finish, free_port, outputs, run, start,
                      train_cmd, wait_for, worker_pids)

ARGS = QUICK + ["--max-steps", "120", "--snapshot-every", "20"]
FAILED_ATTEMPT = re.compile(r"failed \(exitcode: ")


def reached_step(log_file, step):
    def check():
        try:
            text = log_file.read_text()
        except FileNotFoundError:
            return False
        return any(int(n) >= step for n in re.findall(r"step (\d+)/", text))
    return check


def injected(tmp_path, **fault):
    return child_env(FAULT_ONCE=tmp_path / "fault-fired", **fault)


@pytest.mark.parametrize("victim", [0, 1])
def test_sigkilled_worker_is_restarted_and_ends_bitwise_equal(tmp_path, reference_runs, victim):
    reference = reference_runs(ARGS)
    env = child_env(WANDB_DIR=tmp_path, WANDB_SILENT="true")
    proc = start(train_cmd(2, ["--max-restarts=3"]) + ARGS + ["--wandb", "offline"] + outputs(tmp_path), env=env)
    wait_for(reached_step(tmp_path / "run.log", 25), what="step 25")
    time.sleep(random.uniform(0, 0.2))  # somewhere after the first snapshot: mid-step, mid-save or between saves
    os.kill(worker_pids(proc.pid)[victim], signal.SIGKILL)
    code, out = finish(proc)
    assert code == 0, out[-5000:]
    assert len(FAILED_ATTEMPT.findall(out)) == 1, "the first restart must recover"
    starts = re.findall(r"(resuming|training) from step (\d+)", out)
    assert starts[0] == ("training", "0") and starts[1][0] == "resuming" and len(starts) == 2, starts
    assert_same_weights(reference["model"], final_model(tmp_path / "run-snapshots")["model"])
    # One wandb run for the whole job: both attempts logged to the run id kept with the snapshots.
    run_id = json.loads((tmp_path / "run-snapshots" / "run.json").read_text())["run_id"]
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert runs and all(r.name.endswith(run_id) for r in runs), runs


@pytest.mark.parametrize("rank, where", [(1, "rank"), (0, "manifest")])
def test_crash_inside_a_save_resumes_from_the_previous_snapshot(tmp_path, reference_runs, rank, where):
    reference = reference_runs(ARGS)
    cmd = train_cmd(2, ["--max-restarts=3"], script="tests/fault_injection.py") + ARGS + outputs(tmp_path)
    out = run(cmd, env=injected(tmp_path, FAULT="crash_in_save", FAULT_RANK=rank, FAULT_STEP=60, FAULT_FILE=where)).stdout
    assert (tmp_path / "fault-fired").exists()
    assert "an interrupted save" in out  # the partial step-60 folder was cleaned up
    assert "resuming from step 40 of 120" in out
    assert_same_weights(reference["model"], final_model(tmp_path / "run-snapshots")["model"])


@pytest.mark.parametrize("restore_rng", [True, False])
def test_resume_is_exact_only_with_restored_random_streams(tmp_path, reference_runs, restore_rng):
    """The negative control: without the random streams restored, the same resume ends with other weights."""
    reference = reference_runs(ARGS)
    env = injected(tmp_path, FAULT="kill_after_commit", FAULT_STEP=40, **({} if restore_rng else {"NO_RNG_RESTORE": 1}))
    cmd = train_cmd(2, ["--max-restarts=1"], script="tests/fault_injection.py") + ARGS + outputs(tmp_path)
    assert "resuming from step 40 of 120" in run(cmd, env=env).stdout
    weights = final_model(tmp_path / "run-snapshots")["model"]
    if restore_rng:
        assert_same_weights(reference["model"], weights)
    else:
        assert any(not torch.equal(reference["model"][k], weights[k]) for k in weights)


def test_damaged_snapshots_are_skipped_and_all_damaged_is_a_clean_error(tmp_path):
    cmd = train_cmd(2) + QUICK + ["--max-steps", "60", "--snapshot-every", "20"] + outputs(tmp_path)
    run(cmd)
    folder = tmp_path / "run-snapshots"
    finished = final_model(folder)["model"]

    shared = folder / "step-00000060" / "shared.pt"
    shared.write_bytes(shared.read_bytes()[:1000])
    out = run(cmd).stdout
    assert f"skipping snapshot {folder}/step-00000060: {shared}: truncated" in out
    assert "resuming from step 40 of 60" in out
    assert list(folder.glob("step-00000060.damaged-*")), "the damaged snapshot is kept aside, not deleted"
    assert_same_weights(finished, final_model(folder)["model"])

    # Only rank 1 can see that its own file is damaged: every rank must still fall back together.
    (folder / "step-00000060" / "rank-00001.pt").write_bytes(b"")
    out = run(cmd).stdout
    assert re.search(r"WARNING \[rank 1\] .*rank-00001.pt: empty", out)
    assert "resuming from step 40 of 60" in out
    assert_same_weights(finished, final_model(folder)["model"])

    for part in folder.glob("step-*/shared.pt"):
        part.write_bytes(b"")
    result = run(cmd, check=False)
    assert result.returncode != 0
    assert f"no usable snapshot in {folder}" in result.stdout


def test_sigterm_stops_at_a_step_saves_and_a_relaunch_ends_bitwise_equal(tmp_path, reference_runs):
    reference = reference_runs(ARGS)
    cmd = train_cmd(2) + ARGS + outputs(tmp_path)
    proc = start(cmd)
    wait_for(reached_step(tmp_path / "run.log", 25), what="step 25")
    os.kill(proc.pid, signal.SIGTERM)  # to torchrun, as SLURM or Kubernetes would
    code, out = finish(proc)
    assert code != 0
    stopped = int(re.search(r"stopping at step (\d+) of 120 on signal 15", out).group(1))
    assert stopped < 120
    assert final_model(tmp_path / "run-snapshots")["step"] == stopped
    out = run(cmd).stdout
    assert f"resuming from step {stopped} of 120" in out
    assert_same_weights(reference["model"], final_model(tmp_path / "run-snapshots")["model"])


def test_static_rendezvous_restart_recovers(tmp_path, reference_runs):
    reference = reference_runs(ARGS)
    rendezvous = ["--rdzv-backend=static", "--master-addr=127.0.0.1", f"--master-port={free_port()}", "--nnodes=1",
                  "--node-rank=0", "--nproc_per_node=2", "--max-restarts=3"]
    cmd = [sys.executable, "-m", "torch.distributed.run", *rendezvous, str(ROOT / "train.py")] + ARGS + outputs(tmp_path)
    proc = start(cmd)
    wait_for(reached_step(tmp_path / "run.log", 30), what="step 30")
    os.kill(worker_pids(proc.pid)[1], signal.SIGKILL)
    code, out = finish(proc)
    assert code == 0, out[-5000:]
    assert len(FAILED_ATTEMPT.findall(out)) == 1
    assert_same_weights(reference["model"], final_model(tmp_path / "run-snapshots")["model"])


def test_resume_with_another_world_size_continues_by_samples_seen(tmp_path):
    cmd2 = train_cmd(2, script="tests/fault_injection.py") + ARGS + outputs(tmp_path)
    result = run(cmd2, env=injected(tmp_path, FAULT="kill_after_commit", FAULT_STEP=20), check=False)
    assert result.returncode != 0 and final_model(tmp_path / "run-snapshots")["step"] == 20
    out = run(train_cmd(1) + ARGS + outputs(tmp_path)).stdout
    assert "the snapshot was written by 2 rank(s) and this job has 1" in out
    assert "resuming from step 20 of 120" in out
    state = final_model(tmp_path / "run-snapshots")
    batch = 32
    assert state["step"] == 120
    assert state["progress"]["samples_seen"] == 20 * 2 * batch + 100 * 1 * batch
