"""What a run writes outside its snapshot folder belongs to that run: the path flags, and who owns each file.

`check_paths` refuses, before anything is built, the path flags rank 0 cannot write (one line, exit code 2).
`ExportFolder` claims the export folder for one run (`run.json`): another run's files there move aside to
`<export-dir>.<its run id>` (and come back when that run starts again); while another live job holds the folder,
this run exports to `<export-dir>.<run id>`. The metrics file (tracking.MetricsFile) follows the same rules. A live
job holds its files with flock on an open descriptor, released however the process ends: a file that a live process
appends to is never moved or replaced under it.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from pathlib import Path
from typing import Any

from . import distributed, logs, report
from .distributed import DistEnv
from .parallel import DistributedModel
from .settings import RunError, flag
from .snapshot.format import URL, sha256_file

try:
    import fcntl
except ImportError:  # no flock here: files are claimed by run id only
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

RUN_ID = re.compile(r"^[A-Za-z0-9_.-]{1,128}\Z")  # what wandb accepts as a run id
OWNER_FILE = "run.json"  # in the export folder: {"run_id": ...} of the run whose files it holds
EXPORT_FILES = ("model.pt", "best.pt", "summary.json", "hf")  # what a run writes to its export folder
OWN_FILE_WAIT_S = 15.0  # how long a run waits for a file its own previous attempt holds (a process still exiting)

# (setting, what it names, whether '' turns it off)
PATH_SETTINGS = (
    ("snapshot_dir", "folder", False),
    ("export_dir", "folder", False),
    ("metrics_file", "file", True),
    ("log_file", "file", True),
)


def check_paths(cfg: Any, env: DistEnv) -> None:
    """Refuse, on every rank alike, the path settings rank 0 cannot use: one line naming each bad flag."""

    def check() -> None:
        found = [
            path_problem(name, getattr(cfg, name), kind, optional)
            for name, kind, optional in PATH_SETTINGS
            if hasattr(cfg, name)
        ]
        problems = [problem for problem in found if problem]
        if problems:
            raise RunError("; ".join(problems))

    distributed.decided_on_rank_0(env, check, RunError)


def path_problem(name: str, value: str, kind: str, optional: bool) -> str | None:
    """What keeps rank 0 from writing the folder or file `value` of setting `name`, in one phrase; None if nothing."""
    where = f"{flag(name)} {value!r}"
    if value == "":
        return None if optional else f"{where} is empty: name a {kind}"
    if URL.match(value):  # object storage, through fsspec (snapshot/store.py)
        if kind != "folder":
            return f"{where} is a URL: name a local {kind}"
        from .snapshot.store import url_problem

        problem = url_problem(value)
        return f"{where}: {problem}" if problem else None
    path = logs.rank_file(value, 0) if name == "log_file" else os.path.abspath(value)
    if kind == "folder" and os.path.exists(path) and not os.path.isdir(path):
        return f"{where} is a file, not a folder"
    if kind == "file" and os.path.isdir(path):
        return f"{where} is a folder, not a file"
    if os.path.exists(path) and not os.access(path, os.W_OK | (os.X_OK if kind == "folder" else 0)):
        return f"{where} cannot be written (permission denied)"
    above = os.path.dirname(path)
    while not os.path.lexists(above):  # the folders still to create: the nearest existing one must take them
        above = os.path.dirname(above)
    if not os.path.isdir(above):
        return f"{where} lies under {above}, which is a file, not a folder"
    if not os.path.exists(path) and not os.access(above, os.W_OK | os.X_OK):
        return f"{where} cannot be created: {above} cannot be written (permission denied)"
    return None


# -- holding a file ------------------------------------------------------------------------------------------------


def hold(path: str, wait: float = 0.0) -> int | None:
    """A descriptor of `path` (created if missing, opened to append) with an exclusive lock on the file, held as
    long as it stays open; None when another live process holds it for `wait` seconds. Where the filesystem has no
    locks, the descriptor holds none."""
    deadline = time.monotonic() + wait
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
        if fcntl is None:
            return fd
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.2)
            continue
        except OSError:
            return fd  # a filesystem without locks
        try:
            if os.path.samestat(os.fstat(fd), os.stat(path)):
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)  # the file was moved or replaced while this process waited: hold the one at the path now


def replace_held(fd: int, path: str, content: bytes) -> int:
    """Replace the file at `path`, which `fd` holds, by one with `content`, atomically; return the new file's held
    descriptor (the old one is closed). No other process can be appending to it: this one holds it."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as handle:
        handle.write(content)
        handle.flush()
        os.fsync(handle.fileno())
    new = hold(tmp)
    if new is None:  # nobody else knows this name
        raise RunError(f"cannot hold {tmp}: another process took it")
    os.replace(tmp, path)
    os.close(fd)
    return new


def read_held(fd: int) -> bytes:
    os.lseek(fd, 0, os.SEEK_SET)
    chunks = []
    while chunk := os.read(fd, 1 << 20):
        chunks.append(chunk)
    return b"".join(chunks)


