"""Snapshots on object storage (`--snapshot-dir s3://bucket/prefix`, gs://, az://, file://), through fsspec.

A store has no rename and the ranks may share no filesystem: each rank writes its part to a local staging folder
first, and `Uploader` uploads it in the background, each object read back and checked against the receipt, the
receipt last; rank 0 writes the manifest once every rank's receipt and object is there, and reads it back too.
Layout as in a local folder (__init__.py); one job per prefix (storelock.py). Every call is bounded: retried for up
to STORE_TIMEOUT_S (timeout_s), each request within a third of it.
"""

import hashlib
import json
import logging
import os
import queue
import secrets
import shutil
import tempfile
import threading
import time

from ..settings import first_line
from ..storeurl import url_spelling_problem
from .format import (
    MANIFEST,
    RUN_FILE,
    URL,
    SnapshotError,
    check_file,
    file_entry,
    load_latest_in_folder,
    load_whole,
    newest_usable,
    read_manifest,
    read_receipt,
    receipt_file,
    receipts_manifest,
    step_name,
    step_of_folder,
    stream_entry,
    write_json_atomic,
)
from .storelock import LOCK_OBJECT, StoreLock, held_by

log = logging.getLogger(__name__)

EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs", "az": "azure", "abfs": "azure", "abfss": "azure"}
CONNECT_TIMEOUT_S = 5.0
READ_TIMEOUT_S = 60.0  # one request's longest wait for the store's next bytes (botocore's default)
RUN_FILES = (RUN_FILE, "config.toml")  # kept with the snapshots
STOP_RECORD = "stopped.json"  # stop.py's
SET_ASIDE = "set-aside.json"  # {"to": the suffix of the prefix it goes to} while a fresh start moves the prefix aside


def timeout_s() -> float:
    """How long a store call is retried (connection errors, timeouts, 5xx replies) before the run stops, naming the
    URL and the store's error: STORE_TIMEOUT_S in the environment, default 180 s. One request waits at most a third
    of it (and at most READ_TIMEOUT_S) for an answer."""
    return float(os.environ.get("STORE_TIMEOUT_S", "180"))


def _request_timeouts() -> tuple[float, float]:
    """(connect, read) timeouts of one request: within a third of timeout_s() together."""
    budget = max(timeout_s() / 3, 0.2)
    connect = min(CONNECT_TIMEOUT_S, budget / 2)
    return connect, min(READ_TIMEOUT_S, budget - connect)


def _quiet_loop(fs) -> None:
    """A store that resets connections leaves the client's background tasks failed with none to await them: asyncio
    would print a traceback for each ("Task exception was never retrieved"). The call that failed says why, once."""
    loop = getattr(fs, "loop", None)
    if loop is not None:
        loop.set_exception_handler(lambda _, context: log.debug("store client: %s", context.get("message")))


def _no_expect_continue(params: dict, **_) -> None:
    """botocore asks the store to accept a PUT before its body is sent (Expect: 100-continue), and the HTTP client
    waits for that answer with no timeout: a store that never answers would hang every write. Sent without it, the
    request's read timeout applies."""
    params.get("headers", {}).pop("Expect", None)


