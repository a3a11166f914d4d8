"""Workers that die with their torchrun agent: a parent SIGKILLed, a real torchrun's agent SIGKILLed.

The parents and agents are real processes: a `python -c` starting a child, a real torchrun, train.py itself.
"""

import os
import signal
import sys
import time

import pytest
from conftest import PACKAGE, ROOT, child_env, outputs, start, train_cmd, wait_for, worker_pids

sys.path.insert(0, str(ROOT))

from ddp_project.machinery.snapshot import MANIFEST


def alive(pid):
    """Whether pid is a running process (a zombie, dead but not yet reaped, is not)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def kill_all(pids, parent):
    """However a test ends: SIGKILL the children still alive, then their parent, and close its output."""
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
    if parent.poll() is None:
        parent.kill()
    parent.wait()
    parent.stdout.close()


# A parent (playing torchrun's agent) starts a child that calls WATCH, then both wait; the child touches argv[1]
# once it is armed and prints its pid.
PARENT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]])
print(child.pid, flush=True)
time.sleep(600)
"""
CHILD = f"""
import os, pathlib, sys, time
from {PACKAGE}.machinery import parentdeath
WATCH
pathlib.Path(sys.argv[1]).touch()
time.sleep(600)
"""


@pytest.mark.parametrize(
    "watch", ["parentdeath.exit_with_parent()", "parentdeath.watch_parent(os.getppid())"], ids=["prctl", "polling"]
)
def test_child_dies_when_its_parent_is_killed(tmp_path, watch):
    armed = tmp_path / "armed"
    parent = start([sys.executable, "-c", PARENT, CHILD.replace("WATCH", watch), str(armed)])
    child = int(parent.stdout.readline())
    try:
        wait_for(armed.exists, timeout=60, what="the child to arm itself")
        assert alive(child)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        wait_for(lambda: not alive(child), timeout=10, what="the child to die with its parent")
    finally:
        kill_all([child], parent)


# A torchrun worker: arms itself, says so through a file, then works until killed.
WORKER = f"""
import os, pathlib, sys, time
sys.path.insert(0, {str(ROOT)!r})
from {PACKAGE}.machinery.parentdeath import exit_with_parent
exit_with_parent()
pathlib.Path(sys.argv[1], os.environ["RANK"]).touch()
time.sleep(600)
"""


def test_torchrun_workers_that_call_exit_with_parent_die_with_their_agent(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    armed = tmp_path / "armed"
    armed.mkdir()
    agent = start(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script), str(armed)]
    )
    workers = {}
    try:
        wait_for(lambda: len(list(armed.iterdir())) == 2, timeout=120, what="both workers to arm themselves")
        workers = worker_pids(agent.pid)
        assert len(workers) == 2
        os.kill(agent.pid, signal.SIGKILL)
        agent.wait()
        wait_for(
            lambda: not any(alive(pid) for pid in workers.values()),
            timeout=10,
            what="the workers to die with their agent",
        )
    finally:
        kill_all(workers.values(), agent)


def processes_in(folder):
    """The live processes whose working directory is `folder`: a job started there, its zygote included (which
    scrubs its command line and environment, not its directory)."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.readlink(f"/proc/{entry}/cwd") == str(folder) and alive(entry):
                found.append(int(entry))
        except OSError:
            continue
    return found


def importing_torch(pid):
    """Whether process `pid` has begun importing torch (its library is mapped)."""
    try:
        with open(f"/proc/{pid}/maps") as handle:
            return "libtorch" in handle.read()
    except OSError:
        return False


def test_workers_whose_agent_dies_while_they_start_leave_nothing_behind(tmp_path):
    """torchrun SIGKILLed while its workers import torch, before local rank 0 starts the job's zygote (its copy for
    warm restarts): the workers were handed to the reaper by then. Nothing of the job is left: no worker training
    alone, no zygote waiting for an agent that will never exit."""
    cmd = train_cmd(2, ["--max-restarts=1"]) + ["--max-steps", "1000000", "--wandb", "disabled"] + outputs(tmp_path)
    agent = start(cmd, env=child_env(WARM_START_POOL=""), cwd=tmp_path)  # cold: seconds of imports to die in
    workers = {}
    try:
        wait_for(lambda: len(worker_pids(agent.pid)) == 2, timeout=120, interval=0.02, what="both workers to start")
        workers = worker_pids(agent.pid)
        # train.py's first lines (no torch) are behind them: the agent's pid is known
        wait_for(lambda: all(map(importing_torch, workers.values())), interval=0.01, what="the workers' torch import")
        os.kill(agent.pid, signal.SIGKILL)
        agent.wait()
        wait_for(lambda: not processes_in(tmp_path), timeout=30, what="every process of the job to end")
    finally:
        for pid in processes_in(tmp_path):
            os.kill(pid, signal.SIGKILL)
        kill_all(workers.values(), agent)


def committed_steps(folder):
    return sorted(path.parent.name for path in folder.glob("step-*/" + MANIFEST))


def test_training_workers_die_when_their_torchrun_agent_is_killed(tmp_path):
    """The real thing: torchrun train.py, its agent SIGKILLed mid-training; no worker trains on without it."""
    folder = tmp_path / "run-snapshots"
    # Far more steps than the test lasts: a worker that outlived its agent would still be training at the end.
    agent = start(
        train_cmd(2) + ["--max-steps", "1000000", "--snapshot-every", "20", "--wandb", "disabled"] + outputs(tmp_path),
        env=child_env(),
    )
    workers = {}
    try:
        wait_for(
            lambda: committed_steps(folder) or agent.poll() is not None,
            timeout=300,
            interval=0.2,
            what="a first snapshot",
        )
        assert agent.poll() is None, f"training ended early:\n{agent.stdout.read()[-6000:]}"
        workers = worker_pids(agent.pid)
        assert len(workers) == 2, workers
        os.kill(agent.pid, signal.SIGKILL)
        agent.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(alive(pid) for pid in workers.values()):
            time.sleep(0.1)
        survivors = {rank: pid for rank, pid in workers.items() if alive(pid)}
        assert not survivors, f"workers still running 10 s after their agent was killed: {survivors}"
        settled = committed_steps(folder)
        time.sleep(3)
        assert committed_steps(folder) == settled, "snapshots were committed after the job's workers were dead"
    finally:
        kill_all(workers.values(), agent)
