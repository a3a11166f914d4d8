"""Signals as schedulers and people send them, and a rank that hangs.

- SIGTERM to the workers only (Kubernetes, srun): the job stops with a snapshot and stays stopped, although
  torchrun takes the workers' exit for a failure and restarts them.
- Ctrl-C (SIGINT to the whole process group: torchrun and its workers): a snapshot at the next step.
- A SIGSTOPped rank: the waiting ranks write their stacks before the collective timeout fails the job.
"""

import os
import signal
import time

import pytest
from conftest import child_env, finish, logged_steps, outputs, run, start, summary, train_cmd, wait_for, worker_pids

LONG = ["--wandb", "disabled", "--log-every", "5", "--max-steps", "3000", "--snapshot-every", "1000"]


@pytest.mark.parametrize("under_torchrun", [False, True])
def test_a_second_ctrl_c_interrupts_at_once_but_torchrun_s_copy_of_the_first_does_not(monkeypatch, under_torchrun):
    from ddp_project.machinery.distributed import DistEnv
    from ddp_project.machinery.stop import StopRequest

    if under_torchrun:  # a rank's environment under torchrun
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
        monkeypatch.setenv("LOCAL_RANK", "0")
    else:
        monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    before = signal.getsignal(signal.SIGINT)
    with StopRequest(DistEnv()) as stop:
        os.kill(os.getpid(), signal.SIGINT)  # the first Ctrl-C: a stop at the next step
        if under_torchrun:
            time.sleep(1.1)  # torchrun forwards its own copy, seconds later on a loaded machine
            os.kill(os.getpid(), signal.SIGINT)
        assert stop.agreed()
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)  # the second Ctrl-C
            time.sleep(1)
    assert signal.getsignal(signal.SIGINT) is before, "the handlers are given back"


def snapshot_steps(tmp_path, name="run"):
    return sorted(int(p.parent.name[5:]) for p in (tmp_path / f"{name}-snapshots").glob("step-*/manifest.json"))


def test_sigterm_to_the_workers_only_stops_the_job_with_a_snapshot(tmp_path):
    proc = start(train_cmd(2, ["--max-restarts=2"]) + LONG + outputs(tmp_path))
    wait_for(lambda: any(step >= 20 for step in logged_steps(tmp_path)), timeout=120, what="step 20")
    for pid in worker_pids(proc.pid).values():
        os.kill(pid, signal.SIGTERM)
    code, out = finish(proc)
    assert code != 0, "a stopped job is no success: schedulers must see it did not finish"
    (stopped_at,) = [s for s in snapshot_steps(tmp_path) if s % 1000]
    assert 20 <= stopped_at < 3000
    assert max(logged_steps(tmp_path)) <= stopped_at, "torchrun's restarts must not train on"
    run(train_cmd(2) + LONG[:-4] + ["--max-steps", str(stopped_at + 10)] + outputs(tmp_path))
    assert summary(tmp_path)["resumed_from"] == stopped_at


def test_ctrl_c_saves_a_snapshot_at_the_next_step(tmp_path):
    proc = start(train_cmd(2, ["--max-restarts=2"]) + LONG + outputs(tmp_path))
    wait_for(lambda: any(step >= 20 for step in logged_steps(tmp_path)), timeout=120, what="step 20")
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does: torchrun and every worker get it
    code, out = finish(proc)
    assert code != 0
    stopped = [s for s in snapshot_steps(tmp_path) if s % 1000]
    assert stopped and stopped[-1] >= 20, f"no snapshot at the stop: {snapshot_steps(tmp_path)}\n{out[-3000:]}"


def test_a_hung_rank_leaves_the_stacks_of_the_waiting_ranks_in_their_logs(tmp_path):
    # Cold starts: the pid torchrun started is the rank itself (a warm one's stand-in would stop, not the rank).
    proc = start(train_cmd(2) + LONG + ["--dist-timeout", "8"] + outputs(tmp_path), env=child_env(WARM_START_POOL=""))
    wait_for(lambda: any(step >= 20 for step in logged_steps(tmp_path)), timeout=120, what="step 20")
    hung = worker_pids(proc.pid)[1]
    os.kill(hung, signal.SIGSTOP)
    started = time.monotonic()
    stacks = tmp_path / "stacks-rank0.txt"
    try:
        wait_for(stacks.exists, timeout=60, what="rank 0's stacks")
        waited = time.monotonic() - started
        time.sleep(max(0.0, started + 8 + 4 - time.monotonic()))  # past the timeout: rank 0 has failed by now
    finally:
        os.kill(hung, signal.SIGCONT)  # or torchrun would wait 30 s more before it SIGKILLs the stopped rank
    code, out = finish(proc, timeout=120)
    assert code != 0, "a job with a hung rank fails at --dist-timeout"
    text = stacks.read_text()
    assert "trainer.py" in text and "Thread" in text, text[-3000:]
    assert waited < 8 + 5, "the stacks come before the collective timeout fails the job"
