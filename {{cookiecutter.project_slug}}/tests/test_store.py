"""Snapshots on object storage: a real S3 API server (moto's, a process of its own) used through s3fs, as a job
on a cluster without a shared filesystem uses S3 or MinIO."""

import importlib.util
import io
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch
from conftest import (
    QUICK,
    ROOT,
    assert_same_weights,
    child_env,
    finish,
    free_port,
    logged_steps,
    metrics,
    outputs,
    project,
    start,
    wait_for,
    worker_pids,
)

sys.path.insert(0, str(ROOT))

import train
from {{ cookiecutter.project_slug }}.machinery.distributed import DistEnv
from {{ cookiecutter.project_slug }}.machinery.snapshot import SHARED, Snapshots, load_latest, step_name

STEPS = 80
ARGS = QUICK + ["--max-steps", str(STEPS), "--snapshot-every", "20"]
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
needs_s3 = pytest.mark.skipif(
    not all(importlib.util.find_spec(name) for name in ("s3fs", "moto", "boto3")),
    reason="pip install -e '.[dev]' (moto[server], s3fs, boto3)",
)


@pytest.fixture(scope="module")
def s3_server():
    """moto's S3 server on 127.0.0.1, for this module's tests; yields its endpoint."""
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    try:

        def listening():
            with socket.socket() as probe:
                return probe.connect_ex(("127.0.0.1", port)) == 0

        wait_for(listening, timeout=60, what="moto's S3 server")
        yield endpoint
    finally:
        server.kill()
        server.wait()


@pytest.fixture
def bucket(s3_server, monkeypatch, request):
    """A new, empty bucket on the server; the environment points s3fs (and child processes) at it."""
    import boto3

    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server)
    for key, value in CREDENTIALS.items():
        monkeypatch.setenv(key, value)
    name = f"b{random.randrange(1 << 40):x}"
    boto3.client("s3").create_bucket(Bucket=name)
    return name


def store():
    import s3fs

    fs = s3fs.S3FileSystem()
    fs.invalidate_cache()
    return fs


def save_steps(url, steps, keep=10):
    snapshots = Snapshots(url, DistEnv(), keep=keep)
    snapshots.prepare(estimated_bytes=1)
    for step in steps:
        snapshots.save(step, {"model": {"w": torch.full((64,), float(step))}, "step": step}, {}, blocking=True)
    snapshots.close()


def test_a_missing_store_package_names_the_extra_to_install(tmp_path, capfd):
    if importlib.util.find_spec("gcsfs"):
        pytest.skip("gcsfs is installed")
    with pytest.raises(SystemExit) as stopped:
        train.main(QUICK + ["--max-steps", "2"] + outputs(tmp_path)[2:] + ["--snapshot-dir", "gs://bucket/run"])
    assert stopped.value.code == 2
    assert "'.[gcs]'" in capfd.readouterr().err  # what to install
    assert not (tmp_path.parent / "gs:").exists() and not os.path.exists("gs:")


