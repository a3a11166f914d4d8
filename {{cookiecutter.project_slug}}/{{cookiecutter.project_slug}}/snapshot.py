"""Snapshots: everything needed to continue a run, written in the background, checked, committed once complete.

Layout of the snapshot folder (one job per folder; on several machines it must be a shared folder):

    run.json                   the run id (wandb), kept by every restart and re-launch of the job
    step-00000100/             one snapshot, taken after 100 optimizer steps
        shared.pt              model, optimizer, scheduler, scaler, data position, config (rank 0 writes it)
        rank-00000.pt          one rank's own state: its random number streams (each rank writes its own)
        rank-00000.json        that rank's receipt: size and sha256 of what it wrote
        manifest.json          the commit marker, written last by rank 0 once every receipt is in

Every file is written to a temporary name in the same folder, fsynced and renamed into place. A step
folder without manifest.json is an interrupted save: it is never loaded, and it is removed at the next
start. Loading checks each file's size and sha256 against the manifest, so a truncated, emptied or
bit-flipped snapshot is skipped with a warning and the next older one is used. All ranks agree on the
step they resume from.
"""

import copy
import hashlib
import json
import os
import random
import re
import secrets
import shutil
import threading
import time

import numpy as np
import torch

from . import distributed, logs

log = logs.get_logger(__name__)

FORMAT = 1
MANIFEST = "manifest.json"
SHARED = "shared.pt"
RUN_FILE = "run.json"
STEP_DIR = re.compile(r"^step-(\d{8,})$")
# How long a rank waits to see a file another machine just wrote to a shared folder: network filesystems cache
# directory listings and failed lookups for a while (NFS: up to 30 s by default). Set SHARED_FOLDER_WAIT_S in the
# environment for a filesystem that lags longer, or to fail faster where there is none.
SHARED_FOLDER_WAIT_S = float(os.environ.get("SHARED_FOLDER_WAIT_S", "30"))


class SnapshotError(RuntimeError):
    """A snapshot folder that cannot be written, or holds no usable snapshot."""


def step_name(step):
    return f"step-{step:08d}"


def rank_file(rank):
    return f"rank-{rank:05d}.pt"


def receipt_file(rank):
    return f"rank-{rank:05d}.json"


# ---------------------------------------------------------------------------------------------------------------
# Files: atomic writes with a checksum, and checked reads.

class _HashingWriter:
    """A file wrapper that hashes what passes through it, so a file is checksummed as it is written."""

    def __init__(self, raw):
        self.raw = raw
        self.sha256 = hashlib.sha256()
        self.size = 0

    def write(self, data):
        self.sha256.update(data)
        self.size += len(data)
        return self.raw.write(data)

    def flush(self):
        self.raw.flush()