def run_path(path: str, run_id: str, folder: bool = False) -> str:
    """The name of `path` that belongs to one run: logs/metrics.jsonl -> logs/metrics.<run_id>.jsonl for a file,
    export -> export.<run_id> for a folder."""
    path = os.path.abspath(path)
    if folder:
        return f"{path}.{run_id}"
    stem, suffix = os.path.splitext(path)
    return f"{stem}.{run_id}{suffix}"


def aside_path(path: str, owner: str | None, folder: bool = False) -> str:
    """A free name for the files of run `owner` at `path` when another run takes `path` (unknown owner: by time)."""
    label = owner or time.strftime("unknown-run-%Y%m%d-%H%M%S")
    candidate, number = run_path(path, label, folder), 1
    while os.path.lexists(candidate):
        number += 1
        candidate = run_path(path, f"{label}-{number}", folder)
    return candidate


# -- the export folder -----------------------------------------------------------------------------------------------


class ExportFolder:
    """Rank 0's claim on the export folder for one run (the other ranks only learn where it is)."""

    def __init__(self, env: DistEnv, directory: str, run_id: str):
        self.env, self.store = env, None
        if URL.match(directory):  # exported locally, then uploaded by publish()
            from .snapshot.store import Store

            self.store = Store(directory, env.rank)
            directory = f"{self.store.local}-export"
        self.directory = os.path.abspath(directory)
        self._fd: int | None = None
        try:
            self.directory = distributed.decided_on_rank_0(env, lambda: self._claim(run_id), OSError)
        except OSError as exc:
            self.close()
            raise RunError(f"cannot claim the export folder {self.directory}: {exc}") from None

    def _claim(self, run_id: str) -> str:
        """Rank 0's part: hold run.json, move another run's files aside; return the folder this run exports to."""
        own = run_path(self.directory, run_id, folder=True)
        os.makedirs(self.directory, exist_ok=True)
        wait = OWN_FILE_WAIT_S if _owner(self.directory, None) == run_id else 0  # this run's previous attempt, exiting
        fd = hold(os.path.join(self.directory, OWNER_FILE), wait)
        if fd is None:
            holder = _owner(self.directory, None) or "of unknown id"
            log.warning(
                "%s is in use by another running job (run %s): this run exports to %s", self.directory, holder, own
            )
            self.directory = own
            os.makedirs(own, exist_ok=True)
            fd = hold(os.path.join(own, OWNER_FILE), wait=OWN_FILE_WAIT_S)
            if fd is None:
                raise OSError(f"another process holds {os.path.join(own, OWNER_FILE)}")
        self._fd = fd
        owner = _owner(self.directory, fd)
        if owner != run_id:
            present = [name for name in EXPORT_FILES if os.path.lexists(os.path.join(self.directory, name))]
            if present:
                aside = aside_path(self.directory, owner, folder=True)
                _move(self.directory, aside, present, owner)
                log.info(
                    "%s held the files of run %s (%s): moved them aside to %s",
                    self.directory,
                    owner or "of unknown id",
                    ", ".join(present),
                    aside,
                )
            if self.directory != own and os.path.isdir(own):  # this run's files, set aside by another run
                back = [name for name in EXPORT_FILES if os.path.lexists(os.path.join(own, name))]
                _move(own, self.directory, back, None)
                Path(own, OWNER_FILE).unlink(missing_ok=True)
                if not os.listdir(own):
                    os.rmdir(own)
                if back:
                    log.info("this run's exported files are back in %s from %s", self.directory, own)
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"run_id": run_id}).encode())
        return self.directory

    def export(self, parallel: DistributedModel, name: str) -> None:
        """The model's weights as <name> in this folder (report.export), uploaded too when the folder is a store's."""
        report.export(parallel.model, parallel.sharded, self.env, self.directory, name)
        self.publish()

    def publish(self) -> None:
        """Rank 0, on a store: upload what the export folder holds (each file checked by reading it back)."""
        if self.store is None or self._fd is None:
            return
        root = Path(self.directory)
        for name in EXPORT_FILES:
            for local in [root / name, *(root / name).rglob("*")]:  # a file, or a folder's files (hf/)
                if local.is_file():
                    entry = {"size": local.stat().st_size, "sha256": sha256_file(str(local))}
                    self.store.upload(str(local), local.relative_to(root).as_posix(), entry)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _owner(directory: str, fd: int | None) -> str | None:
    """The run id the export folder's files belong to: its run.json, else its summary.json; None if neither says."""
    try:
        text = read_held(fd) if fd is not None else Path(directory, OWNER_FILE).read_bytes()
        found = json.loads(text).get("run_id")
    except (OSError, ValueError, AttributeError, RecursionError):
        found = None
    if found is None:
        try:
            found = json.loads(Path(directory, "summary.json").read_bytes()).get("run_id")
        except (OSError, ValueError, AttributeError, RecursionError):
            return None
    return found if isinstance(found, str) and RUN_ID.match(found) else None


def _move(source: str, target: str, names: list[str], owner: str | None) -> None:
    """Move the files `names` from folder `source` to folder `target` (created), with run.json naming `owner`."""
    os.makedirs(target, exist_ok=True)
    for name in names:
        os.replace(os.path.join(source, name), os.path.join(target, name))
    if owner is not None:
        with open(os.path.join(target, OWNER_FILE), "w", encoding="utf-8") as handle:
            json.dump({"run_id": owner}, handle)