@needs_s3
@pytest.mark.parametrize("where, error", [("missing bucket", "bucket does not exist"), ("wrong endpoint", "connect")])
def test_a_store_the_job_cannot_use_stops_it_at_start_up(tmp_path, bucket, monkeypatch, where, error, capfd):
    """One line naming the URL and the store's own error, within seconds."""
    url = f"s3://{bucket}-missing/run" if where == "missing bucket" else f"s3://{bucket}/run"
    if where == "wrong endpoint":
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    started = time.monotonic()
    with pytest.raises(SystemExit) as stopped:
        train.main(QUICK + ["--max-steps", "2"] + outputs(tmp_path)[2:] + ["--snapshot-dir", url])
    assert stopped.value.code == 2
    assert time.monotonic() - started < 30
    errors = [line for line in capfd.readouterr().err.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and url in errors[0] and error in errors[0].lower(), errors
    assert logged_steps(tmp_path) == []
    assert not os.path.exists("s3:")


def machine(tmp_path, name, port, node, args, nnodes=2, nproc=1):
    """torchrun on one of `nnodes` "machines" of `nproc` ranks each, joined by a c10d rendezvous: its own copy of the
    project, working folder, temp folder (where its ranks stage what they upload), log and metrics files. The
    machines share only the rendezvous and the store. Returns (its folder, its agent)."""
    folder = project(tmp_path, name=name)
    (folder / "tmp").mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--nproc_per_node={nproc}"]
    cmd += ["--max-restarts=2", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=job-{port}"]
    cmd += [f"--rdzv-conf=is_host={int(node == 0)}", str(folder / "train.py"), *args]
    cmd += ["--log-file", str(folder / "run.log"), "--metrics-file", str(folder / "run-metrics.jsonl")]
    return folder, start(cmd, env=child_env(PYTHONPATH=folder, TMPDIR=folder / "tmp"), cwd=folder)


@needs_s3
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_sigkilled_job_resumes_from_the_store_bitwise_equal(tmp_path, bucket, reference_runs, strategy, cleanup):
    """Two ranks, a worker SIGKILLed at a random moment: torchrun restarts every rank, each resumes from the store,
    and load_latest(url) gives the uninterrupted run's final model. ddp: on two machines of one rank each, with no
    folder in common (each stages its own part); fsdp: on one machine. The store keeps two snapshots, the run id
    and config.toml; the export is on the store too."""
    # one thread per rank: the numerics of one machine of two ranks (the reference) and two machines of one
    args = ARGS + ["--threads-per-rank", "1"] + (["--strategy", "fsdp"] if strategy == "fsdp" else [])
    reference = reference_runs(args)
    url, export = f"s3://{bucket}/run", f"s3://{bucket}/export"
    args += ["--snapshot-dir", url, "--export-dir", export, "--keep-snapshots", "2"]
    port = free_port()
    if strategy == "ddp":
        machines = [machine(tmp_path, name, port, node, args) for node, name in enumerate(["machine-a", "machine-b"])]
    else:
        machines = [machine(tmp_path, "machine-a", port, 0, args, nnodes=1, nproc=2)]
    cleanup.extend(agent for _, agent in machines)
    step = random.randint(25, 50)  # at least 30 steps before the end of the run
    logged = lambda: [done for folder, _ in machines for done in logged_steps(folder)]  # noqa: E731 - rank 0's
    _, victim = random.choice(machines)
    workers = wait_for(lambda: list(worker_pids(victim.pid).values()), timeout=180, what="the workers")
    # a snapshot on the store first (its upload runs beside the steps, which may outrun it), then the chosen step
    committed = lambda: any(name.endswith("/manifest.json") for name in store().find(f"{bucket}/run"))  # noqa: E731
    wait_for(committed, timeout=180, what="the first snapshot on the store")
    wait_for(lambda: any(done >= step for done in logged()), timeout=180, interval=0.002, what=f"step {step}")
    time.sleep(random.uniform(0, 0.01))
    os.kill(random.choice(workers), signal.SIGKILL)
    for folder, agent in machines:
        code, out = finish(agent)
        assert code == 0, f"{folder.name} exited {code}:\n{out[-5000:]}"
    done = json.loads(store().cat_file(f"{bucket}/export/summary.json"))
    assert done["resumed_from"] >= 20 and (done["world_size"], done["steps"]) == (2, STEPS), done
    newest = json.loads(store().cat_file(f"{bucket}/run/{step_name(STEPS)}/manifest.json"))
    assert done["snapshot_bytes"] == sum(entry["size"] for entry in newest["files"].values()) > 0
    # rank 0's metrics file, on whichever machine: one run's records, every logged step once (a restart that
    # found no run id on the store, e.g. before its first commit, started another run and set them aside)
    records = [record for folder, _ in machines for record in metrics(folder)]
    assert [record["step"] for record in records] == list(range(5, STEPS + 1, 5))
    assert {record["run_id"] for record in records} == {done["run_id"]}
    assert_same_weights(reference["model"], load_latest(url)["model"])
    exported = torch.load(io.BytesIO(store().cat_file(f"{bucket}/export/model.pt")), weights_only=True)
    assert_same_weights(reference["model"], exported)
    names = {name.split("/", 2)[2] for name in store().find(f"{bucket}/run")}
    # Two kept, the last step's newest (a snapshot step whose upload would queue behind another's is skipped)
    kept = sorted({name.split("/")[0] for name in names if name.startswith("step-")})
    assert len(kept) == 2 and kept[-1] == step_name(STEPS), kept
    assert {"run.json", "config.toml"} <= names


@needs_s3
@pytest.mark.parametrize("damage", ["bit flip", "missing"])
def test_a_damaged_object_falls_back_to_the_previous_snapshot(bucket, damage):
    url = f"s3://{bucket}/run"
    save_steps(url, [10, 20])
    newest = f"{bucket}/run/{step_name(20)}/{SHARED}"
    if damage == "missing":
        store().rm(newest)
    else:
        data = bytearray(store().cat_file(newest))
        data[len(data) // 2] ^= 0x10
        store().pipe_file(newest, bytes(data))
    assert load_latest(url)["step"] == 10
    snapshots = Snapshots(url, DistEnv(), keep=10)
    snapshots.prepare(estimated_bytes=1)
    try:
        assert snapshots.resume()["step"] == 10
    finally:
        snapshots.close()


@needs_s3
def test_keep_snapshots_prunes_on_the_store(bucket):
    save_steps(f"s3://{bucket}/run", [10, 20, 30, 40], keep=2)
    steps = {name.split("/")[2] for name in store().find(f"{bucket}/run") if "/step-" in name}
    assert steps == {step_name(30), step_name(40)}


class FlakyLink:
    """A TCP relay to the S3 server that can go down: while down it closes every connection, open or new."""

    def __init__(self, endpoint, delay=0.0):
        self.target = int(endpoint.rsplit(":", 1)[1])
        self.down = False
        self.delay = delay  # seconds before each chunk passes: a slow store
        self.open: list[socket.socket] = []
        self.server = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self.server.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def cut(self, down):
        self.down = down
        for conn in list(self.open) if down else []:
            conn.close()

    def _accept(self):
        while True:
            conn, _ = self.server.accept()
            if self.down:
                conn.close()
                continue
            upstream = socket.create_connection(("127.0.0.1", self.target))
            self.open += [conn, upstream]
            for a, b in ((conn, upstream), (upstream, conn)):
                threading.Thread(target=self._relay, args=(a, b), daemon=True).start()

    def _relay(self, source, target):
        try:
            while data := source.recv(1 << 16):
                time.sleep(self.delay)
                target.sendall(data)
        except OSError:
            pass
        for end in (source, target):
            end.close()


@needs_s3
def test_a_store_briefly_unreachable_delays_the_snapshots_not_the_saves(s3_server, bucket, monkeypatch, caplog):
    """Uploads go on in the background and are retried: the saves return at once while the store is cut off, a
    WARNING says snapshots are late, and both are committed once it is back."""
    link = FlakyLink(s3_server)
    monkeypatch.setenv("AWS_ENDPOINT_URL", link.endpoint)
    url = f"s3://{bucket}/run"
    snapshots = Snapshots(url, DistEnv(), keep=10)
    snapshots.prepare(estimated_bytes=1)
    try:
        link.cut(True)
        started = time.monotonic()
        for step in (10, 20):
            snapshots.save(step, {"model": {"w": torch.full((64,), float(step))}, "step": step}, {})
        # a save that waited for the store would wait for its retries: minutes
        assert time.monotonic() - started < 15, "a save waited for the store"
        late = lambda: any(r.levelname == "WARNING" and url in r.getMessage() for r in caplog.records)  # noqa: E731
        wait_for(late, timeout=30, what="a WARNING that the snapshots are late")
        time.sleep(1)
        link.cut(False)
        snapshots.wait()
    finally:
        snapshots.close()
    assert load_latest(url)["step"] == 20 and store().exists(f"{bucket}/run/{step_name(10)}/manifest.json")


@needs_s3
def test_a_store_slower_than_the_snapshot_steps_gets_the_newest_snapshot_not_a_queue(
    tmp_path, s3_server, bucket, monkeypatch
):
    """--snapshot-every 1 to a slow store: a snapshot step whose upload would queue behind the one before is
    skipped (one WARNING), so uploads never pile up on disk or in time, and the run's last step is committed."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", FlakyLink(s3_server, delay=0.05).endpoint)
    url = f"s3://{bucket}/run"
    args = QUICK + ["--max-steps", "30", "--snapshot-every", "1", "--keep-snapshots", "100", "--eval-every", "0"]
    files = ["--log-file", tmp_path / "run.log", "--metrics-file", tmp_path / "run-metrics.jsonl"]
    train.main(args + [str(item) for item in files] + ["--export-dir", str(tmp_path / "export"), "--snapshot-dir", url])
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server)
    committed = sorted(int(name.rsplit("-", 1)[1]) for name in store().ls(f"{bucket}/run") if "/step-" in name)
    assert committed[-1] == 30 and len(committed) < 30 / 2, committed
    assert load_latest(url)["step"] == 30
    warnings = [line for line in (tmp_path / "run.log").read_text().splitlines() if " WARNING " in line and url in line]
    assert len(warnings) == 1, warnings


HOLDER = """
import sys, time
sys.path.insert(0, {root!r})
from {{ cookiecutter.project_slug }}.machinery.distributed import DistEnv
from {{ cookiecutter.project_slug }}.machinery.snapshot import Snapshots
Snapshots({url!r}, DistEnv(), keep=2).prepare(estimated_bytes=1)
print("holding", flush=True)
time.sleep(600)
"""
