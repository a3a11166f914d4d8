"""Replica groups that keep training (--fault-tolerance torchft): a lighthouse, two groups of two ranks each, each its
own torchrun job; one group's worker is SIGKILLed, the other goes on, the restarted one takes its state and both
finish with the same weights."""

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import (
    QUICK,
    ROOT,
    child_env,
    final_model,
    finish,
    free_port,
    outputs,
    start,
    train_cmd,
    wait_for,
    worker_pids,
)

pytest.importorskip("torchft", reason="--fault-tolerance torchft needs torchft (the project's [ft] extra)")

GROUPS = 2
RANKS = 2  # per group: DDP inside each group, torchft between the groups


def lighthouse(port, min_replicas=1):
    binary = Path(sys.executable).parent / "torchft_lighthouse"
    command = str(binary) if binary.exists() else shutil.which("torchft_lighthouse")
    assert command, "torchft_lighthouse is not installed (it comes with torchft)"
    # The heartbeat timeout is how long the live group waits for a quorum without the dead one.
    return subprocess.Popen(
        [command, "--min_replicas", str(min_replicas), "--join_timeout_ms", "1000", "--heartbeat_timeout_ms", "500"]
        + ["--bind", f"[::]:{port}"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


class StepClock:
    """When each step of a group's metrics file first appears (polled), and the group's records."""

    def __init__(self, path):
        self.path, self._seen, self._stop, self._lock = path, {}, threading.Event(), threading.Lock()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def records(self):
        import json

        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.endswith("}")]

    @property
    def seen(self):
        """{step: when it first appeared}"""
        with self._lock:
            return dict(self._seen)

    def steps(self):
        return {record["step"] for record in self.records()}

    def last_step(self):
        records = self.records()
        return records[-1]["step"] if records else -1

    def _poll(self):
        while not self._stop.is_set():
            now = time.monotonic()
            records = self.records()
            with self._lock:
                for record in records:
                    self._seen.setdefault(record["step"], now)
            time.sleep(0.01)

    def close(self):
        self._stop.set()
        self._thread.join()


def group_jobs(port, args, restarts, folder):
    """One torchrun job per group; its output goes to a file (a pipe nobody reads would fill up and block it)."""
    jobs = []
    for group in range(GROUPS):
        env = child_env(
            TORCHFT_LIGHTHOUSE=f"http://localhost:{port}",
            REPLICA_GROUP_ID=group,
            NUM_REPLICA_GROUPS=GROUPS,
            # Cold restarts: a restarted group stays away for seconds, long enough to see the live group train on
            # without it. A warm restart is back within 1-2 s, hardly longer than the lighthouse takes to drop it.
            WARM_RESTART=0,
            # 20 steps a second at most, both groups: the live one leaves the cores to the restart the test waits for
            SLOW_STEP=0.05,
        )
        output = open(folder / f"group{group}-{restarts}.out", "w")
        command = train_cmd(RANKS, [f"--max-restarts={restarts}"], script="tests/fault_injection.py") + args
        jobs.append(subprocess.Popen(command, env=env, cwd=ROOT, stdout=output, stderr=subprocess.STDOUT))
        jobs[-1].output = output.name
    return jobs


def finished(job, timeout=300):
    """(exit code, output) of a group's job."""
    try:
        job.wait(timeout)
    except subprocess.TimeoutExpired:
        job.kill()
        pytest.fail(f"timed out after {timeout} s:\n{Path(job.output).read_text()[-5000:]}")
    return job.returncode, Path(job.output).read_text()


def short_repr(out):
    """A failed job's output for the failure message: its end, after the first lines of a native crash (an abort's
    thread dump can fill the end)."""
    crash = ("terminate called", "Fatal Python error", "thread '")
    return "\n".join([line for line in out.splitlines() if line.startswith(crash)][:5] + ["...", out[-5000:]])


def workers(job):
    return worker_pids(job.pid)


@pytest.mark.slow
def test_live_group_trains_on_while_a_killed_group_restarts_and_heals(tmp_path, cleanup):
    port = free_port()
    cleanup.append(lighthouse(port))
    args = QUICK + ["--log-every", "1", "--eval-every", "0", "--threads-per-rank", "1", "--fault-tolerance", "torchft"]
    args += ["--snapshot-every", "10", "--snapshot-dir", str(tmp_path / "snapshots")]
    args += ["--export-dir", str(tmp_path / "export"), "--metrics-file", str(tmp_path / "metrics.jsonl")]
    args += ["--log-file", str(tmp_path / "train.log")]
    jobs = group_jobs(port, args + ["--max-steps", "1000000"], restarts=1, folder=tmp_path)
    cleanup.extend(jobs)
    clocks = [StepClock(tmp_path / f"metrics.group{group}.jsonl") for group in range(GROUPS)]
    cleanup.extend(clocks)

    # Both groups in one quorum, training (the later one took the earlier one's state, or they started together),
    # for 30 steps: the groups are connected to each other. Then group 1's worker dies, and torchrun restarts it.
    # The kill lands between two snapshots (--snapshot-every 10): the restart resumes from one behind what group 1
    # trained and logged.
    def between_snapshots():
        return len(clocks[1].steps()) >= 30 and 3 <= clocks[1].last_step() % 10 <= 7

    wait_for(between_snapshots, timeout=120, interval=0.005, what="30 steps of group 1, between two snapshots")
    victim = workers(jobs[1])[1]
    os.kill(victim, signal.SIGKILL)
    killed_at, killed_step = time.monotonic(), max(clock.last_step() for clock in clocks)
    trained = clocks[1].steps()  # what group 1 trained and logged before it died
    # Its restart resumes from its own newest snapshot (at most killed_step), then takes the live group's state:
    # its metrics go on at a step it never trained itself.
    rejoined = wait_for(
        lambda: [step for step, seen in clocks[1].seen.items() if seen > killed_at and step > killed_step],
        timeout=120,
        what="group 1 to rejoin",
    )
    rejoined_step = min(rejoined)
    wait_for(lambda: clocks[1].last_step() >= rejoined_step + 20, timeout=120, what="20 steps after the rejoin")
    # Its metrics keep what it trained before it died, also past the snapshot it restarted from (a gap in the loss
    # curve otherwise), and every step once, in order.
    logged = [record["step"] for record in clocks[1].records()]
    assert trained <= set(logged) and logged == sorted(set(logged)), (sorted(trained), logged)

    # The live group trained on while group 1 was down, without a stall near the length of group 1's restart
    # (an interpreter start, imports, rendezvous and the state transfer).
    assert rejoined_step - killed_step >= 10, (killed_step, rejoined_step)
    during = sorted(t for step, t in clocks[0].seen.items() if killed_step < step <= rejoined_step)
    gaps = [b - a for a, b in zip([killed_at, *during], during, strict=False)]
    restart = clocks[1].seen[rejoined_step] - killed_at
    print(
        f"\nkilled at step {killed_step}, group 1 rejoined at step {rejoined_step} {restart:.2f} s later; the live "
        f"group's longest gap: {max(gaps):.2f} s"
    )
    assert max(gaps) < restart / 2, (max(gaps), restart)

    # Both groups stop (SIGTERM) with a snapshot, and a new launch of both finishes the run from there: the group
    # that stopped behind takes the other's state, and both end with the same weights.
    for job in jobs:
        for pid in workers(job).values():
            os.kill(pid, signal.SIGTERM)
    for job in jobs:
        finished(job)
    for clock in clocks:
        clock.close()
    end = max(clock.last_step() for clock in clocks) + 10
    results = [finished(job) for job in group_jobs(port, args + ["--max-steps", str(end)], 0, tmp_path)]
    for group, (code, out) in enumerate(results):
        assert code == 0, f"group {group}:\n{short_repr(out)}"
    finals = [torch.load(tmp_path / "export" / f"group{g}" / "model.pt", weights_only=True) for g in range(GROUPS)]
    assert [clock.last_step() for clock in clocks] == [end] * GROUPS
    assert finals[0].keys() == finals[1].keys()
    assert all(torch.equal(finals[0][name], finals[1][name]) for name in finals[0])


def test_replica_groups_without_their_environment_are_refused_in_one_line(tmp_path):
    env = child_env(TORCHFT_LIGHTHOUSE="http://localhost:1", REPLICA_GROUP_ID="two", NUM_REPLICA_GROUPS=2)
    code, out = finish(start(train_cmd() + QUICK + ["--fault-tolerance", "torchft"], env=env, cwd=tmp_path))
    assert code == 2, out
    assert "REPLICA_GROUP_ID" in out and "Traceback" not in out
    assert not (tmp_path / "snapshots").exists()
    # No lighthouse at the address (nothing listens on the port): the error names the variable, within --dist-timeout
    nothing = f"http://localhost:{free_port()}"
    env = child_env(TORCHFT_LIGHTHOUSE=nothing, REPLICA_GROUP_ID=0, NUM_REPLICA_GROUPS=2)
    cmd = train_cmd(1) + QUICK + ["--fault-tolerance", "torchft", "--dist-timeout", "2"]
    code, out = finish(start(cmd, env=env, cwd=tmp_path), timeout=40)  # torchft's own wait would be 60 s
    assert code != 0 and f"TORCHFT_LIGHTHOUSE={nothing}" in out, out[-3000:]
    assert not list((tmp_path / "snapshots").glob("*/snap*")), "nothing trained, nothing saved"


def test_a_group_that_fails_while_its_quorum_forms_leaves_without_waiting_for_the_quorum(tmp_path, cleanup):
    """torchft forms a step's quorum in a thread of its own, which the interpreter's exit would wait for: here the
    lighthouse wants 2 groups and only one comes, so that quorum never forms, and the exit must not wait for it."""
    port = free_port()
    cleanup.append(lighthouse(port, min_replicas=2))
    env = child_env(
        TORCHFT_LIGHTHOUSE=f"http://localhost:{port}", REPLICA_GROUP_ID=0, NUM_REPLICA_GROUPS=2, FAULT="raise_in_quorum"
    )
    timeout = 120  # --dist-timeout: how long the quorum would hold the exit
    cmd = train_cmd(1, script="tests/fault_injection.py") + QUICK + ["--fault-tolerance", "torchft"]
    code, out = finish(start(cmd + ["--dist-timeout", str(timeout)], env=env, cwd=tmp_path), timeout=timeout / 2)
    assert code != 0 and "injected failure on rank 0 while the quorum forms" in out, out[-3000:]


def test_sigterm_while_a_group_waits_for_the_others_stops_it_with_a_snapshot(tmp_path, cleanup):
    """One group of a job of two comes: it waits for the other before its first step (up to --dist-timeout); a
    SIGTERM to its torchrun (SLURM's scancel, Ctrl-C) stops it there, as at any step, instead of torchrun's kill."""
    port = free_port()
    cleanup.append(lighthouse(port))
    env = child_env(TORCHFT_LIGHTHOUSE=f"http://localhost:{port}", REPLICA_GROUP_ID=0, NUM_REPLICA_GROUPS=2)
    cmd = train_cmd(RANKS) + QUICK + ["--fault-tolerance", "torchft", "--dist-timeout", "300"] + outputs(tmp_path)
    proc = start(cmd, env=env)
    log = tmp_path / "run.group0.log"
    wait_for(lambda: log.exists() and "waiting for the other replica groups" in log.read_text(), what="the wait")
    os.kill(proc.pid, signal.SIGTERM)
    code, out = finish(proc, timeout=120)
    assert code != 0, out[-3000:]
    done = json.loads((tmp_path / "run-export" / "group0" / "summary.json").read_text())
    assert (done["stop_signal"], done["steps"]) == (signal.SIGTERM, 0), done
    assert final_model(tmp_path / "run-snapshots" / "group0")["step"] == 0


def test_a_lighthouse_that_dies_mid_run_ends_the_group_in_one_line(tmp_path, cleanup):
    port = free_port()
    house = lighthouse(port)
    cleanup.append(house)
    address = f"http://localhost:{port}"
    env = child_env(TORCHFT_LIGHTHOUSE=address, REPLICA_GROUP_ID=0, NUM_REPLICA_GROUPS=1)
    cmd = train_cmd(1) + QUICK + ["--fault-tolerance", "torchft", "--dist-timeout", "5", "--max-steps", "1000000"]
    proc = start(cmd + ["--log-every", "1", "--eval-every", "0"] + outputs(tmp_path), env=env)
    metrics = tmp_path / "run-metrics.group0.jsonl"
    wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 5, what="5 steps")
    house.kill()
    code, out = finish(proc, timeout=60)
    assert code != 0 and f"TORCHFT_LIGHTHOUSE={address}" in out, out[-3000:]
    assert "TimeoutError" not in out, "torchft's quorum timeout, said in the line instead"
