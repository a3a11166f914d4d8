"""Faults for real, on this project's model and data: SIGKILLed workers, SIGTERM, another world size.

Each recovered run must end with weights bitwise-equal to an uninterrupted run with the same arguments. The
machinery's own faults (crashes inside a save, damaged snapshots, a static rendezvous, ...) are tested by the
template that baked this project.
"""

import json
import os
import random
import signal
import time

import numpy as np
import pytest
import torch
from conftest import (
    FAILED_ATTEMPT,
    QUICK,
    assert_same_weights,
    child_env,
    default_config,
    final_model,
    finish,
    injected,
    metrics,
    outputs,
    processes_naming,
    reached_step,
    run,
    start,
    starts,
    summary,
    train_cmd,
    wait_for,
    worker_pids,
)

from {{ cookiecutter.project_slug }}.machinery.snapshot import MANIFEST, step_name

ARGS = QUICK + ["--max-steps", "80", "--snapshot-every", "20"]
LOGGED_STEPS = list(range(5, 81, 5))  # --log-every 5 (QUICK)


def training_draws_random_numbers():
    """Whether a training step of this project's model and data draws from the global random streams.

    One step of the model in training mode, on items fetched from the training set as the loader fetches them:
    dropout, random augmentations and the like draw; a model without them does not, and then the random
    streams cannot change what a resumed run computes.
    """
    from torch.utils.data import default_collate

    from {{ cookiecutter.project_slug }} import model
    from {{ cookiecutter.project_slug }}.data import build_datasets

    cfg = default_config()
    torch.manual_seed(cfg.seed)
    train, _ = build_datasets(cfg)
    network = model.build_model(cfg, train).train()

    def streams():
        return torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate()

    before = streams()
    inputs, targets = default_collate([train[i] for i in range(min(cfg.batch_size, len(train)))])
    model.loss_fn(network(inputs), targets).backward()
    after = streams()
    return not (torch.equal(before[0], after[0]) and np.array_equal(before[1], after[1]) and before[2] == after[2])


