"""Snapshots: everything needed to continue a run, written in the background, checked, committed once complete.

Layout of the snapshot folder (one job per folder; on several machines it must be a shared folder):

    job.lock                   held by rank 0 of the job training into the folder (see joblock.py)
    run.json                   the run id (wandb; see tracking.run_id), kept by every restart and re-launch
    step-00000100/             one snapshot, taken after 100 optimizer steps
        shared.pt              model, optimizer, scheduler, scaler, data position, config (rank 0 writes it)
        rank-00000.pt          one rank's own state: its random number streams (each rank writes its own)
        rank-00000.json        that rank's receipt: size and sha256 of what it wrote
        sharded/               --strategy fsdp only: model and optimizer, each rank's shards written by
                               torch.distributed.checkpoint (__<rank>_0.distcp; rank 0 adds .metadata)
        manifest.json          the commit marker, written last by rank 0 once every receipt is in

Every file is written to a temporary name in the same folder, fsynced and renamed into place. A step
folder without manifest.json is an interrupted save: it is never loaded, and it is removed at the next
start. The manifest carries a sha256 of its own contents and is checked field by field; loading then checks
each file's size and sha256 against it. A truncated, emptied or bit-flipped file, or a manifest that is
malformed or was edited, makes the snapshot skipped with a warning, and the next older one is used. All ranks
agree on the step they resume from. Only folders named exactly as step_name() names them are snapshots;
anything else in the folder is left alone.

A fresh start (`prepare(..., fresh_start=True)`, `--resume never`) moves what the folder holds aside into the
sibling folder `<folder>.set-aside-<date>-<time>`, unless the snapshots there were written by this same torchrun
job: then this is a restart of that job, and it resumes.
"""

import copy
import datetime
import errno
import functools
import hashlib
import json
import logging
import os
import random
import re
import secrets
import shutil
import threading
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

from . import distributed, joblock

log = logging.getLogger(__name__)

FORMAT = 2  # 2: the manifest checksums itself and names the job that wrote it
MANIFEST = "manifest.json"
SHARED = "shared.pt"
SHARDED_DIR = "sharded"
SHARDED_FILE = re.compile(r"^sharded/(__(\d+)_\d+\.distcp|\.metadata)$")  # what DCP's FileSystemWriter writes
RUN_FILE = "run.json"
STEP_DIR = re.compile(r"^step-(\d{8,})$")
SHA256 = re.compile(r"^[0-9a-f]{64}$")
MAX_WORLD_SIZE = 1_000_000
MANIFEST_KEYS = ("format", "step", "world_size", "files", "job", "manifest_sha256")
# How long a rank waits to see a file another machine just wrote to a shared folder: network filesystems cache
# directory listings and failed lookups for a while (NFS: up to 30 s by default). Set SHARED_FOLDER_WAIT_S in the
# environment for a filesystem that lags longer, or to fail faster where there is none.
SHARED_FOLDER_WAIT_S = float(os.environ.get("SHARED_FOLDER_WAIT_S", "30"))


class SnapshotError(RuntimeError):
    """A snapshot folder that cannot be written, or holds no usable snapshot."""


def step_name(step: int) -> str:
    return f"step-{step:08d}"


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


def receipt_file(rank: int) -> str:
    return f"rank-{rank:05d}.json"


def _step_of_folder(name):
    """The step a folder name stands for, or None unless it is exactly step_name(step)."""
    match = STEP_DIR.match(name)
    if not match or step_name(int(match.group(1))) != name:
        return None
    return int(match.group(1))


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


def write_atomic(path: str, write) -> dict:
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


def write_json_atomic(path: str, obj) -> dict:
    return write_atomic(path, lambda f: f.write(json.dumps(obj, indent=1, sort_keys=True).encode()))


def _sha256_file(path):
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def short_repr(value: object) -> str:
    """repr of a value read from a file, cut to 60 characters for a one-line message."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_count(value, low=0, high=None):
    """A JSON integer (not a bool, not a float) within [low, high]."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= low and (high is None or value <= high)


