"""One job per prefix of a store: rank 0's lock object `<prefix>/job.lock`, a JSON record (host, boot id, pid and its
start time, torchrun job id, a random owner token), made only where none is (S3's If-None-Match: *) and rewritten
every STORE_LOCK_STALE_S / 6 s only while it is still the version this job wrote (If-Match its ETag): its lease.

A job that finds the lock of another:
- takes it at once from an earlier attempt of the same torchrun job, and from a job of this machine (host name and
  boot id, as joblock.py tells them) whose process is gone: a job SIGKILLed and started again;
- else watches it: a holder that renews it is alive, and the job is refused in one line; one whose lock is older
  than STORE_LOCK_STALE_S (environment, default 60 s) by the store's clock is gone, and the job takes it over (a
  conditional write, so of two jobs taking it one wins), after saying once how long it waits.

Rank 0 renews the lock before each upload and commit, and the other ranks check that it is still rank 0's before
theirs: a job that lost it (frozen past its lease and taken over meanwhile) uploads and commits nothing more, and
its next save fails on rank 0, naming the job that holds it. A lock deleted while its lease runs (a lifecycle rule,
a user) is made again; one deleted after this job's lease may have lapsed is as good as lost: another job may have
taken it and let it go. Other stores than S3 (no conditional write there) remove and re-create it.
"""

import json
import logging
import os
import secrets
import socket
import threading
import time

from ..identity import boot_id, process_alive, process_start
from ..joblock import JobLockError, seconds_from_env
from ..settings import first_line, short_repr
from .format import SnapshotError

log = logging.getLogger(__name__)

LOCK_OBJECT = "job.lock"
DEFAULT_STALE_S = 60.0
RACES = 10  # take-overs lost to other jobs before giving up


def stale_s() -> float:
    """Seconds without a renewal after which a lock counts as its job's that is gone (STORE_LOCK_STALE_S)."""
    return seconds_from_env("STORE_LOCK_STALE_S", DEFAULT_STALE_S)


def describe(holder: dict) -> str:
    """Who holds a lock, in words (values from the object as they are, cut short)."""
    host, pid = (short_repr(holder.get(key), quote=False, limit=80) for key in ("host", "pid"))
    job = f", torchrun job {short_repr(holder['job'], quote=False, limit=80)}" if holder.get("job") else ""
    return f"host {host}, pid {pid}{job}"


def held_by(store, owner: str) -> bool:
    """Whether the prefix's lock is still `owner`'s, as a rank other than 0 sees it: False once another job holds
    it. A missing or unreadable one is still its job's: its rank 0 makes it again, or stops."""
    store.fs.invalidate_cache()
    try:
        holder = json.loads(store.fs.cat_file(store.path(LOCK_OBJECT)))
    except (FileNotFoundError, ValueError):
        return True
    return not isinstance(holder, dict) or holder.get("owner") == owner


class Conflict(Exception):
    """A conditional write refused: the lock is not the version it was judged on (or exists, for a creation)."""


