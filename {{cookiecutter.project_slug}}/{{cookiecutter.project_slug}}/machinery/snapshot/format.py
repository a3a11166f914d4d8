"""The snapshot format: file names, atomic checksummed writes, the manifest (the commit marker), checked reads.
Nothing here holds state: `Snapshots` (writer.py) writes with these functions, and `load_latest` reads with them."""

import hashlib
import json
import logging
import os
import re
import time
import warnings
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from ..settings import cut_short, first_line, short_repr

URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")  # s3://, gs://, file://, ...: a store, through fsspec (store.py)

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


def step_of_folder(name):
    """The step a folder name stands for, or None unless it is exactly step_name(step)."""
    match = STEP_DIR.match(name)
    return int(match.group(1)) if match and step_name(int(match.group(1))) == name else None


class _HashingWriter:
    """A file wrapper that checksums what is written through it."""

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
    fd = os.open(os.path.dirname(path), os.O_RDONLY)  # the rename itself is durable only once its folder is synced
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return {"size": writer.size, "sha256": writer.sha256.hexdigest()}


def write_json_atomic(path: str, obj) -> dict:
    return write_atomic(path, lambda f: f.write(json.dumps(obj, indent=1, sort_keys=True).encode()))


def stream_entry(handle) -> dict:
    """The receipt entry of what `handle` reads (a local file, an object on a store): its size and sha256."""
    digest, size = hashlib.sha256(), 0
    for block in iter(lambda: handle.read(1 << 22), b""):
        digest.update(block)
        size += len(block)
    return {"size": size, "sha256": digest.hexdigest()}


def file_entry(path: str) -> dict:
    with open(path, "rb") as handle:
        return stream_entry(handle)


def sha256_file(path):
    return file_entry(path)["sha256"]


def _read_json(path: str, what: str) -> Any:  # a receipt, a manifest
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except (OSError, ValueError, RecursionError) as exc:
        raise SnapshotError(f"{path}: unreadable {what} ({first_line(exc)})") from exc


def _is_count(value, low=0, high=None):
    """A JSON integer (not a bool, not a float) within [low, high]."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= low and (high is None or value <= high)


def manifest_digest(manifest: dict) -> str:
    """sha256 of the canonical JSON of every field of a manifest except the digest itself."""
    body = {key: value for key, value in manifest.items() if key != "manifest_sha256"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()


def manifest_problem(manifest, step):
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
        return f"files has no entry for {cut_short(absent, 1)}"
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
    if "frozen_in" in manifest and not _is_count(manifest["frozen_in"], 0, manifest["step"]):
        return f"frozen_in {short_repr(manifest['frozen_in'])} is not a step from 0 to the snapshot's own"
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


def read_receipt(folder: str, rank: int) -> dict:
    """Rank `rank`'s receipt in a step folder, checked to list exactly that rank's files (its rank file, rank 0's
    shared.pt, its shards under fsdp)."""
    path = os.path.join(folder, receipt_file(rank))
    receipt = _read_json(path, "receipt")
    expected = {rank_file(rank)} | ({SHARED} if rank == 0 else set())
    files = receipt.get("files") if isinstance(receipt, dict) else None
    if not isinstance(files, dict) or {name for name in files if shard_of(name) != rank} != expected:
        raise SnapshotError(f"{path} is not a receipt for rank {rank}'s files {sorted(expected)}")
    return receipt


def new_manifest(folder: str, step: int, world_size: int, files: dict, job: str, frozen_in: int | None = None) -> dict:
    """The manifest that commits a save (`frozen_in`: the step whose snapshot holds the frozen parameters, see
    frozen.py); SnapshotError rather than one a reader would reject."""
    manifest: dict[str, Any] = dict(
        format=FORMAT, step=step, world_size=world_size, files=files, created=time.time(), job=job
    )
    if frozen_in is not None:
        manifest["frozen_in"] = frozen_in
    manifest["manifest_sha256"] = manifest_digest(manifest)
    problem = manifest_problem(manifest, step)
    if problem:
        raise SnapshotError(f"{folder}: not committing a malformed manifest: {problem}")
    return manifest


def receipts_manifest(folder: str, step: int, where: str, fetch=lambda rank: None) -> dict:
    """The manifest that commits the save of `step` from the receipts in `folder` (rank 0's, there already, names
    the ranks, the job and `frozen_in`); fetch(rank) puts each other rank's there first. `where` names the save."""
    first = read_receipt(folder, 0)
    world_size, job = first.get("world_size"), first.get("job")
    if not isinstance(world_size, int) or not _is_count(world_size, 1, MAX_WORLD_SIZE) or not isinstance(job, str):
        raise SnapshotError(f"{os.path.join(folder, receipt_file(0))} names no world size and job")
    files = dict(first["files"])
    for rank in range(1, world_size):
        fetch(rank)
        files.update(read_receipt(folder, rank)["files"])
    return new_manifest(where, step, world_size, files, job, first.get("frozen_in"))


