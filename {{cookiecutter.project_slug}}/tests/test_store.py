"""Snapshots on object storage: a real S3 API server (moto's, a process of its own) used through s3fs, as a job
on a cluster without a shared filesystem uses S3 or MinIO."""

import importlib.util
import io
import json
import os
import random
import re
import signal
import socket
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
from {{ cookiecutter.project_slug }}.machinery.snapshot import SHARED, SnapshotError, Snapshots, load_latest, step_name

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


@pytest.mark.parametrize("url", ["s3:/bkt/x", "s3:bkt/x", "S3://bkt/x", "s3://bkt//x", "s3://bkt/x//y/"])
def test_a_store_url_spelled_two_ways_or_as_a_folder_is_refused(tmp_path, url, capfd):
    """One spelling per prefix: a URL the store would take as another prefix (//), one in capitals, and one that
    would be a local folder (a slash missing) are refused at start-up in one line naming it."""
    with pytest.raises(SystemExit) as stopped:
        train.main(QUICK + ["--max-steps", "2"] + outputs(tmp_path)[2:] + ["--export-dir", url])
    assert stopped.value.code == 2
    errors = [line for line in capfd.readouterr().err.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and url in errors[0] and "--export-dir" in errors[0], errors
    with pytest.raises(SnapshotError, match=re.escape(url)):
        load_latest(url)
    assert not os.path.exists("s3:") and not (tmp_path / "s3:").exists()


@needs_s3
@pytest.mark.parametrize(
    "where, error",
    [
        ("missing bucket", "bucket does not exist"),
        ("wrong endpoint", "connect"),
        ("silent endpoint", "timeout"),
        ("credentials refused", "denied"),
    ],
)
def test_a_store_the_job_cannot_use_stops_it_at_start_up(tmp_path, s3_server, bucket, monkeypatch, where, error, capfd):
    """One line naming the URL and the store's own error, within seconds (an endpoint that never answers: within
    STORE_TIMEOUT_S)."""
    url = f"s3://{bucket}-missing/run" if where == "missing bucket" else f"s3://{bucket}/run"
    if where == "wrong endpoint":
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    if where in ("silent endpoint", "credentials refused"):
        link = FlakyLink(s3_server)
        link.cut(True, "silent" if where == "silent endpoint" else "forbid")
        monkeypatch.setenv("AWS_ENDPOINT_URL", link.endpoint)
        monkeypatch.setenv("STORE_TIMEOUT_S", "6")
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


def damage_puts(monkeypatch, suffix, times):
    """s3fs PUTs the first `times` objects whose key ends in `suffix` with one byte flipped on the way."""
    import s3fs

    left = [times]

    def flipped(data: bytes) -> bytes:
        left[0] -= 1
        damaged = bytearray(data)
        damaged[len(damaged) // 2] ^= 0x10
        return bytes(damaged)

    put_file, pipe_file = s3fs.S3FileSystem._put_file, s3fs.S3FileSystem._pipe_file

    async def damaged_put_file(self, lpath, rpath, *args, **kwargs):
        if rpath.endswith(suffix) and left[0] > 0:
            copy = f"{lpath}.damaged"
            with open(lpath, "rb") as source, open(copy, "wb") as target:
                target.write(flipped(source.read()))
            lpath = copy
        return await put_file(self, lpath, rpath, *args, **kwargs)

    async def damaged_pipe_file(self, path, data, *args, **kwargs):
        if path.endswith(suffix) and left[0] > 0:
            data = flipped(data)
        return await pipe_file(self, path, data, *args, **kwargs)

    monkeypatch.setattr(s3fs.S3FileSystem, "_put_file", damaged_put_file)
    monkeypatch.setattr(s3fs.S3FileSystem, "_pipe_file", damaged_pipe_file)
    return left


@needs_s3
@pytest.mark.parametrize("times", [1, 1000])
def test_a_manifest_damaged_on_its_way_to_the_store_is_written_again(bucket, monkeypatch, times):
    """The commit marker is read back like every other object: a byte flipped in its PUT does not commit a damaged
    snapshot (which every reader would skip for the one before, silently); it is written again, and where it never
    reads back whole (within STORE_TIMEOUT_S) the save fails and the step does not count."""
    monkeypatch.setenv("STORE_TIMEOUT_S", "3")
    url = f"s3://{bucket}/run"
    left = damage_puts(monkeypatch, f"{step_name(20)}/manifest.json", times=times)
    if times == 1:
        save_steps(url, [10, 20])
        assert left == [0], "no manifest was damaged"
        assert load_latest(url)["step"] == 20
        return
    with pytest.raises(SnapshotError, match=f"{url}/{step_name(20)}/manifest.json"):
        save_steps(url, [10, 20])
    assert left[0] < times
    assert not store().exists(f"{bucket}/run/{step_name(20)}/manifest.json")
    assert load_latest(url)["step"] == 10


@needs_s3
def test_keep_snapshots_prunes_on_the_store(bucket):
    save_steps(f"s3://{bucket}/run", [10, 20, 30, 40], keep=2)
    steps = {name.split("/")[2] for name in store().find(f"{bucket}/run") if "/step-" in name}
    assert steps == {step_name(30), step_name(40)}


@needs_s3
def test_a_fresh_start_moves_the_prefix_aside_and_an_interrupted_move_is_finished(bucket, monkeypatch):
    """--resume never on a prefix another job's snapshots are in: every object is copied aside to
    <prefix>.set-aside-<date>, checked, then removed. A job that ends half-way through leaves a record of the move
    on the prefix; the next start finishes it before anything else: nothing is lost or left twice."""
    import s3fs

    url = f"s3://{bucket}/run"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-a")
    save_steps(url, [10, 20])
    before = {name.split("/", 2)[2]: size for name, size in store().find(f"{bucket}/run", detail=True).items()}
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-b")
    rm_file, removed = s3fs.S3FileSystem._rm_file, []

    async def fails_after_one(self, path, **kwargs):  # the job ends once one original snapshot object is removed
        if "/step-" in path:
            if removed:
                raise PermissionError(f"{path}: the job ended here")
            removed.append(path)
        return await rm_file(self, path, **kwargs)

    monkeypatch.setattr(s3fs.S3FileSystem, "_rm_file", fails_after_one)
    with pytest.raises(SnapshotError, match="the job ended here"):
        Snapshots(url, DistEnv(), keep=10).prepare(estimated_bytes=1, fresh_start=True)
    assert removed[0].endswith("/manifest.json")  # the manifests go first: no half-removed snapshot is committed
    monkeypatch.setattr(s3fs.S3FileSystem, "_rm_file", rm_file)
    snapshots = Snapshots(url, DistEnv(), keep=10)  # a restart (--resume auto) finishes the move
    snapshots.prepare(estimated_bytes=1)
    try:
        assert snapshots.resume() is None
    finally:
        snapshots.close()
    (aside,) = [name for name in store().ls(bucket) if ".set-aside-" in name]
    after = {name.split("/", 2)[2]: size for name, size in store().find(aside, detail=True).items()}
    assert {name: info["size"] for name, info in after.items()} == {n: i["size"] for n, i in before.items()}
    assert store().find(f"{bucket}/run") == []
    assert load_latest(f"s3://{aside}")["step"] == 20


@needs_s3
def test_another_runs_export_on_the_store_moves_aside_and_comes_back(tmp_path, bucket):
    """As in an export folder: a run exporting to a URL another run exported to first moves that run's files aside
    to <url>.<its run id> (copied, checked, removed), and they come back when that run exports there again."""
    from {{ cookiecutter.project_slug }}.machinery.outputs import ExportFolder

    url = f"s3://{bucket}/export"

    def export(run_id):
        folder = ExportFolder(DistEnv(), url, run_id)
        try:
            (Path(folder.path) / "model.pt").write_bytes(f"weights of {run_id}".encode())
            (Path(folder.path) / "hf").mkdir(exist_ok=True)
            (Path(folder.path) / "hf" / "config.json").write_text(run_id)
            folder.publish()
        finally:
            folder.close()

    export("run-a")
    export("run-b")
    assert store().cat_file(f"{bucket}/export/model.pt") == b"weights of run-b"
    assert store().cat_file(f"{bucket}/export.run-a/model.pt") == b"weights of run-a"
    assert store().cat_file(f"{bucket}/export.run-a/hf/config.json") == b"run-a"
    export("run-a")  # run-a again: its files come back, run-b's go aside
    assert store().cat_file(f"{bucket}/export/model.pt") == b"weights of run-a"
    assert store().cat_file(f"{bucket}/export.run-b/model.pt") == b"weights of run-b"
    assert not store().exists(f"{bucket}/export.run-a/model.pt")


FORBIDDEN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>AccessDenied</Code><Message>Access Denied</Message>'
    b"<RequestId>1</RequestId></Error>"
)


class FlakyLink:
    """A TCP relay to the S3 server (loopback only) that can go bad. `mode`: "relay"; "reset" closes every
    connection, open or new, with a reset (a proxy before a dead store); "silent" accepts and never answers (a store
    that hangs); "forbid" answers every request 403 AccessDenied (credentials refused)."""

    def __init__(self, endpoint, delay=0.0):
        self.target = int(endpoint.rsplit(":", 1)[1])
        self.mode = "relay"
        self.delay = delay  # seconds before each chunk passes: a slow store
        self.open: list[socket.socket] = []
        self.server = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self.server.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def cut(self, down, mode="reset"):
        self.mode = mode if down else "relay"
        for conn in list(self.open) if down else []:
            self._reset(conn)

    @staticmethod
    def _reset(conn):
        try:
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\1\0\0\0\0\0\0\0")  # close sends RST
        except OSError:
            pass
        conn.close()

    def _accept(self):
        while True:
            conn, _ = self.server.accept()
            if self.mode == "reset":
                self._reset(conn)
            elif self.mode == "silent":
                self.open.append(conn)  # held open, never read nor answered
            elif self.mode == "forbid":
                threading.Thread(target=self._forbid, args=(conn,), daemon=True).start()
            else:
                upstream = socket.create_connection(("127.0.0.1", self.target))
                self.open += [conn, upstream]
                for a, b in ((conn, upstream), (upstream, conn)):
                    threading.Thread(target=self._relay, args=(a, b), daemon=True).start()

    def _forbid(self, conn):
        """Read one request (its body too, unless it waits for "100 Continue"), answer 403, close."""
        with conn:
            data = b""
            while b"\r\n\r\n" not in data and (chunk := conn.recv(1 << 16)):
                data += chunk
            head, _, body = data.partition(b"\r\n\r\n")
            headers = dict(
                line.split(":", 1) for line in head.decode("latin-1").lower().split("\r\n")[1:] if ":" in line
            )
            if "100-continue" not in headers.get("expect", ""):
                length = int(headers.get("content-length", "0"))
                while len(body) < length and (chunk := conn.recv(1 << 16)):
                    body += chunk
            reply = b"HTTP/1.1 403 Forbidden\r\nContent-Type: application/xml\r\nConnection: close\r\n"
            conn.sendall(reply + b"Content-Length: %d\r\n\r\n" % len(FORBIDDEN) + FORBIDDEN)

    def _relay(self, source, target):
        try:
            while data := source.recv(1 << 16):
                time.sleep(self.delay)
                target.sendall(data)
        except OSError:
            pass
        for end in (source, target):
            end.close()


def snapshots_through_a_link(s3_server, bucket, monkeypatch):
    """(a FlakyLink to the store, the snapshot URL on the store, prepared Snapshots there, reaching it through the
    link)."""
    link = FlakyLink(s3_server)
    monkeypatch.setenv("AWS_ENDPOINT_URL", link.endpoint)
    url = f"s3://{bucket}/run"
    snapshots = Snapshots(url, DistEnv(), keep=10)
    snapshots.prepare(estimated_bytes=1)
    return link, url, snapshots


@needs_s3
def test_a_store_briefly_unreachable_delays_the_snapshots_not_the_saves(s3_server, bucket, monkeypatch, caplog):
    """Uploads go on in the background and are retried: the saves return at once while the store is cut off, a
    WARNING says snapshots are late, and both are committed once it is back."""
    link, url, snapshots = snapshots_through_a_link(s3_server, bucket, monkeypatch)
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


@needs_s3
@pytest.mark.parametrize("mode, error", [("reset", "connect"), ("silent", "timeout"), ("forbid", "denied")])
def test_a_store_gone_for_good_stops_the_saves_in_one_error_within_store_timeout(
    s3_server, bucket, monkeypatch, caplog, capfd, mode, error
):
    """A store that resets every connection, never answers, or refuses the credentials after the first snapshot:
    the next save fails within STORE_TIMEOUT_S, naming the URL and the store's error, with no traceback of the
    client's own; closing does not hang either, and the committed snapshot stays loadable."""
    monkeypatch.setenv("STORE_TIMEOUT_S", "4")
    link, url, snapshots = snapshots_through_a_link(s3_server, bucket, monkeypatch)
    try:
        snapshots.save(10, {"model": {"w": torch.full((64,), 10.0)}, "step": 10}, {}, blocking=True)
        link.cut(True, mode)
        started = time.monotonic()
        snapshots.save(20, {"model": {"w": torch.full((64,), 20.0)}, "step": 20}, {})
        with pytest.raises(SnapshotError) as failed:
            snapshots.wait()
        assert time.monotonic() - started < 4 + 3, "longer than STORE_TIMEOUT_S"
    finally:
        started = time.monotonic()
        snapshots.close()
    assert time.monotonic() - started < 4, "closing waited for the store"
    message = str(failed.value)
    # the save's first call to the store names its object: the lock rank 0 renews before it uploads, or the step's
    named = f"{url}/{step_name(20)}" in message or f"{url}/job.lock" in message
    assert "\n" not in message and named and error in message.lower(), message
    logged = capfd.readouterr().err + "\n".join(record.getMessage() for record in caplog.records)
    assert "Task exception was never retrieved" not in logged and "Traceback" not in logged
    link.cut(False)
    assert load_latest(url)["step"] == 10


@needs_s3
def test_a_run_whose_store_goes_for_good_stops_in_one_line_and_keeps_its_snapshots(
    tmp_path, s3_server, bucket, monkeypatch, capfd
):
    """The store resets every connection once the first snapshot is committed: the run stops within
    STORE_TIMEOUT_S with exit code 2 and one ERROR line naming the URL (no traceback of the store's client), and
    the committed snapshot loads."""
    from {{ cookiecutter.project_slug }}.machinery.snapshot import store as store_module

    monkeypatch.setenv("STORE_TIMEOUT_S", "4")
    link = FlakyLink(s3_server)
    monkeypatch.setenv("AWS_ENDPOINT_URL", link.endpoint)
    commit = store_module.Store.commit

    def commit_then_lose_the_store(self, step, manifest):
        commit(self, step, manifest)
        link.cut(True, "reset")

    monkeypatch.setattr(store_module.Store, "commit", commit_then_lose_the_store)
    url = f"s3://{bucket}/run"
    args = QUICK + ["--max-steps", "40", "--snapshot-every", "10", "--eval-every", "0", "--snapshot-dir", url]
    started = time.monotonic()
    with pytest.raises(SystemExit) as stopped:
        train.main(args + outputs(tmp_path)[2:])
    assert stopped.value.code == 2 and time.monotonic() - started < 60
    err = capfd.readouterr().err
    errors = [line for line in err.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and url in errors[0], errors
    assert "Traceback" not in err and "Task exception" not in err, err[-3000:]
    link.cut(False)
    assert load_latest(url)["step"] == 10


HOLDER = """
import sys, time
sys.path.insert(0, {root!r})
from {{ cookiecutter.project_slug }}.machinery.distributed import DistEnv
from {{ cookiecutter.project_slug }}.machinery.snapshot import Snapshots
Snapshots({url!r}, DistEnv(), keep=2).prepare(estimated_bytes=1)
print("holding", flush=True)
time.sleep(600)
"""
