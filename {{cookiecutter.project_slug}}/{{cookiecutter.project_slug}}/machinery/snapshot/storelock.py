"""One job per prefix of a store: rank 0's lock object `<prefix>/job.lock`, made only where none is (S3's
If-None-Match: *) and rewritten every STORE_LOCK_STALE_S / 6 s only while it is still this job's (If-Match its
ETag). One older than STORE_LOCK_STALE_S (environment, default 60 s) by the store's clock is a dead job's and is
taken over the same way (a restart of the same job takes it at once); other stores than S3 remove and re-create it.
A job whose lock another took over commits no more snapshots."""

import json
import logging
import os
import secrets
import socket
import threading
import time

from ..joblock import JobLockError
from ..settings import first_line

log = logging.getLogger(__name__)

LOCK_OBJECT = "job.lock"


def stale_s() -> float:
    return float(os.environ.get("STORE_LOCK_STALE_S", "60"))


class StoreLock:
    """Rank 0's lock object on the prefix: {owner, job, host, pid, heartbeat}."""

    def __init__(self, store, job: str):
        self.store, self.job = store, job
        self.name = store.path(LOCK_OBJECT)
        self.owner = secrets.token_hex(8)
        self.lost = ""
        self._stop = threading.Event()

    def _record(self) -> bytes:
        record = {"owner": self.owner, "job": self.job, "host": socket.gethostname(), "pid": os.getpid()}
        return json.dumps({**record, "heartbeat": time.time()}).encode()

    def _read(self):
        self.store.fs.invalidate_cache()
        info = self.store.fs.info(self.name)
        try:
            holder = json.loads(self.store.fs.cat_file(self.name))
        except ValueError:
            holder = {}
        return (holder if isinstance(holder, dict) else {}), info

    def _replace(self, etag: str) -> None:
        """Overwrite the lock only if it is still the object with `etag`; FileExistsError if it changed."""
        fs, data = self.store.fs, self._record()
        if hasattr(fs, "call_s3"):  # S3: If-Match, so that of two jobs taking a lapsed lock over one wins
            bucket, key, _ = fs.split_path(self.name)
            fs.call_s3("put_object", Bucket=bucket, Key=key, Body=data, IfMatch=etag)
        else:
            fs.rm_file(self.name)
            fs.pipe_file(self.name, data, mode="create")

    def _store_now(self) -> float:
        """The store's clock: the date it gives an object written now (the holder's and this machine's may differ)."""
        probe = self.store.path(f".clock-{secrets.token_hex(6)}")
        self.store.fs.pipe_file(probe, b"")
        now = self.store.fs.modified(probe).timestamp()
        self.store.fs.rm_file(probe)
        return now

    def acquire(self) -> None:
        for _ in range(10):
            try:
                self.store.fs.pipe_file(self.name, self._record(), mode="create")
                return
            except FileExistsError:
                pass
            try:
                holder, info = self._read()
            except FileNotFoundError:
                continue  # released meanwhile
            age = self._store_now() - self.store.fs.modified(self.name).timestamp()
            same_job = bool(self.job) and holder.get("job") == self.job
            if not same_job and age < stale_s():
                raise JobLockError(
                    f"{self.store.where(LOCK_OBJECT)} is held by another running job (host {holder.get('host')}, "
                    f"pid {holder.get('pid')}, last heartbeat {age:.0f} s ago): one job per prefix. It is taken over "
                    f"{stale_s() - age:.0f} s after its last heartbeat; delete it if no job uses {self.store.url}"
                )
            if not same_job:
                log.warning(
                    "taking over %s: its job is gone (no heartbeat for %.0f s)", self.store.where(LOCK_OBJECT), age
                )
            try:
                self._replace(info.get("ETag", ""))
                return
            except FileExistsError:
                continue  # another job took it first: judge the new holder
        raise JobLockError(f"cannot take {self.store.where(LOCK_OBJECT)}: other jobs keep changing it")

    def start_heartbeat(self) -> None:
        threading.Thread(target=self._beat, name="store-lock-heartbeat", daemon=True).start()

    def _beat(self) -> None:
        while not self._stop.wait(stale_s() / 6):
            try:
                holder, info = self._read()
                if holder.get("owner") != self.owner:
                    self.lost = f"another job took {self.store.where(LOCK_OBJECT)} over (host {holder.get('host')})"
                    log.warning("%s: this job commits no more snapshots", self.lost)
                    return
                self._replace(info.get("ETag", ""))
            except Exception as exc:  # a store briefly unreachable: the next beat tries again
                log.debug("lock heartbeat: %s", first_line(exc))

    def release(self) -> None:
        self._stop.set()
        try:
            holder, _ = self._read()
            if holder.get("owner") == self.owner:
                self.store.fs.rm_file(self.name)
        except Exception as exc:  # a lock left behind lapses
            log.debug("releasing %s: %s", self.name, first_line(exc))