def read_manifest(step_path: str) -> dict:
    """The manifest of a step folder, checked whole; SnapshotError says what is wrong with it."""
    path = os.path.join(step_path, MANIFEST)
    manifest = _read_json(path, "manifest")
    problem = manifest_problem(manifest, step_of_folder(os.path.basename(os.path.normpath(step_path))))
    if problem:
        raise SnapshotError(f"{path}: malformed manifest: {problem}")
    return manifest


def _sharded_files(manifest: dict) -> list[str]:
    """The DCP files a manifest lists (none for a ddp snapshot)."""
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
    if sha256_file(path) != expected["sha256"]:
        raise SnapshotError(f"{path}: checksum mismatch, the file changed or was damaged after it was written")
    return path


def load_checked(step_path: str, manifest: dict, name: str) -> Any:
    """torch.load one file of a snapshot after checking its size and sha256 against the manifest."""
    path = check_file(step_path, manifest, name)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # the checksum matched, so this file was written by something else
        raise SnapshotError(f"{path}: cannot be loaded ({first_line(exc)})") from exc


def list_steps(directory: str) -> tuple[list[int], list[int]]:
    """(committed steps, newest first; step folders without a manifest)."""
    committed: list[int] = []
    incomplete: list[int] = []
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return [], []
    for name in names:
        step = step_of_folder(name)
        if step is None and STEP_DIR.match(name):
            would_be = step_name(int(name[len("step-") :]))
            log.debug("ignoring %s: not a snapshot folder name (%s would be)", os.path.join(directory, name), would_be)
        if step is not None and os.path.isdir(os.path.join(directory, name)):
            (committed if os.path.exists(os.path.join(directory, name, MANIFEST)) else incomplete).append(step)
    return sorted(committed, reverse=True), sorted(incomplete)


def _check_shards(step_path, manifest, shards):
    for index, name in enumerate(_sharded_files(manifest)):
        if index % shards[1] == shards[0]:
            check_file(step_path, manifest, name)


def _fill_frozen(state: dict, frozen: dict) -> None:
    """Give the snapshot's model the frozen parameters it left to an older snapshot; "frozen_filled" names them."""
    state["frozen_filled"] = [key for key in frozen if key not in state["model"]]
    state["model"] = {**{key: frozen[key] for key in state["frozen_filled"]}, **state["model"]}


def load_step(step_path, ranks, shards=(0, 1)):
    """The shared state of one snapshot, with `rank_states` for `ranks` (None: every rank); raises SnapshotError.

    A sharded snapshot's DCP files are checked, not loaded (the trainer loads them, on every rank together): those
    at index i of the sorted list with i % shards[1] == shards[0]. "sharded_dir" is their folder ("" for none).
    A snapshot whose manifest has "frozen_in" (frozen.py) is checked with that older one's files: its "model" gets
    the frozen parameters from there, or for a sharded one "frozen_dir" is that one's shards.
    """
    manifest = read_manifest(step_path)
    state = load_checked(step_path, manifest, SHARED)
    state["world_size"] = int(manifest["world_size"])
    ranks = range(state["world_size"]) if ranks is None else ranks
    state["rank_states"] = {rank: load_checked(step_path, manifest, rank_file(rank)) for rank in ranks}
    _check_shards(step_path, manifest, shards)
    state["sharded_dir"] = os.path.join(step_path, SHARDED_DIR) if _sharded_files(manifest) else ""
    state["frozen_in"] = manifest.get("frozen_in", manifest["step"])
    state["frozen_dir"], state["frozen_filled"] = "", []
    if state["frozen_in"] != manifest["step"]:
        holder = os.path.join(os.path.dirname(os.path.normpath(step_path)), step_name(state["frozen_in"]))
        try:
            held = read_manifest(holder)
            if state["sharded_dir"]:
                _check_shards(holder, held, shards)
                state["frozen_dir"] = os.path.join(holder, SHARDED_DIR)
            else:
                _fill_frozen(state, load_checked(holder, held, SHARED)["model"])
        except SnapshotError as exc:
            raise SnapshotError(
                f"{step_path}: its frozen parameters are in {step_name(state['frozen_in'])}, which is unusable: {exc}"
            ) from exc
    return state


