"""One job per snapshot folder: rank 0 holds `<snapshot-dir>/job.lock`, a JSON record (host, boot id, pid and its
start time, torchrun job id, start, heartbeat, a random owner token); a job that finds a live job's lock is refused
at start-up. What users see, and the limits: docs/fault-tolerance.md, "One job per snapshot folder".

It works where machines share the folder (NFS, Lustre) and flock()/fcntl() depend on a lock service that is often
missing: a free lock is taken by hard-linking a fully written temporary file to job.lock (atomic on NFS too; the
link count settles a reply the network lost; O_CREAT|O_EXCL where there are no hard links), and a heartbeat thread
rewrites it every HEARTBEAT_S. A lock is live, on the same machine (host name and boot id), while its process exists
(the same one: a reused pid has another start time); from another machine, while its heartbeat is younger than
JOB_LOCK_STALE_S by the folder's filesystem clock (`_filesystem_now`). Take-overs (a restart of the same torchrun job
at once, a dead job's lock with a warning) happen under a second lock, job.lock.takeover, and only if job.lock is
still the one judged dead, so two jobs starting at once cannot both take it.
"""

import errno
import json
import logging
import math
import os
import secrets
import socket
import stat
import threading
import time

from .identity import boot_id, current_job, process_alive, process_start
from .settings import short_repr

log = logging.getLogger(__name__)

LOCK_FILE = "job.lock"
HEARTBEAT_S = 5.0  # how often the holder rewrites its heartbeat
DEFAULT_STALE_S = 30.0  # a heartbeat older than this, seen from another machine, is a dead job's
UNREADABLE_GRACE_S = 2.0  # an unreadable lock younger than this may be one being created with O_EXCL
ATTEMPTS = 50  # take-over races lost before giving up
CLOCK_TOLERANCE_S = 2.0  # a lock dated further ahead of the folder's clock than this has a date nobody can trust
_REQUIRED: dict[str, type | tuple[type, ...]] = dict(
    host=str, pid=int, job=str, started=(int, float), heartbeat=(int, float), owner=str
)


class JobLockError(RuntimeError):
    """The snapshot folder is in use by another job, or its lock cannot be taken."""


def stale_after_s() -> float:
    """Seconds without a heartbeat after which a lock held from another machine counts as dead (JOB_LOCK_STALE_S)."""
    return seconds_from_env("JOB_LOCK_STALE_S", DEFAULT_STALE_S)


def seconds_from_env(name: str, default: float) -> float:
    """A number of seconds > 0 from the environment variable `name` (`default` where it is unset or empty); anything
    else is a JobLockError naming the variable and its value."""
    text = os.environ.get(name, "").strip()
    try:
        seconds = float(text) if text else default
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise JobLockError(f"{name} must be a number of seconds > 0, got {short_repr(text)}")
    return seconds


def _open_stat(path: str, size: int = 0) -> tuple[os.stat_result, bytes]:
    """The attributes of `path` as the file server has them (opening it revalidates an NFS client's cache:
    close-to-open), and its first `size` bytes when it is a file. Never blocks: a named pipe is not read."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        info = os.fstat(fd)
        chunks: list[bytes] = []
        while stat.S_ISREG(info.st_mode) and size > 0:
            chunk = os.read(fd, size)
            if not chunk:
                break
            chunks.append(chunk)
            size -= len(chunk)
        return info, b"".join(chunks)
    finally:
        os.close(fd)


def _read(path: str) -> tuple[dict | None, os.stat_result]:
    """A lock file's record (None when it is not a valid one: any bytes, any size, not a file) and its attributes
    as the file server has them."""
    info, data = _open_stat(path, 1 << 16)
    try:
        record = json.loads(data) if stat.S_ISREG(info.st_mode) else None
    except (ValueError, RecursionError):
        record = None
    valid = isinstance(record, dict) and all(
        isinstance(record.get(key), kind) and not isinstance(record.get(key), bool) for key, kind in _REQUIRED.items()
    )
    return (record if valid else None), info


def _unchanged(path: str, info: os.stat_result, seconds: float) -> bool:
    """Whether `path` is still the file `info` describes, unmodified, after watching it for `seconds`: a live holder
    rewrites its lock every HEARTBEAT_S, so this tells a live lock from a dead one without trusting its date."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            now, _ = _open_stat(path)
        except FileNotFoundError:
            return False
        if (now.st_ino, now.st_size, now.st_mtime_ns) != (info.st_ino, info.st_size, info.st_mtime_ns):
            return False
        if time.monotonic() >= deadline:
            return True
        time.sleep(min(0.25, seconds))


