"""One job per prefix of a store (machinery/snapshot/storelock.py), on moto's S3 server as tests/test_store.py runs it:
a job frozen past its lease, a lock deleted under its holder, a job killed and started again, a live holder."""

import contextlib
import json
import logging
import os
import signal
import sys
import tempfile
import time

import pytest
import test_store
import torch
from conftest import (
    QUICK,
    ROOT,
    child_env,
    finish,
    logged_steps,
    outputs,
    start,
    train_cmd,
    wait_for,
    worker_pids,
)
from test_store import HOLDER, needs_s3

import train
from {{ cookiecutter.project_slug }}.machinery.distributed import DistEnv
from {{ cookiecutter.project_slug }}.machinery.snapshot import SnapshotError, Snapshots, load_latest, step_name

s3_server, bucket = test_store.s3_server, test_store.bucket  # moto's S3 server and a new bucket on it, as fixtures


def store():
    """A client of this module's S3 server (s3fs's cached one may point at the server of tests/test_store.py)."""
    import s3fs

    return s3fs.S3FileSystem(skip_instance_cache=True)


def state(step):
    return {"model": {"w": torch.full((64,), float(step))}, "step": step}


def snapshot_objects(bucket_name):
    """{name: ETag} of every object of the snapshots on the store: what a job writes there changes one."""
    fs = store()
    return {name: fs.info(name)["ETag"] for name in fs.find(f"{bucket_name}/run") if "/step-" in name}


