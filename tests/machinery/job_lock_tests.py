"""One job per snapshot folder (job.lock).

Other jobs are real processes: a `python -c` holding the lock through the project's own module, a real torchrun.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import pytest
import torch
from conftest import QUICK, ROOT, outputs, run, start, train_cmd, wait_for

sys.path.insert(0, str(ROOT))

from ddp_project.machinery import identity, joblock
from ddp_project.machinery.distributed import DistEnv
from ddp_project.machinery.snapshot import MANIFEST, SnapshotError, Snapshots, step_name

PACKAGE = "ddp_project"
# Takes the lock of the folder argv[1] as rank 0 of a job does; then "hold" keeps it (with its heartbeat) until
# killed, "vanish" dies at once without releasing it, as a SIGKILLed job would.
HOLDER = f"""
import os, sys, time
from {PACKAGE}.machinery.joblock import JobLock
lock = JobLock(sys.argv[1])
lock.acquire()
lock.start_heartbeat()
print("locked", flush=True)
if sys.argv[2] == "vanish":
    os._exit(0)
time.sleep(600)
"""


@pytest.fixture(autouse=True)
def outside_torchrun(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.delenv("JOB_LOCK_STALE_S", raising=False)


def hold_lock(folder, mode="hold"):
    """A process that holds folder's job lock; returned once it does."""
    folder.mkdir(parents=True, exist_ok=True)
    proc = start([sys.executable, "-c", HOLDER, str(folder), mode])
    line = proc.stdout.readline()
    assert line.strip() == "locked", line + proc.stdout.read()
    return proc


def lock_record(folder):
    return json.loads((folder / joblock.LOCK_FILE).read_text())


def prepare(folder, fresh_start=False):
    snapshots = Snapshots(folder, DistEnv(), keep=3)
    snapshots.prepare(estimated_bytes=1, fresh_start=fresh_start)
    return snapshots