def _filesystem_now(directory: str) -> float:
    """The folder's filesystem clock: the mtime of a file written there now (set by the file server on NFS).

    A lock's age is its mtime (set by the file server when the heartbeat was written) against this, never a
    machine's own clock, so machines whose clocks disagree agree on the age."""
    path = os.path.join(directory, f"{LOCK_FILE}.tmp-clock-{secrets.token_hex(6)}")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(fd, b"clock")
        return os.fstat(fd).st_mtime
    finally:
        os.close(fd)
        os.remove(path)


def _write_file(path: str, data: bytes, flags: int) -> None:
    fd = os.open(path, flags, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def _create_new(path: str, data: bytes, temp: str) -> bool:
    """Create `path` holding `data` if it does not exist, atomically also on NFS; True when this call created it."""
    _write_file(temp, data, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        try:
            os.link(temp, path)
        except FileExistsError:
            pass  # someone else's, or ours after a retransmitted request: the link count tells
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS, errno.EMLINK):
                raise
            try:  # a filesystem without hard links
                _write_file(path, data, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
                return True
            except FileExistsError:
                return False
        return os.stat(temp).st_nlink == 2
    finally:
        os.remove(temp)


def describe(record: dict) -> str:
    """Who holds a lock, in words: host, pid, job and start time (values from the file as they are, cut short)."""
    job = f", torchrun job {short_repr(record['job'], quote=False, limit=80)}" if record["job"] else ""
    try:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record["started"]))
    except (OverflowError, OSError, ValueError):
        started = short_repr(record["started"], quote=False, limit=80)
    host, pid = (short_repr(record[key], quote=False, limit=80) for key in ("host", "pid"))
    return f"host {host}, pid {pid}{job}, started {started}"


