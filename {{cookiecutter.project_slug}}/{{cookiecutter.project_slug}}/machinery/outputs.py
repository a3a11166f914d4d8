"""What a run writes outside its snapshot folder belongs to that run: the path flags, and who owns each file.

`check_paths` refuses, before anything is built, the path flags rank 0 cannot write (one line, exit code 2).
`Claim` holds the export folder (`ExportFolder`) or the metrics file (tracking.MetricsFile) for one run; another
run's files there move aside to `<export-dir>.<its run id>`, and come back when that run starts again (on a store
too: ExportFolder._claim_store). A live job holds its files with flock, released however the process ends: files a
live process writes never move under it.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

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


# -- holding a path for one run ------------------------------------------------------------------------------------


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
    write_synced(tmp, content)
    new = hold(tmp)
    if new is None:  # nobody else knows this name
        raise RunError(f"cannot hold {tmp}: another process took it")
    os.replace(tmp, path)
    os.close(fd)
    return new


def write_synced(path: str, content: bytes) -> None:
    with open(path, "wb") as handle:
        handle.write(content)
        handle.flush()
        os.fsync(handle.fileno())


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


class Claim:
    """A path one run writes (`path`), claimed for run `run_id` by `claim`, a file or a folder (through its run.json):
    1. hold it, waiting OWN_FILE_WAIT_S only when its owner is this run's previous attempt (a process still exiting);
    2. while another live job holds it: warn, and claim this run's own name (run_path) instead;
    3. move another run's records there aside, to a name with that run's id (aside_path);
    4. take back this run's own, set aside earlier at run_path; 5. mark it as this run's.
    A subclass says whose records the path holds and how they move:"""

    owner: Callable[[int | None], str | None]  # their run id (read through the held fd, else unheld); None: unknown
    set_aside: Callable[[int, str, str | None], bool]  # move them to `aside` (False: none there), the path kept held
    take_back: Callable[[int, str], int]  # from this run's own name; returns the descriptor that holds the path now
    folder = False
    what = "records"  # what the path holds, in messages

    def claim(self, path: str, run_id: str) -> int:
        """Claim `path` for run `run_id`: return the descriptor that holds it; `self.path` is where this run writes."""
        self.path, self.run_id, what = os.path.abspath(path), run_id, self.what
        own = run_path(self.path, run_id, self.folder)
        fd = self._hold(self.path, OWN_FILE_WAIT_S if self.owner(None) == run_id else 0)
        if fd is None:
            holder = self.owner(None) or "of unknown id"
            log.warning(
                "%s is held by another job (run %s): this run writes its %s to %s", self.path, holder, what, own
            )
            self.path = own
            fd = self._hold(own, OWN_FILE_WAIT_S)
            if fd is None:
                raise RunError(f"another process holds {own}, this run's {what}: is this run running twice?")
        try:
            owner = self.owner(fd)
            if owner != run_id:
                aside = aside_path(self.path, owner, self.folder)
                if self.set_aside(fd, aside, owner):
                    log.info(
                        "the %s of run %s in %s moved aside to %s", what, owner or "of unknown id", self.path, aside
                    )
                set_aside_earlier = os.path.isdir(own) if self.folder else os.path.isfile(own)
                if self.path != own and set_aside_earlier:
                    fd = self.take_back(fd, own)
                    log.info("this run's %s are back in %s from %s", what, self.path, own)
            if self.folder:
                os.ftruncate(fd, 0)
                os.write(fd, json.dumps({"run_id": run_id}).encode())
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _hold(self, path: str, wait: float) -> int | None:
        os.makedirs(path if self.folder else os.path.dirname(path), exist_ok=True)
        return hold(os.path.join(path, OWNER_FILE) if self.folder else path, wait)


def _move(source: str, target: str, owner: str | None) -> bool:
    """Move what a run exported from folder `source` to folder `target`, with run.json naming `owner`; False if
    `source` held none of it."""
    names = [name for name in EXPORT_FILES if os.path.lexists(os.path.join(source, name))]
    if names:
        os.makedirs(target, exist_ok=True)
        for name in names:
            os.replace(os.path.join(source, name), os.path.join(target, name))
        if owner is not None:
            with open(os.path.join(target, OWNER_FILE), "w", encoding="utf-8") as handle:
                json.dump({"run_id": owner}, handle)
    return bool(names)


class ExportFolder(Claim):
    """Rank 0's claim on the export folder for one run (the other ranks only learn where it is: `path`)."""

    folder, what = True, "exported files"

    def __init__(self, env: DistEnv, directory: str, run_id: str):
        self.env, self.store = env, None
        if URL.match(directory):  # exported locally, then uploaded by publish()
            from .snapshot.store import Store

            self.store = Store(directory, env.rank)
            directory = f"{self.store.local}-export"
        self.path = os.path.abspath(directory)
        self._fd: int | None = None

        def claim() -> str:
            try:
                self._fd = self.claim(self.path, run_id)
            except OSError as exc:
                raise RunError(f"cannot claim the export folder {self.path}: {exc}") from None
            if self.store is not None:
                self._claim_store(run_id)
            return self.path

        self.path = distributed.decided_on_rank_0(env, claim, RunError)

    def _claim_store(self, run_id: str) -> None:
        """Rank 0, on a store, as claim() does for a folder: another run's exported files move aside to
        `<export-dir>.<its run id>` (each object copied, checked, then removed: Store.move), this run's own come back
        from `<export-dir>.<run id>`, and run.json there names this run. (A store holds no lock a live job could
        hold: two live jobs exporting to one URL take it from each other, each at its start.)"""
        from .snapshot.format import SnapshotError
        from .snapshot.store import Store

        store = cast(Store, self.store)
        try:
            held = {name.split("/")[0] for name in store.listing()}
            records = [store.get_json(name) for name in (OWNER_FILE, "summary.json") if name in held]
            found = next((record.get("run_id") for record in records if isinstance(record, dict)), None)
            owner = found if isinstance(found, str) and RUN_ID.match(found) else None
            names = [name for name in EXPORT_FILES if name in held]
            if owner != run_id and names:
                label, number = owner or time.strftime("unknown-run-%Y%m%d-%H%M%S"), 1
                aside = Store(f"{store.url}.{label}", 0)
                while aside.listing():
                    number += 1
                    aside = Store(f"{store.url}.{label}-{number}", 0)
                store.move(names, aside.root)
                if owner is not None:
                    aside.put_json(OWNER_FILE, {"run_id": owner})
                log.info("the exported files of run %s in %s moved aside to %s", owner, store.url, aside.url)
            own = Store(f"{store.url}.{run_id}", 0)
            back = [name for name in EXPORT_FILES if name in {name.split("/")[0] for name in own.listing()}]
            if owner != run_id and back:
                store.move(back, store.root, source=own.root)
                own.remove(OWNER_FILE)
                log.info("this run's exported files are back in %s from %s", store.url, own.url)
            store.put_json(OWNER_FILE, {"run_id": run_id})
        except (OSError, SnapshotError) as exc:
            raise RunError(f"cannot claim the export folder {store.url}: {exc}") from None

    def owner(self, fd: int | None) -> str | None:
        """Whom run.json names, else summary.json."""
        for name in (OWNER_FILE, "summary.json"):
            try:
                text = read_held(fd) if fd is not None and name == OWNER_FILE else Path(self.path, name).read_bytes()
                found = json.loads(text).get("run_id")
            except (OSError, ValueError, AttributeError, RecursionError):
                found = None
            if found is not None:
                return found if isinstance(found, str) and RUN_ID.match(found) else None
        return None

    def set_aside(self, fd: int, aside: str, owner: str | None) -> bool:
        return _move(self.path, aside, owner)

    def take_back(self, fd: int, own: str) -> int:
        _move(own, self.path, None)
        Path(own, OWNER_FILE).unlink(missing_ok=True)
        if not os.listdir(own):
            os.rmdir(own)
        return fd

    def export(self, parallel: DistributedModel, name: str) -> None:
        """The model's weights as <name> in this folder (report.export), uploaded too when the folder is a store's."""
        report.export(parallel.model, parallel.sharded, self.env, self.path, name)
        self.publish()

    def publish(self) -> None:
        """Rank 0, on a store: upload what the export folder holds (each file checked by reading it back)."""
        if self.store is None or self._fd is None:
            return
        root = Path(self.path)
        for name in EXPORT_FILES:
            for local in [root / name, *(root / name).rglob("*")]:  # a file, or a folder's files (hf/)
                if local.is_file():
                    entry = {"size": local.stat().st_size, "sha256": sha256_file(str(local))}
                    self.store.upload(str(local), local.relative_to(root).as_posix(), entry)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