def connect(url: str):
    """(filesystem, root path) for a URL; SnapshotError names the extra to install when its package is missing."""
    import fsspec

    protocol = url.split("://", 1)[0].lower()
    try:
        fsspec.get_filesystem_class(protocol)
    except ImportError:
        extra = EXTRAS.get(protocol, protocol)
        raise SnapshotError(f"{url}: the {protocol}:// store needs its package: pip install -e '.[{extra}]'") from None
    except ValueError:
        raise SnapshotError(f"{url}: fsspec knows no {protocol}:// store") from None
    options: dict = {"auto_mkdir": True} if protocol in ("file", "local") else {}
    for name in ("botocore", "aiobotocore"):  # "found credentials in environment variables" on every start
        logging.getLogger(name).setLevel(logging.WARNING)
    if protocol in ("s3", "s3a"):  # one try per call, each bounded: _retried retries, within timeout_s()
        connect_timeout, read_timeout = _request_timeouts()
        config = {"connect_timeout": connect_timeout, "read_timeout": read_timeout, "retries": {"max_attempts": 1}}
        options = {"config_kwargs": config}
    # a new client each time: one made before the environment changed (AWS_ENDPOINT_URL, ...) is not reused
    fs, root = fsspec.core.url_to_fs(url, skip_instance_cache=True, **options)
    if "config_kwargs" in options:
        fs.retries = 1  # s3fs's own retries (5 by default) would multiply _retried's
        fs.connect()  # the client, made now to change how it sends
        fs.s3.meta.events.register_last("before-call.s3", _no_expect_continue)
    _quiet_loop(fs)
    return fs, root.rstrip("/")


def url_problem(url: str) -> str | None:
    """Why a job cannot use `url` (package missing, store unreachable, no bucket, no permission), or None."""
    try:
        Store(url, 0).probe()
    except SnapshotError as exc:
        return str(exc)
    except Exception as exc:  # the store's client could not be made (its configuration, ...)
        return f"cannot use the store {url}: {first_line(exc)}"
    return None


def staging_folder(url: str, rank: int) -> str:
    """The local folder where `rank` writes what goes to `url` before it is uploaded."""
    tag = hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:12]
    return os.path.join(tempfile.gettempdir(), f"snapshot-staging-{tag}-rank{rank}")


def read_beside(url: str, name: str) -> bytes | None:
    """An object beside the snapshots on a store (stop.py's record), or None when there is none."""
    try:
        store = Store(url, 0)
        return store.fs.cat_file(store.path(name))
    except (OSError, SnapshotError):
        return None


def _same_object(copy: dict | None, original: dict) -> bool:
    """Whether the listed `copy` of an object is there at the original's size, with its ETag where both have a
    plain one (a multipart upload's, with a "-", differs from its copy's)."""
    if copy is None or copy.get("size") != original.get("size"):
        return False
    tags = [str(info.get("ETag") or "") for info in (copy, original)]
    return not all(tag and "-" not in tag for tag in tags) or tags[0] == tags[1]


def _retried(call, what: str):
    """call(), retried with backoff for up to timeout_s() unless the store's answer is final (missing, exists); a
    refusal (403) or the last error as SnapshotError naming `what`."""
    delay, deadline = 0.5, time.monotonic() + timeout_s()
    while True:
        try:
            return call()
        except (FileNotFoundError, FileExistsError, SnapshotError):
            raise
        except PermissionError as exc:  # credentials refused: no retry helps
            raise SnapshotError(f"{what}: {first_line(exc)}") from exc
        except Exception as exc:  # connection errors, timeouts, 5xx, throttling
            reason = first_line(exc) if str(exc) else f"{type(exc).__name__}: the store did not answer in time"
            if time.monotonic() + delay + sum(_request_timeouts()) > deadline:
                raise SnapshotError(f"{what}: {reason} (retried for {timeout_s():.0f} s: STORE_TIMEOUT_S)") from exc
            log.debug("%s: %s; retrying in %.1f s", what, reason, delay)
            time.sleep(delay)
            delay = min(delay * 2, 30.0)