def manifest_digest(manifest: dict) -> str:
    """sha256 of the canonical JSON of every field of a manifest except the digest itself."""
    body = {key: value for key, value in manifest.items() if key != "manifest_sha256"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()


def _manifest_problem(manifest, step):
    """Why a manifest cannot be trusted (a short phrase), or None when its whole shape and checksum are right."""
    if not isinstance(manifest, dict):
        return f"not a JSON object but {type(manifest).__name__}"
    missing = [key for key in MANIFEST_KEYS if key not in manifest]
    if missing:
        return f"no {', '.join(missing)} field"
    if manifest["format"] != FORMAT or isinstance(manifest["format"], bool):
        return f"format {short_repr(manifest['format'])}, this version reads format {FORMAT}"
    if not _is_count(manifest["step"]):
        return f"step {short_repr(manifest['step'])} is not a whole number >= 0"
    if step is not None and manifest["step"] != step:
        return f"step {manifest['step']} does not match its folder {step_name(step)}"
    world_size = manifest["world_size"]
    if not _is_count(world_size, 1, MAX_WORLD_SIZE):
        return f"world_size {short_repr(world_size)} is not a whole number from 1 to {MAX_WORLD_SIZE}"
    if not isinstance(manifest["job"], str):
        return f"job {short_repr(manifest['job'])} is not a string"
    files = manifest["files"]
    if not isinstance(files, dict):
        return f"files is {short_repr(files)}, not a mapping of file names"
    expected = {SHARED, *(rank_file(rank) for rank in range(world_size))}
    absent = sorted(expected - files.keys())
    if absent:
        return f"files has no entry for {absent[0]}" + (f" (and {len(absent) - 1} more)" if len(absent) > 1 else "")
    extra = sorted(name for name in files.keys() - expected if not SHARDED_FILE.match(name))
    if extra:
        return f"files lists {short_repr(extra[0])}, which a snapshot of {world_size} rank(s) does not have"
    for name in sorted(files):
        entry = files[name]
        if not isinstance(entry, dict):
            return f"files[{name!r}] is {short_repr(entry)}, not an object with a size and a sha256"
        for key in ("size", "sha256"):
            if key not in entry:
                return f"files[{name!r}] has no {key!r}"
        if not _is_count(entry["size"]):
            return f"files[{name!r}] size {short_repr(entry['size'])} is not a whole number >= 0"
        if not isinstance(entry["sha256"], str) or not SHA256.match(entry["sha256"]):
            return f"files[{name!r}] sha256 {short_repr(entry['sha256'])} is not 64 hex digits"
    if _sharded_files(manifest) and f"{SHARDED_DIR}/.metadata" not in files:
        return f"files lists shards but no {SHARDED_DIR}/.metadata"
    digest = manifest["manifest_sha256"]
    if not isinstance(digest, str) or not SHA256.match(digest):
        return f"manifest_sha256 {short_repr(digest)} is not 64 hex digits"
    try:
        actual = manifest_digest(manifest)
    except (ValueError, TypeError):  # NaN or infinity in a field the shape checks leave open
        return "a field holds a number JSON cannot represent exactly"
    if actual != digest:
        return "manifest_sha256 does not match its contents: the manifest was edited or damaged after it was written"
    return None


def read_manifest(step_path: str) -> dict:
    """The manifest of a step folder, checked whole; SnapshotError says what is wrong with it."""
    path = os.path.join(step_path, MANIFEST)
    try:
        with open(path, encoding="utf-8") as handle:
            manifest = json.load(handle)
    except (OSError, ValueError, RecursionError) as exc:
        raise SnapshotError(f"{path}: unreadable manifest ({type(exc).__name__}: {exc})") from exc
    problem = _manifest_problem(manifest, _step_of_folder(os.path.basename(os.path.normpath(step_path))))
    if problem:
        raise SnapshotError(f"{path}: malformed manifest: {problem}")
    return manifest


def _sharded_files(manifest: dict) -> list[str]:
    """The names of the torch.distributed.checkpoint files a manifest lists (none for a ddp snapshot)."""
    return sorted(name for name in manifest["files"] if SHARDED_FILE.match(name))


def check_file(step_path: str, manifest: dict, name: str) -> str:
    """The path of one file of a snapshot, after checking its size and sha256 against the manifest."""
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
    return path


def load_checked(step_path: str, manifest: dict, name: str) -> Any:
    """torch.load one file of a snapshot after checking its size and sha256 against the manifest."""
    path = check_file(step_path, manifest, name)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # the checksum matched, so this file was written by something else
        raise SnapshotError(f"{path}: cannot be loaded ({type(exc).__name__}: {str(exc).splitlines()[0]})") from exc


def list_steps(directory: str) -> tuple[list[int], list[int]]:
    """(committed steps, newest first; step folders without a manifest)."""
    committed: list[int] = []
    incomplete: list[int] = []
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return [], []
    for name in names:
        step = _step_of_folder(name)
        if step is None:
            if STEP_DIR.match(name):
                log.debug(
                    "ignoring %s: not a snapshot folder name (%s would be)",
                    os.path.join(directory, name),
                    step_name(int(name[len("step-") :])),
                )
            continue
        if not os.path.isdir(os.path.join(directory, name)):
            continue
        (committed if os.path.exists(os.path.join(directory, name, MANIFEST)) else incomplete).append(step)
    return sorted(committed, reverse=True), sorted(incomplete)


def _load_step(step_path, ranks, shards=(0, 1)):
    """The shared state of one snapshot, with `rank_states` for the given ranks; raises SnapshotError.

    A sharded snapshot's torch.distributed.checkpoint files are checked, not loaded (the trainer loads them, on
    every rank together): those whose index i in the sorted list has i % shards[1] == shards[0]. "sharded_dir"
    is their folder, or "" for a snapshot without shards.
    """
    manifest = read_manifest(step_path)
    state = load_checked(step_path, manifest, SHARED)
    state["rank_states"] = {rank: load_checked(step_path, manifest, rank_file(rank)) for rank in ranks}
    state["world_size"] = int(manifest["world_size"])
    sharded = _sharded_files(manifest)
    for index, name in enumerate(sharded):
        if index % shards[1] == shards[0]:
            check_file(step_path, manifest, name)
    state["sharded_dir"] = os.path.join(step_path, SHARDED_DIR) if sharded else ""
    return state


def load_latest(directory: str, rank: int | None = None) -> dict | None:
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


def capture_rng() -> dict:
    keys_kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": {
            "kind": keys_kind,
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def restore_rng(state: dict) -> None:
    random.setstate(state["python"])
    numpy_state = state["numpy"]
    np.random.set_state(
        (
            numpy_state["kind"],
            numpy_state["keys"].numpy().astype(np.uint32),
            numpy_state["pos"],
            numpy_state["has_gauss"],
            numpy_state["cached_gaussian"],
        )
    )
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


def _map_state(obj: Any, fn, path: tuple = ()) -> Any:
    """A copy of a state's dicts, lists and tuples with every other value replaced by fn(place, value), where
    place is the tuple of keys and indices that leads to the value from `path`."""
    if isinstance(obj, dict):
        return {key: _map_state(value, fn, path + (key,)) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        items = [_map_state(value, fn, path + (index,)) for index, value in enumerate(obj)]
        return items if isinstance(obj, list) else tuple(items)
    return fn(path, obj)


def _copy_to_cpu(obj, staging, path=(), staged=None):
    """A deep copy with every tensor copied to CPU memory: what the writer thread serializes.

    Tensors are copied into the buffers of the previous save (`staging`, keyed by their place in `obj`):
    for a large state, fresh memory costs several times more in page faults than the copy itself, and the
    training thread waits for this copy at its next fence(). The price: one copy of the state stays in memory.
    A tensor whose place is in `staged` (CUDA tensors, see _DeviceCopies) is already on its way to the pinned
    buffer named there.
    """

    def copy_one(place, value):
        if not isinstance(value, torch.Tensor):
            return copy.deepcopy(value)
        if staged and place in staged:
            return staged[place]
        buffer = staging.get(place)
        reusable = buffer is not None and value.layout == torch.strided
        if reusable and buffer.shape == value.shape and buffer.dtype == value.dtype:
            return buffer.copy_(value.detach())
        staging[place] = value.detach().to("cpu", copy=True)
        return staging[place]

    return _map_state(obj, copy_one, path)


class _DeviceCopies:
    """The copies of one save's CUDA tensors into pinned CPU buffers, on a side stream of each device.

    save() starts them on the training thread: it only enqueues work, so the training thread never waits for
    the device. The side stream first waits for the training stream, so each copy sees every change enqueued
    before save(); the training stream waits for the copies' events, on the device, at wait_until_copied(),
    before the optimizer changes the tensors in place; the writer thread waits for the same events on the host
    before it serializes. The pinned buffers are kept from one save to the next, like the CPU staging buffers:
    allocating pinned memory is slow, and only a copy into pinned memory leaves the host free.
    """

    def __init__(self, pinned: dict, streams: dict):
        self.pinned = pinned  # place in the state -> pinned CPU buffer, kept by Snapshots
        self.streams = streams  # device -> its side stream, kept by Snapshots
        self.staged: dict[tuple, torch.Tensor] = {}  # place -> the pinned buffer this save copies that tensor into
        self.events: list[
            tuple[torch.device, torch.cuda.Event]
        ] = []  # (device, event recorded on its side stream after this save's copies)

    def start(self, states: dict) -> None:
        """Enqueue a copy of every strided CUDA tensor in `states` ({place prefix: state}), one stream per device."""
        by_device: dict[torch.device, list[tuple[tuple, torch.Tensor]]] = {}
        for prefix, state in states.items():
            for path, tensor in _cuda_tensors(state, prefix):
                by_device.setdefault(tensor.device, []).append((path, tensor))
        for device, tensors in by_device.items():
            stream = self.streams.get(device)
            if stream is None:
                stream = self.streams[device] = torch.cuda.Stream(device=device)
            stream.wait_stream(torch.cuda.current_stream(device))  # see every change enqueued before save()
            with torch.cuda.stream(stream):
                for path, tensor in tensors:
                    buffer = self.pinned.get(path)
                    if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
                        buffer = self.pinned[path] = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
                    buffer.copy_(tensor, non_blocking=True)
                    # The copy reads `tensor` on the side stream: its memory must not go back to the training
                    # stream's pool before the copy is done, even if the caller drops the tensor at once.
                    tensor.record_stream(stream)
                    self.staged[path] = buffer
            event = torch.cuda.Event(blocking=True)  # the writer thread sleeps while it waits, leaving the core free
            event.record(stream)
            self.events.append((device, event))

    def order_training_stream(self) -> None:
        """Make the training stream wait, on the device, until the copies are done; the host does not wait."""
        for device, event in self.events:
            torch.cuda.current_stream(device).wait_event(event)

    def wait(self) -> None:
        """Block this (the writer) thread until every copy has landed in its pinned buffer."""
        for _, event in self.events:
            event.synchronize()


def _shard_of(name: str) -> int | None:
    """The rank that writes a file of a sharded snapshot (rank 0 writes DCP's .metadata), or None for another file."""
    match = SHARDED_FILE.match(name)
    if match is None:
        return None
    return int(match.group(2)) if match.group(2) is not None else 0


def _split_dtensors(obj: Any) -> tuple[Any, dict[tuple, tuple]]:
    """(obj with each DTensor replaced by this rank's local shard, {place: how to put the DTensor back}).

    The copies off the training thread (and onto pinned memory) then treat shards as the plain tensors they are.
    """
    layouts: dict[tuple, tuple] = {}

    def local(place, value):
        if not isinstance(value, DTensor):
            return value
        layouts[place] = (value.device_mesh, value.placements, value.shape, value.stride())
        return value.to_local()

    return _map_state(obj, local), layouts


def _join_dtensors(obj: Any, layouts: dict[tuple, tuple]) -> Any:
    """The inverse of _split_dtensors, around the (copied) local shards."""

    def wrap(place, value):
        if place not in layouts:
            return value
        mesh, placements, shape, stride = layouts[place]
        return DTensor.from_local(value, mesh, placements, run_check=False, shape=shape, stride=stride)

    return _map_state(obj, wrap)


def _cuda_tensors(obj, path):
    """(place, tensor) of every strided CUDA tensor in obj, walking dicts, lists and tuples as _map_state does."""
    if isinstance(obj, torch.Tensor):
        if obj.is_cuda and obj.layout == torch.strided:
            yield path, obj.detach()
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from _cuda_tensors(value, path + (key,))
    elif isinstance(obj, (list, tuple)):
        for index, value in enumerate(obj):
            yield from _cuda_tensors(value, path + (index,))


# ---------------------------------------------------------------------------------------------------------------
# The snapshot folder of a running job.


def _errno_in_chain(error):
    """The first errno among an exception and those it was raised from or during (torch.save wraps the
    OSError of a failed write in a RuntimeError such as "[enforce fail at inline_container.cc] unexpected pos")."""
    pending, seen = [error], set()
    while pending:
        exc = pending.pop(0)
        if exc is None or id(exc) in seen:
            continue
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno:
            return exc.errno
        pending += [exc.__cause__, exc.__context__]
    return None


class Snapshots:
    """Saves and finds snapshots for one job. Every rank holds one; collectives are called on every rank.

    Why not torch.distributed.checkpoint (DCP): under DDP every rank holds the whole model, so one file written by
    rank 0 plus a small file per rank (its random streams) is all a snapshot needs, and DCP's sharded planning
    adds nothing. What this class adds on top of torch.save is what DCP does not give: a commit marker written
    after every rank's part, a checksum per file with fallback to the previous snapshot, copies taken off the
    training thread, pruning, and one job per folder. Under --strategy fsdp (`sharded`) each rank's shards of the
    model and optimizer are written with DCP, from the writer thread on a gloo group of its own, and come under
    the same receipts, checksums and commit marker; DCP reshards them when the number of ranks changes.

    Rank 0 holds the folder's job lock from prepare() to close(): call close() when training ends, also after a
    failure (in a `finally`).
    """

    def __init__(
        self,
        directory: str,
        env: distributed.DistEnv,
        keep: int,
        commit_timeout: float = 600.0,
        sharded: bool = False,
    ):
        self.directory = os.path.abspath(directory)
        # DCP's collectives run on the writer thread while training runs its own: they need a group of their own.
        self._group = (
            dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=commit_timeout))
            if sharded and env.is_distributed
            else None
        )
        self.sharded = sharded
        self.env = env
        self.keep = keep
        self.commit_timeout = commit_timeout  # seconds rank 0 waits for every rank's part before a save fails
        self.job = joblock.current_job()  # recorded in every manifest: a restart of this job resumes them
        self._lock = None  # rank 0's JobLock, from prepare() to close()
        self._closed = False
        self._thread: threading.Thread | None = None
        self._copied = threading.Event()
        self._copied.set()
        self._error = None
        self._staging: dict[
            Any, torch.Tensor
        ] = {}  # CPU buffers the writer copies tensors into, kept from one save to the next
        self._pinned: dict[
            tuple, torch.Tensor
        ] = {}  # pinned CPU buffers the CUDA tensors are copied into, kept likewise
        self._copy_streams: dict[
            torch.device, torch.cuda.Stream
        ] = {}  # a side stream per CUDA device, for those copies
        self._device_copies: _DeviceCopies | None = (
            None  # the CUDA copies of the save in flight, until the training stream waits for them
        )

    # -- start-up ------------------------------------------------------------------------------------------------

    def prepare(self, estimated_bytes: int, fresh_start: bool = False) -> None:
        """Take the folder for this job and check it early.

        Rank 0 takes the job lock (another live job's folder is refused), moves old contents aside when
        `fresh_start` asks for it (see the module docstring), checks the folder is writable, has room and is
        seen by every rank, and clears what interrupted saves and start-ups left. (The run id kept in the folder
        is tracking's: tracking.run_id.)
        Errors are decided on rank 0 and raised on every rank, so no rank is left waiting at a collective.
        """
        try:
            self._prepare(estimated_bytes, fresh_start)
        except BaseException:
            self.close()
            raise

    def _prepare(self, estimated_bytes, fresh_start):
        env = self.env
        problem, token = None, None
        if env.is_main:
            problem, token = self._check_folder(estimated_bytes, fresh_start)
        problem, token, main_directory = distributed.broadcast_object(env, (problem, token, self.directory))
        if problem:
            raise SnapshotError(problem)
        probe = os.path.join(self.directory, f".probe-{token}")
        visible = _eventually(lambda: os.path.exists(probe))
        views = [(env.rank, visible, self.directory)]
        if env.is_distributed:  # every rank learns who does not see the folder, so each says the same
            views = [None] * env.world_size
            dist.all_gather_object(views, (env.rank, visible, self.directory))  # CPU (gloo) also under nccl
        blind = [f"rank {rank} does not, looking in {directory}" for rank, seen, directory in views if not seen]
        distributed.barrier(env)
        if env.is_main:
            os.remove(probe)
        if blind:
            more = f"; and {len(blind) - 3} more ranks" if len(blind) > 3 else ""
            raise SnapshotError(
                f"not every rank sees the snapshot folder {main_directory} that rank 0 writes to "
                f"({'; '.join(blind[:3])}{more}): on several machines, --snapshot-dir must be a folder they all share"
            )

    def _check_folder(self, estimated_bytes, fresh_start):
        """Rank 0's part of prepare(): (a problem in one line or None, the token of the probe file)."""
        token = secrets.token_hex(6)
        try:
            os.makedirs(self.directory, exist_ok=True)
            self._lock = joblock.JobLock(self.directory)
            self._lock.acquire()
            if fresh_start:
                problem = self._start_fresh()
                if problem:
                    return problem, token
            self._remove_leftovers()
            write_json_atomic(os.path.join(self.directory, f".probe-{token}"), {"token": token})
            free = shutil.disk_usage(self.directory).free
            if free < estimated_bytes:
                return (
                    f"not enough room for a snapshot in {self.directory}: {free / 2**20:.0f} MiB free, one "
                    f"snapshot needs about {estimated_bytes / 2**20:.0f} MiB"
                ), token
            if free < estimated_bytes * (self.keep + 1):
                log.warning(
                    "%s has room for fewer than %d snapshots (%.0f MiB free, about %.0f MiB each)",
                    self.directory,
                    self.keep + 1,
                    free / 2**20,
                    estimated_bytes / 2**20,
                )
            self._remove_interrupted_saves()
        except joblock.JobLockError as exc:
            return str(exc), token
        except OSError as exc:
            return f"cannot write snapshots to {self.directory}: {exc.strerror or exc}", token
        self._lock.start_heartbeat()
        return None, token

    def _start_fresh(self):
        """Move the folder's snapshots aside for a fresh start, unless this job wrote them; a problem or None."""
        committed = list_steps(self.directory)[0]
        if not committed:
            return None
        if self.job and self._newest_job(committed) == self.job:
            log.info(
                "%s holds snapshots of this same torchrun job (%s): this is a restart, resuming from them",
                self.directory,
                self.job,
            )
            return None
        aside = f"{self.directory}.set-aside-{time.strftime('%Y%m%d-%H%M%S')}"
        candidate, suffix = aside, 1
        while os.path.lexists(candidate):
            suffix += 1
            candidate = f"{aside}-{suffix}"
        try:
            os.rename(self.directory, candidate)
        except OSError as exc:
            return (
                f"cannot start afresh: moving {self.directory} aside to {candidate} failed "
                f"({exc.strerror or exc}); move or delete what it holds yourself, or resume from it with "
                "--resume auto"
            )
        os.makedirs(self.directory, exist_ok=True)
        self._lock.acquire()  # in the new, empty folder; the old lock file moved aside with the rest
        try:
            os.remove(os.path.join(candidate, joblock.LOCK_FILE))
        except FileNotFoundError:
            pass  # nothing to tidy
        log.warning(
            "starting afresh: moved what %s held (snapshots up to step %d) aside to %s",
            self.directory,
            committed[0],
            candidate,
        )
        return None

    def _newest_job(self, committed):
        """The job that wrote the newest snapshot whose manifest checks out, or None."""
        for step in committed:
            try:
                return read_manifest(os.path.join(self.directory, step_name(step)))["job"]
            except SnapshotError:
                continue
        return None

    def _remove_leftovers(self):
        """Probe files and run-id temp files of start-ups that died half-way (no other job is here: we hold
        the lock)."""
        for name in os.listdir(self.directory):
            if name.startswith(".probe-") or name.startswith(f"{RUN_FILE}.tmp-"):
                path = os.path.join(self.directory, name)
                if os.path.isfile(path):
                    log.debug("removing %s, left by an earlier start-up", path)
                    os.remove(path)

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

    def resume(self) -> dict | None:
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
        skipped: list[int] = []
        for step in committed:
            step_path = os.path.join(self.directory, step_name(step))
            state: dict[str, Any] = {}
            reason: str | None = None
            try:
                manifest = read_manifest(step_path)
                same_world = manifest["world_size"] == env.world_size
                # Each rank checks its share of a sharded snapshot's files; together they check all of them.
                state = _load_step(step_path, [env.rank] if same_world else [], (env.rank, env.world_size))
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

    def save(
        self,
        step: int,
        shared: dict | None,
        rank_state: dict,
        blocking: bool = False,
        sharded_state: dict | None = None,
    ) -> None:
        """Start writing a snapshot of `step` in the background.

        `shared` (rank 0's model, optimizer, ...) may hold live tensors: they are copied off the training path
        by the writer thread, and the caller must call wait_until_copied() before anything changes them in place
        (before optimizer.step()). Only one save is in flight: this waits for the previous one first.
        CUDA tensors are copied into pinned memory on a side stream, started here without waiting for the
        device (see _DeviceCopies); the first save allocates those buffers.
        """
        self.wait()
        shared = shared if self.env.is_main else None
        device_copies = _DeviceCopies(self._pinned, self._copy_streams)
        shards, layouts = _split_dtensors(sharded_state) if sharded_state is not None else (None, {})
        if torch.cuda.is_initialized():  # no CUDA tensor can exist before CUDA is initialized
            device_copies.start({("shared",): shared, ("rank",): rank_state, ("sharded",): shards})
        self._device_copies = device_copies
        self._copied.clear()
        self._thread = threading.Thread(
            target=self._write,
            args=(step, shared, rank_state, device_copies, shards, layouts),
            name=f"snapshot-{step}",
            daemon=True,
        )
        self._thread.start()
        if blocking:
            self.wait()

    def wait_until_copied(self) -> None:
        """Return once the save in flight has copied the state; call it before the optimizer changes the weights.

        For CUDA tensors, "copied" means ordered on the device: work the caller enqueues from here on runs after
        the copies, and the host does not wait for them.
        """
        self._copied.wait()
        if self._device_copies is not None:
            self._device_copies.order_training_stream()
            self._device_copies = None
        self._raise_error()

    def fence(self) -> None:
        """The same as wait_until_copied()."""
        self.wait_until_copied()

    def wait(self) -> None:
        """Return once the save in flight is written (and, on rank 0, committed); raise if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._device_copies = None  # the writer waited for them (or failed before they mattered)
        self._raise_error()

    def close(self) -> None:
        """Give the folder up: rank 0 releases the job lock. Call wait() first to finish a save in flight: close()
        does not wait for it (after a failure it might never finish), and it is not committed after close()."""
        self._closed = True
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def _raise_error(self):
        if self._error is not None:
            error, self._error = self._error, None
            code = _errno_in_chain(error)
            if code == errno.ENOSPC:
                reason = (
                    f"no space left on {self.directory}; free some space there or keep fewer snapshots "
                    "(--keep-snapshots)"
                )
            elif code == errno.EDQUOT:
                reason = f"disk quota exceeded on {self.directory}; free some space there or raise the quota"
            else:
                reason = str(error)
            raise SnapshotError(f"saving a snapshot failed: {reason}") from error

    def _write(self, step, shared, rank_state, device_copies, shards=None, layouts=None):
        try:
            try:
                staged = device_copies.staged
                shared = _copy_to_cpu(shared, self._staging, ("shared",), staged) if shared is not None else None
                rank_state = _copy_to_cpu(rank_state, self._staging, ("rank",), staged)
                shards = _copy_to_cpu(shards, self._staging, ("sharded",), staged) if shards is not None else None
            finally:
                self._copied.set()
            device_copies.wait()
            folder = os.path.join(self.directory, step_name(step))
            os.makedirs(folder, exist_ok=True)
            files = {}
            if shared is not None:
                files[SHARED] = write_atomic(os.path.join(folder, SHARED), lambda f: torch.save(shared, f))
            rank = self.env.rank
            files[rank_file(rank)] = write_atomic(
                os.path.join(folder, rank_file(rank)), lambda f: torch.save(rank_state, f)
            )
            if shards is not None:
                files.update(self._write_shards(folder, _join_dtensors(shards, layouts)))
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
            if not _eventually(functools.partial(os.path.exists, path), deadline - time.monotonic(), interval=0.01):
                raise SnapshotError(
                    f"rank {rank}'s part of {folder} did not appear within {self.commit_timeout:.0f} s: is "
                    "--snapshot-dir a folder every machine shares?"
                )
            with open(path, encoding="utf-8") as handle:
                receipt = json.load(handle)
            expected = {rank_file(rank)} | ({SHARED} if rank == 0 else set())
            if self.sharded and isinstance(receipt, dict) and isinstance(receipt.get("files"), dict):
                expected |= {name for name in receipt["files"] if _shard_of(name) == rank}
            if (
                not isinstance(receipt, dict)
                or not isinstance(receipt.get("files"), dict)
                or set(receipt["files"]) != expected
            ):
                raise SnapshotError(f"{path} is not a receipt for rank {rank}'s files {sorted(expected)}")
            files.update(receipt["files"])
        manifest = {
            "format": FORMAT,
            "step": step,
            "world_size": self.env.world_size,
            "files": files,
            "created": time.time(),
            "job": self.job,
        }
        manifest["manifest_sha256"] = manifest_digest(manifest)
        problem = _manifest_problem(manifest, step)
        if problem:  # never commit what a reader would reject
            raise SnapshotError(f"{folder}: not committing a malformed manifest: {problem}")
        if self._closed:
            raise SnapshotError(f"not committing {folder}: the snapshot folder was closed while it was written")
        if self._lock is not None and self._lock.lost:
            raise SnapshotError(f"not committing {folder}: {self._lock.lost}")
        write_json_atomic(os.path.join(folder, MANIFEST), manifest)
        log.debug("snapshot %s committed", folder)
        self._prune()

    def _write_shards(self, folder, state):
        """DCP writes this rank's shards (rank 0 also the metadata, once every rank's are written); return their
        receipts. DCP's collectives run on this writer thread, on the snapshot group only."""
        sharded = os.path.join(folder, SHARDED_DIR)
        dcp.save(state, storage_writer=dcp.FileSystemWriter(sharded, sync_files=True), process_group=self._group)
        receipts = {}
        for name in sorted(os.listdir(sharded)):
            if _shard_of(f"{SHARDED_DIR}/{name}") == self.env.rank:
                path = os.path.join(sharded, name)
                receipts[f"{SHARDED_DIR}/{name}"] = {"size": os.path.getsize(path), "sha256": _sha256_file(path)}
        if self.env.is_main and f"{SHARDED_DIR}/.metadata" not in receipts:
            raise SnapshotError(f"{sharded}: torch.distributed.checkpoint wrote no .metadata")
        return receipts

    def _prune(self):
        committed, _ = list_steps(self.directory)
        for step in committed[self.keep :]:
            folder = os.path.join(self.directory, step_name(step))
            os.remove(os.path.join(folder, MANIFEST))  # uncommit first: a half-removed folder is never loaded
            shutil.rmtree(folder, ignore_errors=True)