def foreign_lock(folder, host, job="", heartbeat_age=0.0):
    """A lock as a job on another machine leaves it, its heartbeat `heartbeat_age` seconds old."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / joblock.LOCK_FILE
    now = time.time()
    path.write_text(
        json.dumps(
            {
                "host": host,
                "boot_id": "other-boot",
                "pid": 4242,
                "pid_started": 1,
                "job": job,
                "started": now - 3600,
                "heartbeat": now - heartbeat_age,
                "owner": "f" * 16,
            }
        )
    )
    os.utime(path, (now - heartbeat_age, now - heartbeat_age))
    return path


def test_a_live_job_keeps_its_folder(tmp_path):
    folder = tmp_path / "snapshots"
    snapshots = prepare(folder)
    snapshots.save(20, {"model": {"w": torch.zeros(3)}, "step": 20}, {}, blocking=True)
    snapshots.close()
    holder = hold_lock(folder)
    try:
        in_progress = folder / step_name(40)  # the live job's save in progress: not ours to clean up
        in_progress.mkdir()
        (in_progress / "shared.pt.tmp-1").write_bytes(b"\0" * 10)
        with pytest.raises(SnapshotError) as info:
            prepare(folder)
        message = str(info.value)
        assert "\n" not in message and str(folder) in message
        assert socket.gethostname() in message and f"pid {holder.pid}" in message
        assert lock_record(folder)["pid"] == holder.pid and in_progress.is_dir()
        # --resume never is refused the same way, and moves nothing.
        with pytest.raises(SnapshotError, match=f"pid {holder.pid}"):
            prepare(folder, fresh_start=True)
        assert [path.name for path in tmp_path.iterdir()] == ["snapshots"]
        assert (folder / step_name(20) / MANIFEST).exists()
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()
    # Once that job is gone (SIGKILLed: no release), the folder is free again.
    snapshots = prepare(folder)
    assert lock_record(folder)["pid"] == os.getpid() and not in_progress.exists()
    snapshots.close()


def test_the_lock_of_a_job_that_died_is_taken_over_with_a_warning(tmp_path, caplog):
    folder = tmp_path / "snapshots"
    holder = hold_lock(folder, mode="vanish")
    holder.wait()
    holder.stdout.close()
    assert lock_record(folder)["pid"] == holder.pid, "the dead job left its lock behind"
    snapshots = prepare(folder)
    assert lock_record(folder)["pid"] == os.getpid()
    assert any(str(holder.pid) in r.getMessage() for r in caplog.records if r.levelname == "WARNING")
    snapshots.close()


def test_close_gives_the_folder_to_the_next_job(tmp_path):
    folder = tmp_path / "snapshots"
    snapshots = prepare(folder)
    assert lock_record(folder)["pid"] == os.getpid()
    snapshots.close()
    assert not (folder / joblock.LOCK_FILE).exists()
    holder = hold_lock(folder)  # another process takes it at once
    holder.kill()
    holder.wait()
    holder.stdout.close()


def test_another_machine_with_a_fresh_heartbeat_keeps_the_folder(tmp_path):
    folder = tmp_path / "snapshots"
    foreign_lock(folder, "node-17", heartbeat_age=2)
    with pytest.raises(SnapshotError, match="in use by another job .*host node-17, pid 4242"):
        prepare(folder)
    assert lock_record(folder)["host"] == "node-17"


def test_another_machine_with_a_stale_heartbeat_is_taken_over(tmp_path, monkeypatch):
    folder = tmp_path / "snapshots"
    monkeypatch.setenv("JOB_LOCK_STALE_S", "20")
    foreign_lock(folder, "node-17", heartbeat_age=120)
    snapshots = prepare(folder)
    assert lock_record(folder)["host"] == socket.gethostname() and lock_record(folder)["pid"] == os.getpid()
    snapshots.close()


def test_a_restart_of_the_same_torchrun_job_takes_the_lock_at_once(tmp_path, monkeypatch):
    """Rank 0 of the restarted job may run on another machine than before; the old lock is fresh."""
    folder = tmp_path / "snapshots"
    foreign_lock(folder, "node-17", job="job-42", heartbeat_age=0)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-42")
    snapshots = prepare(folder)
    assert lock_record(folder)["pid"] == os.getpid() and lock_record(folder)["job"] == "job-42"
    snapshots.close()
    foreign_lock(folder, "node-17", job="job-41", heartbeat_age=0)
    with pytest.raises(SnapshotError, match="torchrun job job-41"):
        prepare(folder)


def test_torchruns_default_job_id_names_no_job(tmp_path, monkeypatch):
    """Every torchrun without --rdzv-id gets the id "none": two such jobs are not one job."""
    folder = tmp_path / "snapshots"
    foreign_lock(folder, "node-17", job="none", heartbeat_age=0)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    with pytest.raises(SnapshotError, match="in use by another job"):
        prepare(folder)


def test_heartbeat_keeps_the_lock_fresh_and_a_job_that_lost_it_commits_nothing(tmp_path):
    folder = tmp_path / "snapshots"
    snapshots = prepare(folder)
    lock = folder / joblock.LOCK_FILE
    written = os.stat(lock).st_mtime
    wait_for(
        lambda: os.stat(lock).st_mtime > written, timeout=4 * joblock.HEARTBEAT_S, interval=0.2, what="a heartbeat"
    )
    # Another machine judged this job dead and took the folder over.
    foreign_lock(folder, "node-17", heartbeat_age=0)
    step = [0]

    def commit_refused():
        step[0] += 1
        try:
            snapshots.save(step[0], {"model": {"w": torch.zeros(3)}, "step": step[0]}, {}, blocking=True)
        except SnapshotError as exc:
            return str(exc)
        return None

    reason = wait_for(commit_refused, timeout=4 * joblock.HEARTBEAT_S, interval=0.5, what="a refused commit")
    assert "node-17" in reason
    assert not (folder / step_name(step[0]) / MANIFEST).exists()
    snapshots.close()
    assert lock_record(folder)["host"] == "node-17", "closing does not remove a lock that is not ours"


def test_a_lock_that_is_a_folder_is_one_clear_error(tmp_path):
    folder = tmp_path / "snapshots"
    (folder / joblock.LOCK_FILE).mkdir(parents=True)
    with pytest.raises(SnapshotError, match=f"{folder / joblock.LOCK_FILE} is a folder, not a job lock: delete it"):
        prepare(folder)


# -- odd lock files, written by hand ------------------------------------------------------------------------------


def dead_pid():
    """The pid of a process of this machine that has exited (and been reaped)."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def local_record(**changes):
    """A lock record as a job on this machine writes it, with `changes`."""
    now = time.time()
    record = {
        "host": socket.gethostname(),
        "boot_id": identity.boot_id(),
        "pid": dead_pid(),
        "pid_started": 1,
        "job": "",
        "started": now,
        "heartbeat": now,
        "owner": "e" * 16,
    }
    record.update(changes)
    return {key: value for key, value in record.items() if value is not None}