class Store:
    """One job's prefix on a store, and this rank's local staging folder for it."""

    def __init__(self, url: str, rank: int):
        if problem := url_spelling_problem(url):
            raise SnapshotError(problem)
        self.url = url.rstrip("/")
        self.fs, self.root = connect(self.url)
        self.local = staging_folder(self.url, rank)
        self.lock: StoreLock | None = None
        self.lock_owner = ""  # on the other ranks: rank 0's lock's owner token (storelock.py)

    def path(self, *names: str) -> str:
        return "/".join([self.root, *names])

    def where(self, *names: str) -> str:
        return "/".join([self.url, *names])

    def probe(self) -> None:
        name = f".probe-{secrets.token_hex(6)}"
        try:
            self.fs.pipe_file(self.path(name), name.encode())
            read = self.fs.cat_file(self.path(name))
            self.fs.rm_file(self.path(name))
        except Exception as exc:  # the store's own error, whatever it is, in one line
            raise SnapshotError(f"cannot use the store {self.url}: {first_line(exc)}") from None
        if read != name.encode():
            raise SnapshotError(f"cannot use the store {self.url}: an object read back differs from what was written")

    def steps(self) -> tuple[list[int], list[int]]:
        """(committed steps newest first, steps without a manifest), as list_steps gives them for a folder."""
        self.fs.invalidate_cache()
        names = _retried(lambda: self.fs.find(self.root), f"listing {self.url}")
        found: dict[int, bool] = {}
        for name in names:
            parts = name[len(self.root) + 1 :].split("/")
            step = step_of_folder(parts[0]) if len(parts) >= 2 else None
            if step is not None:
                found[step] = found.get(step, False) or parts[1:] == [MANIFEST]
        committed = [step for step, done in found.items() if done]
        return sorted(committed, reverse=True), sorted(found.keys() - set(committed))

    def upload(self, local: str, name: str, entry: dict) -> None:
        """Put one file and check it by reading it back: its size and sha256 must be the receipt's."""

        def put():
            self.fs.put_file(local, self.path(name), **self._bounded(entry["size"]))
            with self.fs.open(self.path(name), "rb", block_size=1 << 22) as handle:
                got = stream_entry(handle)
            if (got["size"], got["sha256"]) != (entry["size"], entry["sha256"]):
                raise OSError(f"{self.where(name)} read back as {got['size']} bytes with another checksum")

        _retried(put, f"uploading {self.where(name)}")

    def _bounded(self, size: int) -> dict:
        """The hard limit on one upload of `size` bytes, for a store client that takes one: a request's timeouts
        bound the wait for an answer, not a body the store stops reading (a second per MiB on top)."""
        from fsspec.asyn import AsyncFileSystem

        if not isinstance(self.fs, AsyncFileSystem):
            return {}
        return {"timeout": sum(_request_timeouts()) + size / 2**20}

    def download(self, name: str, local: str) -> None:
        os.makedirs(os.path.dirname(local), exist_ok=True)
        _retried(lambda: self.fs.get_file(self.path(name), local), f"downloading {self.where(name)}")

    def remove(self, name: str) -> None:
        try:
            _retried(lambda: self.fs.rm(self.path(name), recursive=True), f"removing {self.where(name)}")
        except FileNotFoundError:
            pass

    def put_json(self, name: str, obj) -> None:
        """Write a small JSON object, checked by reading it back as upload() checks a file."""
        folder = tempfile.mkdtemp(prefix="store-json-")
        try:
            local = os.path.join(folder, "object.json")
            entry = write_json_atomic(local, obj)
            self.upload(local, name, entry)
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def get_json(self, name: str):
        """A JSON object of the prefix, or None where there is none or it is not JSON."""
        try:
            return json.loads(_retried(lambda: self.fs.cat_file(self.path(name)), f"reading {self.where(name)}"))
        except (FileNotFoundError, ValueError):
            return None

    def listing(self, root: str | None = None) -> dict[str, dict]:
        """{name relative to `root` (by default this prefix): its info} of every object under it."""
        root = root or self.root
        self.fs.invalidate_cache()
        found = _retried(lambda: self.fs.find(root, detail=True), f"listing {root}")
        return {path[len(root) + 1 :]: info for path, info in found.items() if path.startswith(f"{root}/")}

    def move(self, names: list[str], target: str, source: str | None = None) -> int:
        """Move the objects named `names` (each a file, or a folder with all it holds) from the prefix `source` (by
        default this one) to the prefix `target` of the same store: every object copied, the copies checked (each
        there, at its size and, where the store gives one, the same ETag), and only then the originals removed, the
        manifests first (a snapshot half removed is never loaded). Moving again after an interruption finishes the
        move: an object already copied is not copied again. Returns how many objects moved."""
        source = source or self.root
        objects = {
            name: info
            for name, info in self.listing(source).items()
            if any(name == top or name.startswith(f"{top}/") for top in names)
        }
        copied = self.listing(target)
        for name, info in objects.items():
            if not _same_object(copied.get(name), info):
                src, dst = f"{source}/{name}", f"{target}/{name}"
                _retried(lambda s=src, d=dst: self.fs.copy(s, d), f"copying {src} to {dst}")
        copied = self.listing(target)
        for name, info in objects.items():
            if not _same_object(copied.get(name), info):
                raise SnapshotError(f"copying {source}/{name} to {target}/{name}: the copy differs from it")
        for name in sorted(objects, key=lambda name: not name.endswith(f"/{MANIFEST}")):
            path = f"{source}/{name}"
            try:
                _retried(lambda p=path: self.fs.rm_file(p), f"removing {path}")
            except FileNotFoundError:
                pass
        return len(objects)

    # -- the job's start-up (rank 0) ------------------------------------------------------------------------------

    def open(self, job: str, fresh_start: bool) -> None:
        """Take the prefix for this job as SnapshotFolder.prepare takes a folder, and fetch the run id and config."""
        self.probe()
        self.lock = StoreLock(self, job)
        self.lock.acquire()
        self._finish_set_aside()  # a fresh start's move aside that its job did not finish
        shutil.rmtree(self.local, ignore_errors=True)  # this rank's staging: no other job of this prefix uses it
        os.makedirs(self.local)
        for step in self.steps()[1]:
            self._commit_finished(step)
        committed = self.steps()[0]
        if fresh_start and committed:
            self._start_fresh(job, committed)
        for step in self.steps()[1]:
            log.info("removing %s: an interrupted save", self.where(step_name(step)))
            self.remove(step_name(step))
        for name in RUN_FILES:
            try:
                self.download(name, os.path.join(self.local, name))
            except FileNotFoundError:
                pass
        self.remove(STOP_RECORD)  # a new launch, not a restart of a job a signal stopped (stop.py)
        self.lock.start_heartbeat()

    def _commit_finished(self, step: int) -> None:
        folder, where = os.path.join(self.local, ".finished", step_name(step)), self.where(step_name(step))
        fetch = lambda rank: self.download(  # noqa: E731
            f"{step_name(step)}/{receipt_file(rank)}", os.path.join(folder, receipt_file(rank))
        )
        try:
            fetch(0)
            self.commit(step, receipts_manifest(folder, step, where, fetch))
            log.info("committed %s: every rank's part of it was uploaded before its job ended", where)
        except (OSError, SnapshotError, TypeError, KeyError) as exc:
            log.debug("not committing %s: %s", where, exc)
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def _start_fresh(self, job: str, committed: list[int]) -> None:
        newest = self.read_manifest(committed[0])
        if job and newest is not None and newest["job"] == job:
            return  # a restart of this same job resumes
        suffix, number = f".set-aside-{time.strftime('%Y%m%d-%H%M%S')}", 1
        while self.listing(f"{self.root}{suffix}"):
            number += 1
            suffix = f".set-aside-{time.strftime('%Y%m%d-%H%M%S')}-{number}"
        self.put_json(SET_ASIDE, {"to": suffix, "newest": committed[0]})  # an interrupted move is finished later
        self._finish_set_aside()

    def _finish_set_aside(self) -> None:
        """Move what the prefix holds (but its lock) aside as the record SET_ASIDE says: a fresh start's move,
        or one a job that ended during it left half done. Copies first, checked, then the originals go (move())."""
        record = self.get_json(SET_ASIDE)
        if not isinstance(record, dict) or not isinstance(record.get("to"), str):
            return
        kept = (LOCK_OBJECT, SET_ASIDE)
        names = sorted({name.split("/")[0] for name in self.listing()} - set(kept))
        names = [name for name in names if not name.startswith((".probe-", ".clock-"))]
        self.move(names, f"{self.root}{record['to']}")
        self.remove(SET_ASIDE)
        log.warning(
            "starting afresh: moved what %s held (snapshots up to step %s) aside to %s%s",
            self.url,
            record.get("newest"),
            self.url,
            record["to"],
        )

    def read_manifest(self, step: int) -> dict | None:
        folder = os.path.join(self.local, ".manifests", step_name(step))
        try:
            self.download(f"{step_name(step)}/{MANIFEST}", os.path.join(folder, MANIFEST))
            return read_manifest(folder)
        except (OSError, SnapshotError):
            return None
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def commit(self, step: int, manifest: dict) -> None:
        """Write the manifest last, once every object it lists is on the store at its size, and check it by reading
        it back like every other object (rewritten until it reads back whole; removed, and the snapshot not counted,
        when it never does)."""
        self.fs.invalidate_cache()
        for name, entry in manifest["files"].items():
            size = _retried(lambda n=name: self.fs.info(self.path(step_name(step), n))["size"], f"checking {name}")
            if size != entry["size"]:
                raise SnapshotError(f"{self.where(step_name(step), name)} is {size} bytes, not {entry['size']}")
        self.confirm_lock(f"not committing {self.where(step_name(step))}")
        try:
            self.put_json(f"{step_name(step)}/{MANIFEST}", manifest)
        except BaseException:
            self.remove(f"{step_name(step)}/{MANIFEST}")  # a damaged commit marker commits nothing
            raise

    def confirm_lock(self, what: str) -> bool:
        """Before this rank writes a snapshot's objects, whether the job still holds the prefix (storelock.py): rank 0
        renews its lock, and raises SnapshotError (`what`, and why) where another job took it over; another rank
        checks that it is still rank 0's (False where it is not: rank 0 says so)."""
        if self.lock is not None:
            lock = self.lock
            _retried(lambda: lock.confirm(what), f"renewing {lock.where}")
        elif self.lock_owner:
            return _retried(lambda: held_by(self, self.lock_owner), f"reading {self.where(LOCK_OBJECT)}")
        return True

    def prune(self, keep: int) -> None:
        """Keep the newest `keep` snapshots and those whose frozen parameters a kept one refers to."""
        committed = self.steps()[0]
        needed = set(committed[:keep])
        for step in committed[:keep]:
            manifest = self.read_manifest(step)
            if manifest is not None:
                needed.add(manifest.get("frozen_in", step))
        for step in committed:
            if step not in needed:
                self.remove(f"{step_name(step)}/{MANIFEST}")  # uncommit first: a half-removed one is never loaded
                self.remove(step_name(step))

    # -- loading ---------------------------------------------------------------------------------------------------

    def pull(self, step: int, folder: str) -> str | None:
        """Download a committed snapshot (and the one holding its frozen parameters) into `folder`, each object
        checked; why it is unusable, or None."""
        todo, done = [step], set()
        try:
            while todo:
                step = todo.pop()
                done.add(step)
                local = os.path.join(folder, step_name(step))
                self.download(f"{step_name(step)}/{MANIFEST}", os.path.join(local, MANIFEST))
                manifest = read_manifest(local)
                for name in manifest["files"]:
                    self.download(f"{step_name(step)}/{name}", os.path.join(local, name))
                    check_file(local, manifest, name)
                if manifest.get("frozen_in", step) not in done:
                    todo.append(manifest["frozen_in"])
        except FileNotFoundError as exc:
            return f"{self.where(step_name(step))}: an object is missing ({exc})"
        except (OSError, SnapshotError) as exc:
            return str(exc)
        return None

    def close(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None


def load_latest(directory: str, rank: int | None = None) -> dict | None:
    """The newest snapshot whose files all check out, as load_latest_in_folder (format.py) gives it, of a folder or
    a store (downloaded to a temp folder, where it stays); None when there is none."""
    if problem := url_spelling_problem(str(directory)):
        raise SnapshotError(problem)
    if not URL.match(str(directory)):
        return load_latest_in_folder(directory, rank)
    store = Store(str(directory), 0)
    folder = tempfile.mkdtemp(prefix="snapshot-load-")

    def load(step: int) -> dict:
        try:
            if reason := store.pull(step, folder):
                raise SnapshotError(reason)
            return load_whole(os.path.join(folder, step_name(step)), rank)
        except SnapshotError:
            shutil.rmtree(os.path.join(folder, step_name(step)), ignore_errors=True)
            raise

    return newest_usable(store.steps()[0], load, store.url)[0]


class Uploader:
    """This rank's background uploads, one save after another, in order; rank 0 commits each and prunes."""

    def __init__(self, store: Store, rank: int, keep: int, commit_timeout: float):
        self.store, self.rank, self.keep = store, rank, keep
        self.commit_timeout = commit_timeout
        self._queue: queue.Queue = queue.Queue()
        self._pending = 0
        self._idle = threading.Condition()
        self._error: BaseException | None = None
        self.closed = False
        threading.Thread(target=self._run, name="snapshot-upload", daemon=True).start()

    def submit(self, step: int) -> None:
        with self._idle:
            self._pending += 1
        self._queue.put(step)

    def busy(self) -> bool:
        """Whether a submitted save is not uploaded yet."""
        with self._idle:
            return self._pending > 0

    def drain(self, timeout: float | None = None) -> None:
        """Wait until every submitted save is uploaded (and committed on rank 0); raise the first failure."""
        with self._idle:
            self._idle.wait_for(lambda: not self._pending or self._error is not None, timeout)
        self.raise_error()

    def raise_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _run(self):
        while True:
            step = self._queue.get()
            try:
                if self._error is None and not self.closed:
                    self._upload(step)
            except BaseException as exc:
                what = f"uploading to {self.store.url}: {first_line(exc)}"
                self._error = exc if isinstance(exc, SnapshotError) else SnapshotError(what)
            with self._idle:
                self._pending -= 1
                self._idle.notify_all()

    def _upload(self, step: int) -> None:
        folder = os.path.join(self.store.local, step_name(step))
        if not self.store.confirm_lock(f"not uploading {self.store.where(step_name(step))}"):
            log.debug("not uploading %s: another job holds the prefix", self.store.where(step_name(step)))
            shutil.rmtree(folder, ignore_errors=True)
            return
        receipt = read_receipt(folder, self.rank)
        for name, entry in receipt["files"].items():
            self.store.upload(os.path.join(folder, name), f"{step_name(step)}/{name}", entry)
        own = os.path.join(folder, receipt_file(self.rank))
        self.store.upload(own, f"{step_name(step)}/{receipt_file(self.rank)}", file_entry(own))
        if self.rank == 0:
            self._commit(step, folder)
        shutil.rmtree(folder, ignore_errors=True)

    def _commit(self, step: int, folder: str) -> None:
        deadline = time.monotonic() + self.commit_timeout

        def fetch(rank: int) -> None:
            while True:
                try:
                    return self.store.download(
                        f"{step_name(step)}/{receipt_file(rank)}", os.path.join(folder, receipt_file(rank))
                    )
                except FileNotFoundError:
                    if time.monotonic() > deadline or self.closed:
                        raise SnapshotError(
                            f"rank {rank}'s part of {self.store.where(step_name(step))} was not uploaded within "
                            f"{self.commit_timeout:.0f} s"
                        ) from None
                    time.sleep(0.1)

        manifest = receipts_manifest(folder, step, self.store.where(step_name(step)), fetch)
        if self.closed:
            raise SnapshotError(f"not committing {self.store.where(step_name(step))}: the job ended first")
        self.store.commit(step, manifest)
        for name in RUN_FILES:
            path = os.path.join(self.store.local, name)
            if os.path.exists(path):
                self.store.upload(path, name, file_entry(path))
        self.store.prune(self.keep)