def newest_usable(steps, load, where: str, agree=lambda ok: ok, advice: str = "") -> tuple[Any, list[int]]:
    """(load(step) of the newest of `steps` (newest first) that loads, the steps skipped before it), or (None, [])
    when there are none. An unusable one (SnapshotError) is skipped with a warning. Ranks that walk together pass
    `agree` (distributed.all_true): a step counts only when every rank loaded it. SnapshotError, with the reasons
    and `advice`, when none is usable."""
    reasons: list[str] = []
    skipped: list[int] = []
    for step in steps:
        state, reason = None, None
        try:
            state = load(step)
        except SnapshotError as exc:
            reason = str(exc)
        if agree(reason is None):
            return state, skipped
        if reason:
            log.warning("skipping snapshot %s: %s", os.path.join(where, step_name(step)), reason)
            reasons.append(reason)
        skipped.append(step)
    if skipped:
        why = "; ".join(reasons) or "every one is damaged on another rank (see its warnings)"
        raise SnapshotError(f"no usable snapshot in {where}: {why}{advice}")
    return None, []


def load_whole(step_path: str, rank: int | None = None) -> dict:
    """One snapshot as load_latest_in_folder gives it: every rank's files checked, an fsdp snapshot's shards joined."""
    state = load_step(step_path, None)
    if state["sharded_dir"]:
        for name in sharded_parts(state["sharded_dir"]):
            if name != "optimizer":  # its shards stay as they are: keyed by parameter, not a state_dict
                state[name] = read_sharded_model(state["sharded_dir"], name)
        if state["frozen_dir"]:
            _fill_frozen(state, read_sharded_model(state["frozen_dir"], "model"))
    if rank is not None:
        state["rank_state"] = state["rank_states"].get(rank)
    return state


def load_latest_in_folder(directory: str, rank: int | None = None) -> dict | None:
    """The newest snapshot in `directory` whose files all check out, or None when the folder holds none.

    Returns a dict with "model" (the unwrapped model's full state_dict, as plain CPU tensors: also for an fsdp
    snapshot, whose shards are read and joined here), "step" (optimizer steps done), the other parts (state.py:
    "optimizer", "scheduler", "scaler", "progress", ...; an fsdp snapshot's "optimizer" stays in its shards),
    "config", "run_id", "world_size", and `rank_state` for `rank` when given. Damaged snapshots are skipped with a
    warning; if every snapshot is damaged, SnapshotError says why.
    """
    load = lambda step: load_whole(os.path.join(directory, step_name(step)), rank)  # noqa: E731
    return newest_usable(list_steps(directory)[0], load, os.path.abspath(directory))[0]


def shard_of(name: str) -> int | None:
    """The rank that writes a file of a sharded snapshot (rank 0 writes DCP's .metadata), or None for another file."""
    match = SHARDED_FILE.match(name)
    return None if match is None else int(match.group(2) or 0)


def _read_metadata(folder: str):
    """(a torch.distributed.checkpoint reader of `folder`, its metadata); SnapshotError when it is unreadable."""
    try:
        reader = dcp.FileSystemReader(folder)
        return reader, reader.read_metadata()
    except Exception as exc:  # the checksums matched: written by something else
        raise SnapshotError(f"{folder}: unreadable metadata ({first_line(exc)})") from exc


def _entries(metadata, prefix: str):
    """(path, storage metadata) of each entry of part `prefix`; a path is ("model", fqn) or nested deeper."""
    paths = metadata.planner_data or {}  # flat key "model.<fqn>" -> its path ("model", fqn)
    for flat_key, item in metadata.state_dict_metadata.items():
        path = paths.get(flat_key) or tuple(flat_key.split(".", 1))
        if path[0] == prefix and len(path) >= 2:
            yield path, item


def sharded_parts(folder: str) -> list[str]:
    """The parts a DCP folder holds: "model", "optimizer" and model.py's extra ones."""
    metadata = _read_metadata(folder)[1]
    return sorted({key.split(".", 1)[0] for key in metadata.state_dict_metadata})


def sharded_keys(folder: str, prefix: str = "model") -> list[str]:
    """The keys of a part's state_dict (by default the model's) that a DCP folder holds."""
    return [path[1] for path, _ in _entries(_read_metadata(folder)[1], prefix) if len(path) == 2]


def read_sharded_model(folder: str, prefix: str = "model") -> dict[str, Any]:
    """The "model" entry (or another part's, `prefix`) of a torch.distributed.checkpoint folder as a plain
    state_dict of full-size CPU tensors, without a process group: empty tensors of each entry's global size and
    dtype (from the metadata) are made and DCP fills them from every rank's shards. The optimizer's entries are
    never read. Nested dicts come back nested (a list as a dict keyed by position)."""
    reader, metadata = _read_metadata(folder)
    state: dict[str, Any] = {}
    for path, item in _entries(metadata, prefix):
        holder = state
        for key in path[1:-1]:
            holder = holder.setdefault(key, {})
        if isinstance(item, TensorStorageMetadata):
            holder[path[-1]] = torch.empty(item.size, dtype=item.properties.dtype, device="cpu")
        elif isinstance(item, BytesStorageMetadata):
            holder[path[-1]] = None  # a pickled non-tensor (a module's _extra_state): load puts it in place
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # no process group: meant
        dcp.load({prefix: state}, storage_reader=reader, no_dist=True)
    return state