class StoreLock:
    """Rank 0's lock object on the prefix."""

    def __init__(self, store, job: str):
        self.store, self.job = store, job
        self.stale_s = stale_s()
        self.name = store.path(LOCK_OBJECT)
        self.where = store.where(LOCK_OBJECT)
        self.owner = secrets.token_hex(8)
        self.lost = ""  # why the lock is no longer this job's, once it is not
        self._renewed = 0.0  # time.monotonic() when the write that started the running lease was sent
        self._guard = threading.Lock()  # the heartbeat and the uploads' checks, one at a time
        self._stop = threading.Event()

    def _record(self) -> bytes:
        pid = os.getpid()
        return json.dumps(
            {
                "owner": self.owner,
                "job": self.job,
                "host": socket.gethostname(),
                "boot_id": boot_id(),
                "pid": pid,
                "pid_started": process_start(pid),
                "heartbeat": time.time(),
            }
        ).encode()

    # -- the store's side ------------------------------------------------------------------------------------------

    def _read(self) -> tuple[dict, str, float]:
        """(the lock's record, its ETag, its date by the store's clock); FileNotFoundError where there is none."""
        fs = self.store.fs
        fs.invalidate_cache()
        info = fs.info(self.name)
        try:
            holder = json.loads(fs.cat_file(self.name))
        except ValueError:
            holder = {}
        written = fs.modified(self.name).timestamp()
        return (holder if isinstance(holder, dict) else {}), str(info.get("ETag", "")), written

    def _write(self, etag: str | None) -> None:
        """Write this job's record where no lock is (etag None) or over the version `etag` only; Conflict if the lock
        is not as judged, FileNotFoundError if it is gone (a replacement)."""
        fs, data = self.store.fs, self._record()
        sent = time.monotonic()
        if hasattr(fs, "call_s3"):  # S3's conditional writes
            bucket, key, _ = fs.split_path(self.name)
            condition = {"IfNoneMatch": "*"} if etag is None else {"IfMatch": etag}
            try:
                fs.call_s3("put_object", Bucket=bucket, Key=key, Body=data, **condition)
            except FileExistsError:
                raise Conflict() from None
            except OSError as exc:
                code = getattr(exc.__cause__, "response", {}).get("Error", {}).get("Code")
                if code in ("PreconditionFailed", "ConditionalRequestConflict"):
                    raise Conflict() from None
                raise
        else:
            try:
                if etag is not None:
                    fs.rm_file(self.name)
                fs.pipe_file(self.name, data, mode="create")
            except FileExistsError:
                raise Conflict() from None
        self._renewed = sent

    def _store_now(self) -> float:
        """The store's clock: the date it gives an object written now (the holder's and this machine's may differ)."""
        probe = self.store.path(f".clock-{secrets.token_hex(6)}")
        self.store.fs.pipe_file(probe, b"")
        now = self.store.fs.modified(probe).timestamp()
        self.store.fs.rm_file(probe)
        return now

    # -- taking it -------------------------------------------------------------------------------------------------

    def acquire(self) -> None:
        """Take the lock, waiting for the lease of a holder that may be gone; JobLockError if a live job holds it."""
        races = 0
        watched, watched_owner = "", None  # the version (ETag) whose lease this job waits out, and its holder
        lapses = 0.0  # time.monotonic() when that lease lapses
        while races < RACES:
            try:
                self._write(None)
                return
            except Conflict:
                pass
            try:
                holder, etag, written = self._read()
            except FileNotFoundError:
                races += 1
                continue  # released meanwhile
            if watched and etag != watched:
                if holder.get("owner") == watched_owner:
                    raise self._in_use(holder, "renewed while this job waited")
                watched, races = "", races + 1  # another job took it meanwhile: judge that one
                continue
            reason = self._gone(holder)
            if not reason and not watched:
                age = self._store_now() - written
                if age >= self.stale_s:
                    reason = f"of a job that is gone ({describe(holder)}; no heartbeat for {age:.0f} s)"
                else:
                    watched, watched_owner = etag, holder.get("owner")
                    lapses = time.monotonic() + self.stale_s - max(age, 0.0)
                    log.info(
                        "%s is held by another job (%s, last heartbeat %.0f s ago): waiting up to %.0f s for its "
                        "lease to lapse (STORE_LOCK_STALE_S); a live job renews it sooner, and this one stops then",
                        self.where,
                        describe(holder),
                        max(age, 0.0),
                        lapses - time.monotonic(),
                    )
            if watched and not reason:
                if time.monotonic() < lapses:
                    time.sleep(min(1.0, self.stale_s / 12))
                    continue
                reason = f"of a job that is gone ({describe(holder)}; no heartbeat for {self.stale_s:.0f} s)"
            level = logging.INFO if reason.startswith("from") else logging.WARNING
            log.log(level, "taking over %s %s", self.where, reason)
            try:
                self._write(etag)
                return
            except (Conflict, FileNotFoundError):
                watched, races = "", races + 1  # another job took it first, or it was released: look again
        raise JobLockError(f"cannot take {self.where}: other jobs keep changing it")

    def _gone(self, holder: dict) -> str:
        """Why the lock may be taken at once (in words), or "" when only its lease can tell."""
        if self.job and holder.get("job") == self.job:
            return f"from an earlier attempt of this job ({describe(holder)})"
        pid, started = holder.get("pid"), holder.get("pid_started")
        same_machine = holder.get("host") == socket.gethostname() and holder.get("boot_id") == boot_id() != ""
        if same_machine and type(pid) is int and type(started) is int and not process_alive(pid, started):
            return f"of a job that is gone ({describe(holder)}: no such process on this machine)"
        return ""

    def _in_use(self, holder: dict, state: str) -> JobLockError:
        return JobLockError(
            f"{self.where} is held by another running job ({describe(holder)}, {state}): one job per prefix; stop "
            f"that job first, or give this one another --snapshot-dir"
        )

    # -- holding it ------------------------------------------------------------------------------------------------

    def start_heartbeat(self) -> None:
        threading.Thread(target=self._beat, name="store-lock-heartbeat", daemon=True).start()

    def _beat(self) -> None:
        while not self._stop.wait(self.stale_s / 6) and not self.lost:
            try:
                self.renew()
            except JobLockError:
                return
            except Exception as exc:  # a store briefly unreachable: the next beat tries again
                log.debug("renewing %s: %s", self.where, first_line(exc))

    def renew(self) -> None:
        """Rewrite the lock if it is still this job's, or make it again where it was deleted during the lease;
        JobLockError naming the holder (and `lost` set) where another job holds it."""
        with self._guard:
            if self.lost:
                raise JobLockError(self.lost)
            for _ in range(RACES):
                try:
                    holder, etag, _ = self._read()
                except FileNotFoundError:
                    holder, etag = {}, None
                if etag is not None and holder.get("owner") != self.owner:
                    self._lose(f"another job took {self.where} over ({describe(holder)})")
                # Another job judges the lease by the store's clock, which may run ahead of this machine's: a
                # renewal interval of margin.
                if etag is None and time.monotonic() - self._renewed >= self.stale_s * 5 / 6:
                    self._lose(
                        f"{self.where} was deleted while this job had not renewed it for "
                        f"{time.monotonic() - self._renewed:.0f} s, past its lease (STORE_LOCK_STALE_S): another job "
                        "may have taken it and committed there since"
                    )
                try:
                    self._write(etag)
                except (Conflict, FileNotFoundError):
                    continue  # it changed between the read and the write: look again
                if etag is None:
                    log.warning("%s was deleted while this job held it: made it again", self.where)
                return
            raise OSError(f"cannot renew {self.where}: other jobs keep changing it")

    def confirm(self, what: str) -> None:
        """renew(), before this job writes to the prefix: SnapshotError (what it would write, and why not) where
        another job holds the lock."""
        try:
            self.renew()
        except JobLockError as exc:
            raise SnapshotError(f"{what}: {exc}") from None

    def _lose(self, reason: str) -> None:
        self.lost = reason
        log.warning("%s: this job uploads and commits no more snapshots there", reason)
        raise JobLockError(reason)

    def release(self) -> None:
        self._stop.set()
        if self.lost:
            return
        try:
            holder, _, _ = self._read()
            if holder.get("owner") == self.owner:
                self.store.fs.rm_file(self.name)
        except Exception as exc:  # a lock left behind lapses
            log.debug("releasing %s: %s", self.name, first_line(exc))