class JobLock:
    """The lock of one snapshot folder, held by rank 0 of the job that trains into it."""

    def __init__(self, directory: str):
        self.directory = os.path.abspath(directory)
        self.path = os.path.join(self.directory, LOCK_FILE)
        self.owner = secrets.token_hex(8)
        self.job = current_job()
        self.started = time.time()
        self.held = False
        self.lost: str | None = None  # why the lock is no longer ours, once another job took it over
        self._busy_guard: str | None = None  # who was taking the lock over when acquire() last found it busy
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _record(self) -> bytes:
        return json.dumps(
            {
                "host": socket.gethostname(),
                "boot_id": boot_id(),
                "pid": os.getpid(),
                "pid_started": process_start(os.getpid()),
                "job": self.job,
                "started": self.started,
                "heartbeat": time.time(),
                "owner": self.owner,
            },
            sort_keys=True,
        ).encode()

    def _temp(self, purpose: str) -> str:
        return f"{self.path}.tmp-{purpose}-{self.owner}"

    def _rewrite(self) -> None:
        """Replace the lock file by a new record of ours, whole (rename)."""
        temp = self._temp("write")
        _write_file(temp, self._record(), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.replace(temp, self.path)

    # -- taking the lock -----------------------------------------------------------------------------------------

    def acquire(self) -> None:
        """Take the lock, or raise JobLockError naming the job that holds it (OSError: the folder is not writable).
        Whatever a lock file holds (any bytes, absurd pids, dates ahead of every clock), the answer is the lock or
        one JobLockError naming the file and how to clear it."""
        stale_s = stale_after_s()
        self._busy_guard = None
        said: set[str] = set()  # each reason to take over is logged once, however many races are lost after it
        for _ in range(ATTEMPTS):
            if _create_new(self.path, self._record(), self._temp("new")):
                self._taken()
                return
            try:
                holder, info = _read(self.path)
            except FileNotFoundError:
                continue  # released in between: try again
            _check_is_file(self.path, info)
            verdict = self._gone(holder, info, self.path, stale_s)
            if verdict is None:
                continue  # it changed while it was watched: look again
            level, reason = verdict
            if reason and reason not in said:
                said.add(reason)
                log.log(level, "taking over the job lock %s %s", self.path, reason)
            if self._take_over(holder, stale_s):
                self._taken()
                return
            time.sleep(0.1)
        if self._busy_guard:
            raise JobLockError(
                f"could not take the job lock {self.path}: another job is taking it over ({self._busy_guard}); if "
                f"no other job is starting on this folder, delete {self.path}.takeover"
            )
        raise JobLockError(f"could not take the job lock {self.path}: other jobs keep starting on this folder")

    def _gone(self, holder: dict | None, info: os.stat_result, path: str, stale_s: float) -> tuple[int, str] | None:
        """Whether the job that wrote `path` (the lock, or a take-over guard) may be taken over: (log level, why in
        words) if so, None if the file changed while it was watched; JobLockError (saying how to clear it) if its
        job is alive."""
        if holder is None:
            age = _filesystem_now(self.directory) - info.st_mtime
            # Younger than the grace (or dated ahead): it may be one being created with O_EXCL right now.
            if age >= UNREADABLE_GRACE_S or _unchanged(path, info, UNREADABLE_GRACE_S):
                return logging.WARNING, "(it is damaged: not a lock record)"
            return None
        if holder["owner"] == self.owner:
            return logging.DEBUG, ""
        if holder["job"] and holder["job"] == self.job:
            return logging.INFO, f"from an earlier attempt of this job ({describe(holder)})"
        same_machine = holder["host"] == socket.gethostname() and holder.get("boot_id", "") == boot_id()
        if same_machine:
            if holder["pid"] == os.getpid():
                return logging.DEBUG, "from this process"
            started = holder.get("pid_started") if type(holder.get("pid_started")) is int else None
            if not process_alive(holder["pid"], started):
                return logging.WARNING, f"of a job that is gone ({describe(holder)}: no such process)"
            unsure = "" if started is not None else "; the lock records no start time to tell it from another process"
            raise self._in_use(holder, f"running{unsure}", f"if no job uses that folder, delete {path}")
        age = _filesystem_now(self.directory) - info.st_mtime
        if age >= stale_s:
            return logging.WARNING, f"of a job that is gone ({describe(holder)}; no heartbeat for {age:.0f} s)"
        if -age > CLOCK_TOLERANCE_S:
            # Dated ahead of this folder's clock (a client that sets mtimes itself, a copied folder): its date says
            # nothing about a heartbeat, but a live holder rewrites the file every HEARTBEAT_S.
            log.info(
                "the job lock %s is dated %.0f s ahead of this folder's clock: watching it for a heartbeat for %.0f s "
                "(JOB_LOCK_STALE_S)",
                path,
                -age,
                stale_s,
            )
            if _unchanged(path, info, stale_s):
                return logging.WARNING, (
                    f"of a job that is gone ({describe(holder)}; dated {-age:.0f} s ahead of this folder's clock, "
                    f"and no heartbeat for {stale_s:.0f} s)"
                )
            try:
                now, _ = _read(path)
            except FileNotFoundError:
                return None
            if now is None or now["owner"] != holder["owner"]:
                return None
            ahead = f"heartbeat alive; its machine dates it {-age:.0f} s ahead of this folder's clock"
            raise self._in_use(holder, ahead, f"if that job is gone, delete {path}")
        raise self._in_use(
            holder,
            f"last heartbeat {max(age, 0):.0f} s ago",
            f"if that job is gone, its lock expires {stale_s:.0f} s after its last heartbeat (JOB_LOCK_STALE_S), "
            f"or delete {path}",
        )

    def _in_use(self, holder: dict, state: str, clear: str) -> JobLockError:
        return JobLockError(
            f"the snapshot folder {self.directory} is in use by another job ({describe(holder)}, {state}): stop that "
            f"job first, or give this one another --snapshot-dir; {clear}"
        )

    def _take_over(self, holder: dict | None, stale_s: float) -> bool:
        """Replace the lock judged dead by ours, unless another job got there first; True when it is ours."""
        guard = f"{self.path}.takeover"
        if not _create_new(guard, self._record(), self._temp("guard")):
            self._clear_guard(guard, stale_s)
            return False
        try:
            try:
                current, _ = _read(self.path)
            except FileNotFoundError:
                return False
            if (current or {}).get("owner") != (holder or {}).get("owner"):
                return False  # not the lock judged dead any more
            self._rewrite()
            return True
        finally:
            os.remove(guard)

    def _clear_guard(self, guard: str, stale_s: float) -> None:
        """Remove the take-over guard of a job that died while taking over the lock (judged like a lock: by its
        owner's process on this machine, by its age from another); leave that of a job taking over right now."""
        try:
            record, info = _read(guard)
            _check_is_file(guard, info)
            verdict = self._gone(record, info, guard, stale_s)
        except FileNotFoundError:
            return  # the other job finished its take-over
        except JobLockError:
            self._busy_guard = describe(record) if record else "its guard file is being written"
            return  # a live job is taking over: the next attempt sees how that ended
        if verdict is not None:
            log.warning("removing %s, left by a job that died while taking over the lock", guard)
            try:
                os.remove(guard)
            except FileNotFoundError:
                pass

    def _taken(self) -> None:
        """Hold the lock; remove the temporary files of holders that died writing them (old enough to be nobody's)."""
        self.held, self.lost = True, None
        prefix = f"{LOCK_FILE}.tmp-"
        names = [name for name in os.listdir(self.directory) if name.startswith(prefix) and self.owner not in name]
        if not names:
            return
        now = _filesystem_now(self.directory)
        for name in names:
            path = os.path.join(self.directory, name)
            try:
                if now - os.stat(path).st_mtime > stale_after_s():
                    os.remove(path)
            except FileNotFoundError:
                pass  # removed by its writer meanwhile

    # -- holding it ----------------------------------------------------------------------------------------------

    def start_heartbeat(self) -> None:
        """Rewrite the heartbeat every HEARTBEAT_S seconds in a daemon thread until release()."""
        if self._thread is None and self.held:
            self._stop.clear()
            self._thread = threading.Thread(target=self._beat, name="job-lock-heartbeat", daemon=True)
            self._thread.start()

    def _beat(self) -> None:
        failing = False
        while not self._stop.wait(HEARTBEAT_S):
            try:
                holder, _ = _read(self.path)
                if holder is None or holder["owner"] != self.owner:
                    self._lose(
                        f"another job took over the snapshot folder {self.directory} "
                        f"({describe(holder) if holder else 'its lock is damaged'})"
                    )
                    return
                self._rewrite()
                failing = False
            except FileNotFoundError:
                self._lose(f"the job lock {self.path} was deleted")
                return
            except OSError as exc:  # a network filesystem's hiccup: try again at the next beat
                if not failing:
                    log.warning("could not refresh the job lock %s: %s", self.path, exc)
                failing = True

    def _lose(self, reason: str) -> None:
        self.lost, self.held = reason, False
        log.error("%s: this job commits no more snapshots there", reason)

    def release(self) -> None:
        """Stop the heartbeat and remove the lock if it is still ours."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self._thread = None
        if not self.held:
            return
        self.held = False
        try:
            holder, _ = _read(self.path)
            if holder is not None and holder["owner"] == self.owner:
                os.remove(self.path)
        except FileNotFoundError:
            pass  # already gone


def _check_is_file(path: str, info: os.stat_result) -> None:
    if stat.S_ISDIR(info.st_mode):
        raise JobLockError(f"{path} is a folder, not a job lock: delete it")
    if not stat.S_ISREG(info.st_mode):
        raise JobLockError(f"{path} is not a file, so not a job lock: delete it")