def _fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path, write):
    """Write a file through `write(file)` so that `path` is either absent or complete; return its receipt."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as raw:
            writer = _HashingWriter(raw)
            write(writer)
            raw.flush()
            os.fsync(raw.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    _fsync_dir(os.path.dirname(path))
    return {"size": writer.size, "sha256": writer.sha256.hexdigest()}


def write_json_atomic(path, obj):
    return write_atomic(path, lambda f: f.write(json.dumps(obj, indent=1, sort_keys=True).encode()))


def _sha256_file(path):
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def read_manifest(step_path):
    path = os.path.join(step_path, MANIFEST)
    try:
        with open(path, encoding="utf-8") as handle:
            manifest = json.load(handle)
        manifest["files"].items()
        int(manifest["step"]), int(manifest["world_size"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise SnapshotError(f"{path}: unreadable manifest ({type(exc).__name__}: {exc})") from exc
    return manifest


def load_checked(step_path, manifest, name):
    """torch.load one file of a snapshot after checking its size and sha256 against the manifest."""
    path = os.path.join(step_path, name)
    expected = manifest["files"].get(name)
    if expected is None:
        raise SnapshotError(f"{path}: not listed in the manifest")
    try:
        size = os.path.getsize(path)
    except OSError as exc:
        raise SnapshotError(f"{path}: missing ({exc.strerror})") from exc
    if size != expected["size"]:
        what = "empty" if size == 0 else "truncated" if size < expected["size"] else "too long"
        raise SnapshotError(f"{path}: {what}, {size} bytes instead of {expected['size']}")
    if _sha256_file(path) != expected["sha256"]:
        raise SnapshotError(f"{path}: checksum mismatch, the file changed or was damaged after it was written")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # the checksum matched, so this file was written by something else
        raise SnapshotError(f"{path}: cannot be loaded ({type(exc).__name__}: {str(exc).splitlines()[0]})") from exc


def list_steps(directory):
    """(committed steps, newest first; step folders without a manifest)."""
    committed, incomplete = [], []
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return [], []
    for name in names:
        match = STEP_DIR.match(name)
        if not match or not os.path.isdir(os.path.join(directory, name)):
            continue
        step = int(match.group(1))
        (committed if os.path.exists(os.path.join(directory, name, MANIFEST)) else incomplete).append(step)
    return sorted(committed, reverse=True), sorted(incomplete)


def _load_step(step_path, ranks):
    """The shared state of one snapshot, with `rank_states` for the given ranks; raises SnapshotError."""
    manifest = read_manifest(step_path)
    state = load_checked(step_path, manifest, SHARED)
    state["rank_states"] = {rank: load_checked(step_path, manifest, rank_file(rank)) for rank in ranks}
    state["world_size"] = int(manifest["world_size"])
    return state


def load_latest(directory, rank=None):
    """The newest snapshot in `directory` whose files all check out, or None when the folder holds none.

    Returns a dict with "model" (the unwrapped model's state_dict), "step" (optimizer steps done), "optimizer",
    "scheduler", "scaler", "progress", "config", "run_id", "world_size", and `rank_state` for `rank` when given.
    Damaged snapshots are skipped with a warning; if every snapshot is damaged, SnapshotError says why.
    """
    reasons = []
    for step in list_steps(directory)[0]:
        step_path = os.path.join(directory, step_name(step))
        try:
            manifest = read_manifest(step_path)
            every_rank = range(int(manifest["world_size"]))
            state = _load_step(step_path, every_rank)
        except SnapshotError as exc:
            log.warning("skipping snapshot %s: %s", step_path, exc)
            reasons.append(str(exc))
            continue
        if rank is not None:
            state["rank_state"] = state["rank_states"].get(rank)
        return state
    if reasons:
        raise SnapshotError(f"no usable snapshot in {os.path.abspath(directory)}: " + "; ".join(reasons))
    return None


# ---------------------------------------------------------------------------------------------------------------
# Per-rank random streams.

def capture_rng():
    keys_kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": {"kind": keys_kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def restore_rng(state):
    random.setstate(state["python"])
    numpy_state = state["numpy"]
    np.random.set_state((numpy_state["kind"], numpy_state["keys"].numpy().astype(np.uint32), numpy_state["pos"],
                         numpy_state["has_gauss"], numpy_state["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _eventually(check, timeout=SHARED_FOLDER_WAIT_S, interval=0.2):
    """Poll check() every `interval` seconds until it is true (return True) or the timeout passes (False)."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)
    return True


def _copy_to_cpu(obj, staging, path=()):
    """A deep copy with every tensor copied to CPU memory: what the writer thread serializes.

    Tensors are copied into the buffers of the previous save (`staging`, keyed by their place in `obj`):
    for a large state, fresh memory costs several times more in page faults than the copy itself, and the
    training thread waits for this copy at its next fence(). The price: one copy of the state stays in memory.
    """
    if isinstance(obj, torch.Tensor):
        buffer = staging.get(path)
        reusable = buffer is not None and obj.layout == torch.strided
        if reusable and buffer.shape == obj.shape and buffer.dtype == obj.dtype:
            return buffer.copy_(obj.detach())
        staging[path] = obj.detach().to("cpu", copy=True)
        return staging[path]
    if isinstance(obj, dict):
        return {key: _copy_to_cpu(value, staging, path + (key,)) for key, value in obj.items()}
    if isinstance(obj, list):
        return [_copy_to_cpu(value, staging, path + (index,)) for index, value in enumerate(obj)]
    if isinstance(obj, tuple):
        return tuple(_copy_to_cpu(value, staging, path + (index,)) for index, value in enumerate(obj))
    return copy.deepcopy(obj)


# ---------------------------------------------------------------------------------------------------------------
# The snapshot folder of a running job.

class Snapshots:
    """Saves and finds snapshots for one job. Every rank holds one; collectives are called on every rank."""

    def __init__(self, directory, env, keep, commit_timeout=600.0):
        self.directory = os.path.abspath(directory)
        self.env = env
        self.keep = keep
        self.commit_timeout = commit_timeout  # seconds rank 0 waits for every rank's part before a save fails
        self._thread = None
        self._copied = threading.Event()
        self._copied.set()
        self._error = None
        self._staging = {}  # CPU buffers the writer copies tensors into, kept from one save to the next

    # -- start-up ------------------------------------------------------------------------------------------------

    def prepare(self, estimated_bytes):
        """Check the folder early (writable, room, shared by all ranks), clear interrupted saves, get the run id.

        Errors are decided on rank 0 and raised on every rank, so no rank is left waiting at a collective.
        """
        env = self.env
        problem, token = None, None
        if env.is_main:
            problem, token = self._check_folder(estimated_bytes)
        problem, token, main_directory = distributed.broadcast_object(env, (problem, token, self.directory))
        if problem:
            raise SnapshotError(problem)
        probe = os.path.join(self.directory, f".probe-{token}")
        visible = _eventually(lambda: os.path.exists(probe))
        seen = distributed.all_true(env, visible)
        distributed.barrier(env)
        if env.is_main:
            os.remove(probe)
        if not seen:
            raise SnapshotError(
                f"not every rank sees the snapshot folder {main_directory} that rank 0 writes to (rank {env.rank} "
                f"{'does' if visible else f'does not, looking in {self.directory}'}): on several machines, "
                "--snapshot-dir must be a folder they all share"
            )
        run_id = self._read_or_create_run_id() if env.is_main else None
        return distributed.broadcast_object(env, run_id)

    def _check_folder(self, estimated_bytes):
        token = secrets.token_hex(6)
        try:
            os.makedirs(self.directory, exist_ok=True)
            write_json_atomic(os.path.join(self.directory, f".probe-{token}"), {"token": token})
        except OSError as exc:
            return f"cannot write snapshots to {self.directory}: {exc.strerror or exc}", token
        free = shutil.disk_usage(self.directory).free
        if free < estimated_bytes:
            return (f"not enough room for a snapshot in {self.directory}: {free / 2**20:.0f} MiB free, one snapshot "
                    f"needs about {estimated_bytes / 2**20:.0f} MiB"), token
        if free < estimated_bytes * (self.keep + 1):
            log.warning("%s has room for fewer than %d snapshots (%.0f MiB free, about %.0f MiB each)",
                        self.directory, self.keep + 1, free / 2**20, estimated_bytes / 2**20)
        self._remove_interrupted_saves()
        return None, token

    def _remove_interrupted_saves(self):
        committed, incomplete = list_steps(self.directory)
        for step in incomplete:
            log.info("removing %s: an interrupted save", os.path.join(self.directory, step_name(step)))
            shutil.rmtree(os.path.join(self.directory, step_name(step)), ignore_errors=True)
        for step in committed:
            folder = os.path.join(self.directory, step_name(step))
            for name in os.listdir(folder):
                if ".tmp-" in name:
                    os.remove(os.path.join(folder, name))

    def _read_or_create_run_id(self):
        path = os.path.join(self.directory, RUN_FILE)
        try:
            with open(path, encoding="utf-8") as handle:
                return json.load(handle)["run_id"]
        except FileNotFoundError:
            run_id = secrets.token_hex(4)
            write_json_atomic(path, {"run_id": run_id})
            return run_id
        except (ValueError, KeyError) as exc:
            raise SnapshotError(f"{path} is damaged ({exc}); delete it to start a new run id") from exc

    def resume(self):
        """The newest snapshot good for every rank, loaded on every rank; None when the folder holds none.

        Each rank checks the files it needs (shared.pt and its own rank file). A snapshot counts only if every
        rank found its files good; otherwise all ranks move to the next older one together.
        """
        env = self.env
        committed = list_steps(self.directory)[0]

        def newest():
            return committed[0] if committed else -1

        def caught_up():
            committed[:] = list_steps(self.directory)[0]
            return newest() == high

        low, high = distributed.all_min_max(env, newest())
        if low != high:  # a lagging view of a shared folder may need a moment to show the newest snapshot
            _eventually(caught_up)
            low, high = distributed.all_min_max(env, newest())
        if low != high:
            raise SnapshotError(
                f"ranks disagree on the newest snapshot in {self.directory} (step {low} on some ranks, {high} on "
                "others): on several machines, --snapshot-dir must be one folder they all share"
            )
        skipped = []
        for step in committed:
            step_path = os.path.join(self.directory, step_name(step))
            state, reason = None, None
            try:
                manifest = read_manifest(step_path)
                same_world = int(manifest["world_size"]) == env.world_size
                state = _load_step(step_path, [env.rank] if same_world else [])
            except SnapshotError as exc:
                reason = str(exc)
            if distributed.all_true(env, reason is None):
                self._set_aside(skipped)
                state["rank_state"] = state["rank_states"].get(env.rank)
                return state
            if reason:
                log.warning("skipping snapshot %s: %s", step_path, reason)
            skipped.append(step)
        if committed:
            raise SnapshotError(
                f"no usable snapshot in {self.directory}: every one is damaged (see the warnings above). "
                "Move the folder away to start from scratch, or point --snapshot-dir elsewhere."
            )
        return None

    def _set_aside(self, steps):
        """Rename damaged snapshots, kept for a post-mortem, out of the way of the saves to come."""
        if self.env.is_main:
            stamp = time.strftime("%Y%m%d-%H%M%S")
            for step in steps:
                path = os.path.join(self.directory, step_name(step))
                os.replace(path, f"{path}.damaged-{stamp}")
                log.warning("moved the damaged snapshot %s aside to %s.damaged-%s", path, path, stamp)
        distributed.barrier(self.env)

    # -- saving --------------------------------------------------------------------------------------------------

    def save(self, step, shared, rank_state, blocking=False):
        """Start writing a snapshot of `step` in the background.

        `shared` (rank 0's model, optimizer, ...) may hold live tensors: they are copied off the training path
        by the writer thread, and the caller must call fence() before anything changes them in place (before
        optimizer.step()). Only one save is in flight: this waits for the previous one first.
        """
        self.wait()
        self._copied.clear()
        self._thread = threading.Thread(
            target=self._write, args=(step, shared if self.env.is_main else None, rank_state),
            name=f"snapshot-{step}", daemon=True,
        )
        self._thread.start()
        if blocking:
            self.wait()

    def fence(self):
        """Return once the save in flight has copied the state it was given."""
        self._copied.wait()
        self._raise_error()

    def wait(self):
        """Return once the save in flight is written (and, on rank 0, committed); raise if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._raise_error()

    def _raise_error(self):
        if self._error is not None:
            error, self._error = self._error, None
            raise SnapshotError(f"saving a snapshot failed: {error}") from error

    def _write(self, step, shared, rank_state):
        try:
            try:
                shared = _copy_to_cpu(shared, self._staging, ("shared",)) if shared is not None else None
                rank_state = _copy_to_cpu(rank_state, self._staging, ("rank",))
            finally:
                self._copied.set()
            folder = os.path.join(self.directory, step_name(step))
            os.makedirs(folder, exist_ok=True)
            files = {}
            if shared is not None:
                files[SHARED] = write_atomic(os.path.join(folder, SHARED), lambda f: torch.save(shared, f))
            rank = self.env.rank
            files[rank_file(rank)] = write_atomic(os.path.join(folder, rank_file(rank)), lambda f: torch.save(rank_state, f))
            write_json_atomic(os.path.join(folder, receipt_file(rank)), {"rank": rank, "files": files})
            if self.env.is_main:
                self._commit(folder, step)
        except BaseException as exc:  # handed to the training thread by wait() or fence()
            self._error = exc
            self._copied.set()

    def _commit(self, folder, step):
        """Write the manifest once every rank's receipt is in, then prune old snapshots."""
        files = {}
        deadline = time.monotonic() + self.commit_timeout
        for rank in range(self.env.world_size):
            path = os.path.join(folder, receipt_file(rank))
            if not _eventually(lambda: os.path.exists(path), deadline - time.monotonic(), interval=0.01):
                raise SnapshotError(
                    f"rank {rank}'s part of {folder} did not appear within {self.commit_timeout:.0f} s: is "
                    "--snapshot-dir a folder every machine shares?"
                )
            with open(path, encoding="utf-8") as handle:
                files.update(json.load(handle)["files"])
        manifest = {"format": FORMAT, "step": step, "world_size": self.env.world_size, "files": files,
                    "created": time.time()}
        write_json_atomic(os.path.join(folder, MANIFEST), manifest)
        log.debug("snapshot %s committed", folder)
        self._prune()

    def _prune(self):
        committed, _ = list_steps(self.directory)
        for step in committed[self.keep:]:
            folder = os.path.join(self.directory, step_name(step))
            os.remove(os.path.join(folder, MANIFEST))  # uncommit first: a half-removed folder is never loaded
            shutil.rmtree(folder, ignore_errors=True)