@needs_s3
def test_a_job_frozen_past_its_lease_and_taken_over_writes_nothing_more_when_it_wakes(tmp_path, bucket, monkeypatch):
    """A training job of two ranks stopped (SIGSTOP) past STORE_LOCK_STALE_S loses the prefix to another job, which
    commits its own snapshots there. Woken, the first job uploads and commits nothing from any rank: it stops with
    one ERROR line naming the job that holds the prefix, and the other job's snapshots are as it wrote them."""
    monkeypatch.setenv("STORE_LOCK_STALE_S", "3")
    url = f"s3://{bucket}/run"
    args = QUICK + ["--max-steps", "40", "--snapshot-every", "10", "--eval-every", "0", "--keep-snapshots", "10"]
    env = child_env(WARM_START_POOL="")  # plain torchrun: the ranks are its children, for SIGSTOP
    frozen, ranks = start(train_cmd(2) + args + outputs(tmp_path)[2:] + ["--snapshot-dir", url], env=env), []
    try:
        wait_for(lambda: logged_steps(tmp_path), timeout=120, interval=0.002, what="the first job's first step")
        ranks = list(worker_pids(frozen.pid).values())
        for pid in ranks:
            os.kill(pid, signal.SIGSTOP)
        assert len(ranks) == 2, ranks
        (tmp_path / "taker").mkdir()  # where the other job stages its uploads: as on another machine
        monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "taker"))
        taker = Snapshots(url, DistEnv(), keep=10)
        taker.prepare(estimated_bytes=1)  # once the frozen job's lease has lapsed
        try:
            for step in (10, 20, 30, 40):
                taker.save(step, state(step), {}, blocking=True)
            written = snapshot_objects(bucket)
            for pid in ranks:
                os.kill(pid, signal.SIGCONT)
            code, out = finish(frozen, timeout=120)
            assert snapshot_objects(bucket) == written
        finally:
            taker.close()
    finally:
        for pid in ranks + [frozen.pid]:  # the ranks, and the agent's stand-in
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        frozen.wait()
    assert code != 0, out[-3000:]
    errors = [line for line in out.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and f"pid {os.getpid()}" in errors[0], errors
    assert torch.equal(load_latest(url)["model"]["w"], state(40)["model"]["w"])


@needs_s3
def test_a_deleted_lock_is_made_again_by_its_holder_or_lost_to_the_job_that_took_it(bucket, monkeypatch):
    monkeypatch.setenv("STORE_LOCK_STALE_S", "3")  # renewed every 0.5 s
    url, lock = f"s3://{bucket}/run", f"{bucket}/run/job.lock"
    holder = Snapshots(url, DistEnv(), keep=10)
    holder.prepare(estimated_bytes=1)
    try:
        owner = json.loads(store().cat_file(lock))["owner"]
        store().rm(lock)  # a lifecycle rule, or a user
        wait_for(lambda: store().exists(lock), timeout=10, what="the lock made again")
        assert json.loads(store().cat_file(lock))["owner"] == owner
        with pytest.raises(SnapshotError, match="held by another running job"):
            Snapshots(url, DistEnv(), keep=10).prepare(estimated_bytes=1)
        holder.save(10, state(10), {}, blocking=True)
        # deleted, and another job makes it before the holder's next renewal
        store().rm(lock)
        store().pipe(lock, json.dumps({"owner": "other", "job": "", "host": "elsewhere", "pid": 4242}).encode())
        with pytest.raises(SnapshotError, match="pid 4242"):
            holder.save(20, state(20), {}, blocking=True)
    finally:
        holder.close()
    assert not any(step_name(20) in name for name in store().find(f"{bucket}/run"))
    assert json.loads(store().cat_file(lock))["owner"] == "other"  # the other job's lock stays


@needs_s3
def test_a_lock_is_taken_at_once_from_a_killed_job_of_this_machine_and_refused_to_a_live_one(
    tmp_path, bucket, monkeypatch
):
    """A live holder, past its first lease: a job on the prefix stops at start-up with one line naming it, however
    often torchrun restarts it. SIGKILLed: the same command run again on this machine takes the lock at once, not
    after STORE_LOCK_STALE_S."""
    monkeypatch.setenv("STORE_LOCK_STALE_S", "4")  # renewed every 0.7 s: a live holder is seen in about a second
    url = f"s3://{bucket}/run"
    holder = start([sys.executable, "-c", HOLDER.format(root=str(ROOT), url=url)], env=child_env())
    try:
        assert holder.stdout.readline().strip() == "holding"
        time.sleep(4.5)  # its renewals, not its first write, keep the lock
        cmd = train_cmd(1, ["--max-restarts=2"]) + QUICK + ["--max-steps", "2"] + outputs(tmp_path)[2:]
        code, out = finish(start(cmd + ["--snapshot-dir", url]), timeout=180)
        assert code != 0
        errors = [line for line in out.splitlines() if " ERROR " in line]
        assert len(errors) == 1 and f"pid {holder.pid}" in errors[0], out[-3000:]
    finally:
        holder.kill()
        holder.wait()
    monkeypatch.setenv("STORE_LOCK_STALE_S", "60")
    started = time.monotonic()
    snapshots = Snapshots(url, DistEnv(), keep=2)
    snapshots.prepare(estimated_bytes=1)
    snapshots.close()
    assert time.monotonic() - started < 20


@needs_s3
def test_a_lock_of_another_machine_is_waited_for_until_its_lease_lapses(tmp_path, bucket, monkeypatch, caplog, capfd):
    """A lock whose holder this machine cannot see: the job says once how long it waits, then takes it over when no
    renewal came. A bad STORE_LOCK_STALE_S stops a job at start-up in one line naming it."""
    url, lock = f"s3://{bucket}/run", f"{bucket}/run/job.lock"
    monkeypatch.setenv("STORE_LOCK_STALE_S", "10s")
    with pytest.raises(SystemExit) as stopped:
        train.main(QUICK + ["--max-steps", "2"] + outputs(tmp_path)[2:] + ["--snapshot-dir", url])
    assert stopped.value.code == 2
    err = capfd.readouterr().err
    errors = [line for line in err.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and "STORE_LOCK_STALE_S" in errors[0] and "Traceback" not in err, err[-3000:]

    monkeypatch.setenv("STORE_LOCK_STALE_S", "3")
    store().pipe(lock, json.dumps({"owner": "other", "job": "", "host": "elsewhere", "pid": 4242}).encode())
    started = time.monotonic()
    with caplog.at_level(logging.INFO):
        snapshots = Snapshots(url, DistEnv(), keep=2)
        snapshots.prepare(estimated_bytes=1)
    try:
        assert time.monotonic() - started >= 2  # the lease, by the store's clock
        assert json.loads(store().cat_file(lock))["owner"] != "other"
        said = [r for r in caplog.records if r.name.endswith("storelock") and r.levelno == logging.INFO]
        assert len(said) == 1 and "4242" in said[0].getMessage(), [r.getMessage() for r in caplog.records]
    finally:
        snapshots.close()