def write_lock(path, content, age=0.0):
    """`content` (bytes as they are, or a record as JSON) into `path`, dated `age` seconds ago (< 0: ahead)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content if isinstance(content, bytes) else json.dumps(content).encode())
    when = time.time() - age
    os.utime(path, (when, when))
    return path


@contextmanager
def within(seconds):
    """Fail instead of hanging when the block takes longer than `seconds` (a blocking open is interrupted)."""

    def late(signum, frame):
        raise AssertionError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, late)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def assert_taken(folder):
    snapshots = prepare(folder)
    assert lock_record(folder)["owner"] == snapshots.job_lock.owner
    snapshots.close()
    assert not (folder / joblock.LOCK_FILE).exists()


@pytest.mark.parametrize(
    "guard",
    [lambda: local_record(), lambda: b"\xff\x00 half a record"],
    ids=["its-job-died", "damaged"],
)
def test_a_takeover_guard_left_by_a_dead_job_is_cleared_at_once(tmp_path, caplog, monkeypatch, guard):
    """A job that died while taking over left job.lock.takeover: the next one clears it by its owner or its age."""
    monkeypatch.setattr(joblock, "UNREADABLE_GRACE_S", 0.2)
    folder = tmp_path / "snapshots"
    write_lock(folder / joblock.LOCK_FILE, local_record())
    leftover = write_lock(folder / f"{joblock.LOCK_FILE}.takeover", guard())
    with within(10):
        assert_taken(folder)
    assert not leftover.exists()
    warnings = [record for record in caplog.records if record.levelname == "WARNING"]
    assert len(warnings) <= 2, [record.getMessage() for record in warnings]  # not once per attempt


def test_a_takeover_guard_of_a_live_job_is_left_alone_and_named(tmp_path, monkeypatch):
    monkeypatch.setattr(joblock, "ATTEMPTS", 3)
    folder = tmp_path / "snapshots"
    write_lock(folder / joblock.LOCK_FILE, local_record())
    guard = write_lock(folder / f"{joblock.LOCK_FILE}.takeover", local_record(pid=os.getppid(), pid_started=None))
    with pytest.raises(SnapshotError, match=f"delete {guard}"):
        prepare(folder)
    assert guard.exists()


@pytest.mark.parametrize("pid", [2**40, 10**30], ids=["2**40", "10**30"])
def test_a_lock_naming_an_absurd_pid_is_a_dead_jobs(tmp_path, pid):
    folder = tmp_path / "snapshots"
    write_lock(folder / joblock.LOCK_FILE, local_record(pid=pid, pid_started=None))
    assert_taken(folder)


@pytest.mark.parametrize(
    "content",
    [
        b"\xff\xfe\x00garbage",
        b"[" * 100_000,
        b'{"pid": ' + b"1" * 5000 + b"}",
        json.dumps(local_record(pid="1234")).encode(),
        b" " * (1 << 20) + b"{}",
    ],
    ids=["bytes", "nested", "5000-digits", "pid-a-string", "1-MiB"],
)
def test_a_damaged_lock_dated_a_day_ahead_is_taken_over(tmp_path, monkeypatch, content):
    monkeypatch.setattr(joblock, "UNREADABLE_GRACE_S", 0.2)
    folder = tmp_path / "snapshots"
    write_lock(folder / joblock.LOCK_FILE, content, age=-86400)
    with within(10):
        assert_taken(folder)


def test_a_named_pipe_in_the_locks_place_is_one_clear_error(tmp_path):
    folder = tmp_path / "snapshots"
    folder.mkdir()
    os.mkfifo(folder / joblock.LOCK_FILE)
    with within(10), pytest.raises(SnapshotError, match=f"{folder / joblock.LOCK_FILE} is not a file"):
        prepare(folder)


def test_another_machines_lock_dated_a_day_ahead_is_judged_by_its_heartbeat(tmp_path, monkeypatch):
    """Its date cannot be trusted, whatever JOB_LOCK_STALE_S: a lock that stays unchanged for JOB_LOCK_STALE_S is a
    dead job's; one rewritten meanwhile (a live job whose clock runs a day ahead) is left alone."""
    monkeypatch.setenv("JOB_LOCK_STALE_S", "1")
    folder = tmp_path / "snapshots"
    foreign_lock(folder, "node-17", heartbeat_age=-86400)
    with within(10):
        assert_taken(folder)

    lock = foreign_lock(folder, "node-17", heartbeat_age=-86400)
    record, beating = lock.read_bytes(), threading.Event()

    def heartbeat():
        while not beating.wait(0.2):
            write_lock(lock.with_name("beat"), record, age=-86400).replace(lock)

    thread = threading.Thread(target=heartbeat)
    thread.start()
    try:
        with within(10), pytest.raises(SnapshotError, match=f"delete {lock}"):
            prepare(folder)
    finally:
        beating.set()
        thread.join()
    assert json.loads(lock.read_bytes())["host"] == "node-17"


def test_a_lock_of_pid_1_without_a_start_time_is_refused_saying_how_to_clear_it(tmp_path):
    """pid 1 always runs: without a start time the lock cannot be told from init. train.py stops before training."""
    lock = write_lock(tmp_path / "run-snapshots" / joblock.LOCK_FILE, local_record(pid=1, pid_started=None))
    written = lock.read_bytes()
    result = run(train_cmd() + ["--max-steps", "2"] + QUICK + outputs(tmp_path), check=False, timeout=120)
    assert result.returncode == 2, result.stdout[-3000:]
    assert "Traceback" not in result.stdout
    assert f"delete {lock}" in result.stdout
    assert lock.read_bytes() == written
    assert not list(lock.parent.glob("step-*")) and not (tmp_path / "run-export").exists()


def test_bad_stale_setting_is_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("JOB_LOCK_STALE_S", "soon")
    with pytest.raises(SnapshotError, match="JOB_LOCK_STALE_S must be a number of seconds > 0, got 'soon'"):
        prepare(tmp_path / "snapshots")
