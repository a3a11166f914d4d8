"""The snapshot folder of a job: take it (job lock, fresh start, checks every rank agrees on), find the snapshot to
resume from, set damaged ones aside, prune old ones. `Snapshots` (writer.py) adds saving on top."""

import logging
import os
import secrets
import shutil
import time
from typing import cast

from .. import distributed, identity, joblock
from ..settings import cut_short, first_line
from .format import (
    MANIFEST,
    RUN_FILE,
    SHARED_FOLDER_WAIT_S,
    URL,
    SnapshotError,
    check_file,
    file_entry,
    list_steps,
    load_step,
    newest_usable,
    read_manifest,
    receipts_manifest,
    step_name,
    write_json_atomic,
)
from .store import Store, Uploader
from .storelock import StoreLock

log = logging.getLogger(__name__)
DAMAGED_ADVICE = "Move the snapshots away to start from scratch, or point --snapshot-dir elsewhere."


def _eventually(check, timeout=SHARED_FOLDER_WAIT_S, interval=0.2):
    """Poll check() every `interval` seconds until it is true (return True) or the timeout passes (False)."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)
    return True


class SnapshotFolder:
    """The folder side of one job's snapshots. Every rank holds one; collectives are called on every rank. Rank 0
    holds the folder's job lock from prepare() to close(): call close() in a `finally`."""

    commit_timeout = 600.0  # seconds rank 0 waits for every rank's part before a save fails (Snapshots sets it)

    def __init__(self, directory: str, env: distributed.DistEnv, keep: int):
        # On a store (an fsspec URL), self.directory is this rank's local staging folder (store.py)
        self.store = Store(directory, env.rank) if URL.match(str(directory)) else None
        self.uploads: Uploader | None = None
        self.directory = self.store.local if self.store else os.path.abspath(directory)
        self.env = env
        self.keep = keep
        self.job = identity.current_job()  # recorded in every manifest: a restart of this job resumes them
        self.job_lock: joblock.JobLock | None = None  # rank 0's, from prepare() to close()
        self._closed = False

    def step_folder(self, step: int) -> str:
        return os.path.join(self.directory, step_name(step))

    # -- start-up ------------------------------------------------------------------------------------------------

    def prepare(self, estimated_bytes: int, fresh_start: bool = False) -> None:
        """Take the folder for this job and check it early: rank 0 takes the job lock, moves old contents aside
        when `fresh_start` asks for it (see __init__.py), checks the folder is writable, has room and is seen by
        every rank, and clears what interrupted saves and start-ups left. Errors are decided on rank 0 and raised
        on every rank, so no rank is left waiting at a collective.
        """
        try:
            if self.store is not None:
                self._prepare_store(fresh_start)
            else:
                self._prepare_folder(estimated_bytes, fresh_start)
        except BaseException:
            self.close()
            raise

    def _prepare_folder(self, estimated_bytes, fresh_start):
        env = self.env
        token, main_directory = distributed.decided_on_rank_0(
            env, lambda: (self._check_folder(estimated_bytes, fresh_start), self.directory), SnapshotError
        )
        probe = os.path.join(self.directory, f".probe-{token}")
        visible = _eventually(lambda: os.path.exists(probe))
        # every rank learns who does not see the folder, so each says the same
        views = distributed.all_gather_object(env, (env.rank, visible, self.directory))
        blind = [f"rank {rank} does not, looking in {directory}" for rank, seen, directory in views if not seen]
        distributed.barrier(env)
        if env.is_main:
            os.remove(probe)
        if blind:
            raise SnapshotError(
                f"not every rank sees the snapshot folder {main_directory} that rank 0 writes to "
                f"({cut_short(blind, 3, '; ')}): on several machines, --snapshot-dir must be a folder they all share"
            )

    def _prepare_store(self, fresh_start):
        """Rank 0 takes the store's prefix (store.Store.open); every rank starts an empty staging folder."""
        store = cast(Store, self.store)

        def take() -> str:
            try:
                store.open(self.job, fresh_start)
                return cast(StoreLock, store.lock).owner
            except SnapshotError:
                raise
            except joblock.JobLockError as exc:
                raise SnapshotError(str(exc)) from exc
            except Exception as exc:  # the store's own error
                raise SnapshotError(f"cannot use the store {store.url}: {first_line(exc)}") from exc

        owner = distributed.decided_on_rank_0(self.env, take, SnapshotError)
        if not self.env.is_main:  # rank 0's was emptied once it held the lock
            store.lock_owner = owner
            shutil.rmtree(self.directory, ignore_errors=True)
            os.makedirs(self.directory)
        self.uploads = Uploader(store, self.env.rank, self.keep, self.commit_timeout)

    def _manifest(self, step: int) -> dict | None:
        """The checked manifest of the committed snapshot of `step`, or None where it does not check out."""
        if self.store is not None:
            return self.store.read_manifest(step)
        try:
            return read_manifest(self.step_folder(step))
        except SnapshotError:
            return None

    def size(self, step: int) -> int:
        """The bytes of the committed snapshot of `step`, as its checked manifest lists them (0 where there is none)."""
        manifest = self._manifest(step)
        return sum(entry["size"] for entry in manifest["files"].values()) if manifest else 0

    def keep_beside(self, name: str) -> None:
        """Rank 0, on a store: upload a file written beside the snapshots (the run id, stop.py's record) too."""
        if self.store is not None and self.env.is_main:
            path = os.path.join(self.directory, name)
            self.store.upload(path, name, file_entry(path))

    def _check_folder(self, estimated_bytes, fresh_start):
        """Rank 0's part of prepare(): the token of the probe file it writes; SnapshotError naming a problem."""
        token = secrets.token_hex(6)
        try:
            os.makedirs(self.directory, exist_ok=True)
            self.job_lock = joblock.JobLock(self.directory)
            self.job_lock.acquire()
            self._commit_finished_saves()  # before a fresh start decides what to move aside: it moves them too
            problem = self._start_fresh() if fresh_start else None
            if problem:
                raise SnapshotError(problem)
            remove_leftovers(self.directory)
            write_json_atomic(os.path.join(self.directory, f".probe-{token}"), {"token": token})
            free = shutil.disk_usage(self.directory).free
            if free < estimated_bytes:
                raise SnapshotError(
                    f"not enough room for a snapshot in {self.directory}: {free / 2**20:.0f} MiB free, one "
                    f"snapshot needs about {estimated_bytes / 2**20:.0f} MiB"
                )
            if free < estimated_bytes * (self.keep + 1):
                log.warning(
                    "%s has room for fewer than %d snapshots (%.0f MiB free, about %.0f MiB each)",
                    self.directory,
                    self.keep + 1,
                    free / 2**20,
                    estimated_bytes / 2**20,
                )
            remove_interrupted_saves(self.directory)
        except joblock.JobLockError as exc:
            raise SnapshotError(str(exc)) from exc
        except OSError as exc:
            raise SnapshotError(f"cannot write snapshots to {self.directory}: {exc.strerror or exc}") from exc
        self.job_lock.start_heartbeat()
        return token

    def _start_fresh(self):
        """Move the folder's snapshots aside for a fresh start, unless this job wrote them; a problem or None."""
        committed = list_steps(self.directory)[0]
        if not committed:
            return None
        newest_job = next((manifest["job"] for manifest in map(self._manifest, committed) if manifest), None)
        if self.job and newest_job == self.job:
            log.info(
                "%s holds snapshots of this same torchrun job (%s): this is a restart, resuming from them",
                self.directory,
                self.job,
            )
            return None
        real = os.path.realpath(self.directory)  # a link to the folder stays, pointing at the new, empty one
        aside = f"{real}.set-aside-{time.strftime('%Y%m%d-%H%M%S')}"
        candidate, suffix = aside, 1
        while os.path.lexists(candidate):
            suffix += 1
            candidate = f"{aside}-{suffix}"
        try:
            os.rename(real, candidate)
            os.makedirs(real)
        except OSError as exc:
            return (
                f"cannot start afresh: moving {real} aside to {candidate} failed "
                f"({exc.strerror or exc}); move or delete what it holds yourself, or resume from it with "
                "--resume auto"
            )
        self.job_lock.acquire()  # in the new, empty folder; the old lock file moved aside with the rest
        try:
            os.remove(os.path.join(candidate, joblock.LOCK_FILE))
        except FileNotFoundError:
            pass  # nothing to tidy
        log.warning(
            "starting afresh: moved what %s held (snapshots up to step %d) aside to %s",
            self.directory if real == self.directory else f"{self.directory} (a link to {real})",
            committed[0],
            candidate,
        )
        return None

    def _commit_finished_saves(self):
        """Commit the saves whose every part was written but whose job ended before committing them (a rank
        SIGKILLed after a snapshot step: each rank writes its own part before its next step). The rest is left to
        remove_interrupted_saves."""
        for step in list_steps(self.directory)[1]:
            folder = self.step_folder(step)
            try:
                manifest = receipts_manifest(folder, step, folder)
                for name in manifest["files"]:
                    check_file(folder, manifest, name)
            except SnapshotError as exc:
                log.debug("not committing %s: %s", folder, exc)
                continue
            write_json_atomic(os.path.join(folder, MANIFEST), manifest)
            log.info("committed %s: every rank's part of it was written before its job ended", folder)

    def resume(self) -> dict | None:
        """The newest snapshot good for every rank, loaded on every rank; None when the folder holds none. Each rank
        checks the files it needs (from a store, downloaded to its staging folder first); all ranks move to the next
        older one together unless every rank found its files good."""
        env, store = self.env, self.store
        if store is not None:  # rank 0 lists the store: every rank walks the same steps
            committed = distributed.broadcast_object(env, store.steps()[0] if env.is_main else None)
        else:
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

        def load(step: int) -> dict:
            if store is not None and (reason := store.pull(step, self.directory)):
                raise SnapshotError(reason)
            step_path = self.step_folder(step)
            same_world = read_manifest(step_path)["world_size"] == env.world_size
            # Each rank checks its share of a sharded snapshot's files; together they check all of them.
            return load_step(step_path, [env.rank] if same_world else [], (env.rank, env.world_size))

        agree = lambda ok: distributed.all_true(env, ok)  # noqa: E731
        where = store.url if store else self.directory
        state, skipped = newest_usable(committed, load, where, agree, f". {DAMAGED_ADVICE}")
        if state is None:
            return None
        self._set_aside(skipped)
        state["rank_state"] = state["rank_states"].get(env.rank)
        return state

    def _set_aside(self, steps):
        """Rename damaged snapshots out of the way, kept for a post-mortem (on a store, where they stay, remove their
        downloaded copies)."""
        if self.store is not None:
            for step in steps:
                shutil.rmtree(self.step_folder(step), ignore_errors=True)
            return
        if self.env.is_main:
            stamp = time.strftime("%Y%m%d-%H%M%S")
            for step in steps:
                path = self.step_folder(step)
                os.replace(path, f"{path}.damaged-{stamp}")
                log.warning("moved the damaged snapshot %s aside to %s.damaged-%s", path, path, stamp)
        distributed.barrier(self.env)

    def close(self) -> None:
        """Give the folder up: rank 0 releases the job lock. Call wait() first to finish a save in flight: close()
        does not wait for it (after a failure it might never finish), and it is not committed after close()."""
        self._closed = True
        if self.uploads is not None:
            self.uploads.closed = True
        if self.store is not None:
            self.store.close()
        if self.job_lock is not None:
            self.job_lock.release()
            self.job_lock = None

    def _prune(self):
        """Keep the newest `keep` snapshots, and those whose frozen parameters a kept one refers to (frozen.py)."""
        committed, _ = list_steps(self.directory)
        needed = set(committed[: self.keep])
        for step in committed[: self.keep]:
            if manifest := self._manifest(step):  # one that does not check out is never loaded: it needs nothing
                needed.add(manifest.get("frozen_in", step))
        for step in committed:
            if step not in needed:
                folder = self.step_folder(step)
                os.remove(os.path.join(folder, MANIFEST))  # uncommit first: a half-removed folder is never loaded
                shutil.rmtree(folder, ignore_errors=True)


def remove_leftovers(directory):
    """Remove probe files and run-id temp files of start-ups that died half-way (we hold the lock)."""
    for name in os.listdir(directory):
        if name.startswith(".probe-") or name.startswith(f"{RUN_FILE}.tmp-"):
            path = os.path.join(directory, name)
            if os.path.isfile(path):
                log.debug("removing %s, left by an earlier start-up", path)
                os.remove(path)


def remove_interrupted_saves(directory):
    committed, incomplete = list_steps(directory)
    for step in incomplete:
        log.info("removing %s: an interrupted save", os.path.join(directory, step_name(step)))
        shutil.rmtree(os.path.join(directory, step_name(step)), ignore_errors=True)
    for step in committed:
        folder = os.path.join(directory, step_name(step))
        for name in os.listdir(folder):
            if ".tmp-" in name:
                os.remove(os.path.join(folder, name))