def exited(pid):
    """Whether process `pid` has exited (gone, or a zombie its parent has not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_sigkilled_workers_are_restarted_and_the_job_ends_bitwise_equal(tmp_path, reference_runs):
    """Rank 1 is SIGKILLed after the first snapshot, then rank 0 in the restarted attempt: each restart recovers.
    The rank that survives the first kill leaves promptly: a restart waits for it."""
    reference = reference_runs(ARGS)
    # Cold first starts (no standing zygote): the restarts are the job's own zygote's to make warm.
    env = child_env(WANDB_DIR=tmp_path, WANDB_SILENT="true", RECORD_STARTS=tmp_path / "starts", WARM_START_POOL="")
    cmd = train_cmd(2, ["--max-restarts=3"], script="tests/fault_injection.py")
    launched = time.monotonic()
    proc = start(cmd + ARGS + ["--wandb", "offline"] + outputs(tmp_path), env=env)
    wait_for(reached_step(tmp_path, 5), interval=0.01, what="step 5")
    start_up = time.monotonic() - launched  # this machine's pace now: launch to the first steps
    killed_attempt: set[int] = set()
    left_after = None
    for victim, after_step in [(1, 25), (0, 45)]:
        # This attempt's workers (none of the killed attempt's), then a step the killed attempt never reached.
        workers = wait_for(
            lambda killed=killed_attempt: (
                len(pids := worker_pids(proc.pid)) == 2 and not set(pids.values()) & killed and pids
            ),
            what="two workers of a new attempt",
        )
        if left_after is None:  # the survivor's pace is measured between saves: one in flight may keep it a while
            committed = tmp_path / "run-snapshots" / step_name(20) / MANIFEST
            wait_for(committed.exists, interval=0.01, what="the snapshot of step 20")
        wait_for(reached_step(tmp_path, after_step), what=f"step {after_step}")
        time.sleep(random.uniform(0, 0.1))  # mid-step, mid-save or between saves
        killed = time.monotonic()
        os.kill(workers[victim], signal.SIGKILL)
        if left_after is None:
            wait_for(lambda survivor=workers[1 - victim]: exited(survivor), interval=0.01, what="the survivor's exit")
            left_after = time.monotonic() - killed
        killed_attempt = set(workers.values())
    code, out = finish(proc)
    assert code == 0, out[-5000:]
    # A survivor that leaves in the interpreter's usual way spends about half a start-up (a last garbage collection
    # over torch's objects, a second wait for a notice the killed rank never leaves); promptly, a twentieth.
    assert left_after < 0.2 * start_up, f"the survivor left after {left_after:.2f} s, start-up {start_up:.1f} s"
    assert len(FAILED_ATTEMPT.findall(out)) == 2, "each restart must recover"
    done = summary(tmp_path)  # the last attempt's
    assert done["resumed_from"] >= 40 and done["resumed_from"] % 20 == 0 and done["steps"] == 80, done
    assert_same_weights(reference["model"], final_model(tmp_path / "run-snapshots")["model"])
    # Steps trained again after a restart replaced the failed attempt's records: each step once, in order.
    assert [record["step"] for record in metrics(tmp_path)] == LOGGED_STEPS
    # One wandb run for the whole job: every attempt logged to the run id kept with the snapshots.
    run_id = json.loads((tmp_path / "run-snapshots" / "run.json").read_text())["run_id"]
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert runs and all(r.name.endswith(run_id) for r in runs), runs
    # The restarted ranks ran in forks of a process with torch imported (warm), each restart; none is left.
    assert starts(tmp_path) == {0: ["cold", "cold"], 1: ["warm", "warm"], 2: ["warm", "warm"]}
    zygote = f"warm-restart for torchrun pid {proc.pid}"  # what machinery/warmstart.py's zygote shows in ps
    wait_for(lambda: not processes_naming(tmp_path) and not processes_naming(zygote), timeout=10, what="nothing left")


def test_resume_without_the_random_streams_ends_with_other_weights(tmp_path, reference_runs):
    """The negative control of the exact resumes above (the crash inside the step-60 save resumes from step 40 too):
    the same resume from step 40, without the random streams restored, ends with other weights."""
    if not training_draws_random_numbers():
        pytest.skip("this model and data draw no random numbers in training: the random streams cannot matter")
    reference = reference_runs(ARGS)
    env = injected(tmp_path, FAULT="kill_after_commit", FAULT_STEP=40, NO_RNG_RESTORE=1)
    cmd = train_cmd(2, ["--max-restarts=1"], script="tests/fault_injection.py") + ARGS + outputs(tmp_path)
    run(cmd, env=env)
    assert (tmp_path / "fault-fired").exists()
    assert summary(tmp_path)["resumed_from"] == 40
    weights = final_model(tmp_path / "run-snapshots")["model"]
    assert any(not torch.equal(reference["model"][k], weights[k]) for k in weights)


def test_sigterm_stops_at_a_step_saves_and_a_relaunch_ends_bitwise_equal(tmp_path, reference_runs):
    reference = reference_runs(ARGS)
    cmd = train_cmd(2) + ARGS + outputs(tmp_path)
    proc = start(cmd)
    wait_for(reached_step(tmp_path, 25), what="step 25")
    os.kill(proc.pid, signal.SIGTERM)  # to torchrun, as SLURM or Kubernetes would
    code, out = finish(proc)
    assert code != 0, "a stopped run is not a success"
    stopped = final_model(tmp_path / "run-snapshots")["step"]  # the snapshot saved where the ranks stopped
    assert (summary(tmp_path)["stop_signal"], summary(tmp_path)["steps"]) == (signal.SIGTERM, stopped)
    assert not (tmp_path / "run-export" / "model.pt").exists(), "a stopped run has no final weights to export"
    assert 25 <= stopped < 80
    assert max(record["step"] for record in metrics(tmp_path)) <= stopped
    run(cmd)
    assert summary(tmp_path)["resumed_from"] == stopped
    assert_same_weights(reference["model"], final_model(tmp_path / "run-snapshots")["model"])


def test_resume_with_another_world_size_continues_by_samples_seen(tmp_path):
    """--max-steps counts steps of the size the run started with: on 1 rank the rest takes twice the steps."""
    args = QUICK + ["--max-steps", "40", "--snapshot-every", "10"]
    cmd2 = train_cmd(2, script="tests/fault_injection.py") + args + outputs(tmp_path)
    result = run(cmd2, env=injected(tmp_path, FAULT="kill_after_commit", FAULT_STEP=10), check=False)
    assert result.returncode != 0 and final_model(tmp_path / "run-snapshots")["step"] == 10
    run(train_cmd(1) + args + outputs(tmp_path))
    batch = default_config().batch_size
    done = summary(tmp_path)
    assert (done["world_size"], done["resumed_from"]) == (1, 10)
    assert done["samples_seen"] == 40 * 2 * batch
    assert done["steps"] == done["total_steps"] == 10 + 30 * 2
    state = final_model(tmp_path / "run-snapshots")
    assert (state["step"], state["progress"]["samples_seen"]) == (done["steps"], done["samples_seen"])
