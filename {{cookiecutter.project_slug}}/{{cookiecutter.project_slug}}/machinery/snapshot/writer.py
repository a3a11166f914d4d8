"""Saving: a snapshot copied off the training thread, written in the background by every rank, committed by rank 0
once every rank's receipt is in, then old ones pruned."""

import datetime
import errno
import logging
import math
import os
import threading
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from .. import distributed
from .folder import SnapshotFolder
from .format import (
    MANIFEST,
    SHARDED_DIR,
    SHARED,
    SnapshotError,
    file_entry,
    rank_file,
    receipt_file,
    receipts_manifest,
    shard_of,
    write_atomic,
    write_json_atomic,
)
from .staging import DeviceCopies, copy_to_cpu, join_dtensors, split_dtensors

log = logging.getLogger(__name__)


def _errno_in_chain(error: BaseException) -> int | None:
    """The first errno among an exception and those it was raised from or during (torch.save wraps the
    OSError of a failed write in a RuntimeError such as "[enforce fail at inline_container.cc] unexpected pos")."""
    pending: list[BaseException | None] = [error]
    seen: set[int] = set()
    while pending:
        exc = pending.pop(0)
        if exc is None or id(exc) in seen:
            continue
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno:
            return exc.errno
        pending += [exc.__cause__, exc.__context__]
    return None


class Snapshots(SnapshotFolder):
    """Saves and finds snapshots for one job. Every rank holds one; collectives are called on every rank.

    Why not torch.distributed.checkpoint (DCP) for everything: under DDP every rank holds the whole model, so one
    file by rank 0 plus a small file per rank is all a snapshot needs; DCP gives no commit marker after every rank's
    part, no checksums with fallback, no copies off the training thread. Under fsdp (`sharded`) each rank's shards
    are written with DCP (which reshards them for another number of ranks) under the same receipts and marker.
    """

    def __init__(
        self,
        directory: str,
        env: distributed.DistEnv,
        keep: int,
        commit_timeout: float = 600.0,
        sharded: bool = False,
        copy: bool = True,
    ):
        """`copy`: the state is copied into staging buffers, and training goes on while the copy is written; else
        the writer serializes the CPU tensors of the state itself, and wait_until_copied() waits for the write."""
        super().__init__(directory, env, keep)
        self.copy = copy
        # DCP's collectives run on the writer thread while training runs its own: they need a group of their own.
        timeout = datetime.timedelta(seconds=commit_timeout)
        self._group = dist.new_group(backend="gloo", timeout=timeout) if sharded and env.is_distributed else None
        self.commit_timeout = commit_timeout
        self._thread: threading.Thread | None = None
        self._copied = threading.Event()
        self._copied.set()
        self._error: BaseException | None = None
        self._staging: dict[Any, torch.Tensor] = {}  # CPU buffers the writer copies into, kept between saves
        self._pinned: dict[tuple, torch.Tensor] = {}  # pinned CPU buffers for CUDA tensors, kept likewise
        self._copy_streams: dict[torch.device, torch.cuda.Stream] = {}  # a side stream per CUDA device
        self._device_copies: DeviceCopies | None = None  # the save in flight's CUDA copies, until ordered
        self._give_up_at = math.inf  # when rank 0 stops waiting for the other ranks' parts (see finish_after_failure)
        self._said_late = False  # a WARNING said that snapshots come late (skip, or a save behind an upload)

    def save(
        self,
        step: int,
        shared: dict | None,
        rank_state: dict,
        blocking: bool = False,
        sharded_state: dict | None = None,
        frozen_in: int | None = None,
    ) -> None:
        """Start writing a snapshot of `step` in the background, after the one in flight. `shared` (rank 0's model,
        optimizer, ...) may hold live tensors: the writer thread copies them, and the caller must call
        wait_until_copied() before anything changes them in place. `frozen_in`: the step whose snapshot holds the
        model's frozen parameters (this one's, or an older one's when `shared` leaves them out; see frozen.py)."""
        if self.uploading():
            self._late(step, "waits for the one before to be uploaded: the store is slow")
        self._wait_written()  # not for uploads to a store: they go on in the background (store.py)
        shared = shared if self.env.is_main else None
        own = self._as_save_failure(
            lambda: self._write_own_part(step, rank_state, alone=shared is None and sharded_state is None)
        )
        device_copies = DeviceCopies(self._pinned, self._copy_streams)
        shards, layouts = split_dtensors(sharded_state) if sharded_state is not None else (None, {})
        if torch.cuda.is_initialized():  # no CUDA tensor can exist before CUDA is initialized
            device_copies.start({("shared",): shared, ("sharded",): shards})
        self._device_copies = device_copies
        self._copied.clear()
        args = (step, shared, own, device_copies, shards, layouts, frozen_in)
        self._thread = threading.Thread(target=self._write, args=args, name=f"snapshot-{step}", daemon=True)
        self._thread.start()
        if blocking:
            self.wait()

    def wait_until_copied(self) -> None:
        """Return once the save in flight has copied the state (without a copy: written it); call it before the
        optimizer changes the weights.
        For CUDA tensors, "copied" means ordered on the device: work enqueued from here on runs after the copies."""
        self._copied.wait()
        if self._device_copies is not None:
            self._device_copies.order_training_stream()
            self._device_copies = None
        self._raise_error()

    def uploading(self) -> bool:
        """Whether this rank still stages or uploads an earlier snapshot to the store (False for a local folder)."""
        staging = self._thread is not None and self._thread.is_alive()
        return self.uploads is not None and (staging or self.uploads.busy())

    def skip(self, step: int) -> None:
        """Leave out the snapshot of `step`: an earlier one is still being uploaded (every rank alike)."""
        self._late(
            step,
            "is skipped: the one before is still being uploaded (uploads are slower than the snapshot "
            "steps); the next snapshot step saves",
        )

    def _late(self, step: int, what: str) -> None:
        """Say that snapshots come late: WARNING the first time (rank 0), DEBUG after."""
        level = logging.WARNING if not self._said_late and self.env.is_main else logging.DEBUG
        self._said_late = True
        where = self.store.url if self.store else self.directory
        log.log(level, "the snapshot of step %d to %s %s; training goes on", step, where, what)

    def wait(self) -> None:
        """Return once the save in flight is written (and, on rank 0, committed); raise if it failed."""
        self._wait_written()
        if self.uploads is not None:
            self._as_save_failure(self.uploads.drain)

    def release_buffers(self) -> None:
        """Let the staging buffers go, once the run saves no more snapshots: they hold a copy of this rank's state
        (its shards under fsdp), room the export after the last save needs to gather the whole model on rank 0."""
        self._wait_written()
        self._staging.clear()
        self._pinned.clear()

    def _wait_written(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._device_copies = None  # the writer waited for them (or failed before they mattered)
        self._raise_error()
        if self.uploads is not None:
            self._as_save_failure(self.uploads.raise_error)

    def _as_save_failure(self, call: Any) -> Any:
        """`call()`, with an error it raises told as a failed save (SnapshotError, in words)."""
        try:
            return call()
        except Exception as exc:
            raise self._failure(exc) from exc

    def finish_after_failure(self, grace: float) -> None:
        """After a failure: give the save in flight up to `grace` seconds to be written and committed, so that an
        error soon after a snapshot step does not lose it. A save that fails then is logged, not raised: the failure
        that ended the run is the one to report."""
        self._give_up_at = time.monotonic() + grace
        if self._thread is not None:
            self._thread.join(grace + 1.0)
            if self._thread.is_alive():  # stuck in a collective with a rank that is gone: the commit never comes
                log.debug("the snapshot in flight was not written within %.0f s of the failure", grace)
            self._thread = None
        self._device_copies = None
        error, self._error = self._error, None
        if error is None and self.uploads is not None:
            try:
                self.uploads.drain(grace)
            except Exception as exc:
                error = exc
        if error is not None:
            log.debug("the snapshot in flight was not committed: %s", error)

    def _raise_error(self):
        if self._error is not None:
            error, self._error = self._error, None
            raise self._failure(error) from error

    def _failure(self, error: BaseException) -> SnapshotError:
        """A failed save, in words: what to do about a full disk or quota, else the error itself."""
        advice: dict[int | None, str] = {
            errno.ENOSPC: f"no space left on {self.directory}; free some space there or keep fewer snapshots "
            "(--keep-snapshots)",
            errno.EDQUOT: f"disk quota exceeded on {self.directory}; free some space there or raise the quota",
        }
        return SnapshotError(f"saving a snapshot failed: {advice.get(_errno_in_chain(error), str(error))}")

    def _write_own_part(self, step: int, rank_state: dict, alone: bool) -> dict | None:
        """Write this rank's own (small) part now, on the training thread: a SIGKILL of this rank during the next
        step cannot lose the snapshot. `alone`: the rank writes nothing else, so its receipt goes too (None
        returned); else the part's receipt entries, for the receipt the writer thread writes after the rest."""
        folder = self.step_folder(step)
        os.makedirs(folder, exist_ok=True)
        rank, rank_state = self.env.rank, copy_to_cpu(rank_state, self._staging, ("rank",))
        files = {
            rank_file(rank): write_atomic(os.path.join(folder, rank_file(rank)), lambda f: torch.save(rank_state, f))
        }
        if not alone:
            return files
        self._write_receipt(folder, files)
        return None

    def _write_receipt(self, folder: str, files: dict, frozen_in: int | None = None) -> None:
        """This rank's receipt: what a commit (also at the next start) needs."""
        receipt = {"rank": self.env.rank, "files": files, "world_size": self.env.world_size, "job": self.job}
        if frozen_in is not None:
            receipt["frozen_in"] = frozen_in
        write_json_atomic(os.path.join(folder, receipt_file(self.env.rank)), receipt)

    def _write(self, step, shared, own, device_copies, shards=None, layouts=None, frozen_in=None):
        try:
            try:
                staged, used, live = device_copies.staged, set(), set()
                staging = self._staging if self.copy else None
                shared = copy_to_cpu(shared, staging, ("shared",), staged, used, live) if shared is not None else None
                shards = copy_to_cpu(shards, staging, ("sharded",), staged, used, live) if shards is not None else None
                # A buffer this save did not use (the frozen parameters after the snapshot that holds them) goes;
                # this rank's own part was copied on the training thread, into buffers of its own.
                used |= {place for place in self._staging if place[:1] == ("rank",)}
                for buffers, kept in ((self._staging, used), (self._pinned, staged)):
                    for place in [place for place in buffers if place not in kept]:
                        del buffers[place]
            finally:
                if not live:  # copied (GPU tensors: into pinned memory, with or without --no-snapshot-copy)
                    self._copied.set()
            device_copies.wait()
            folder = self.step_folder(step)
            if own is not None:  # this rank's receipt waits for its other files
                files = dict(own)
                if shared is not None:
                    files[SHARED] = write_atomic(os.path.join(folder, SHARED), lambda f: torch.save(shared, f))
                if shards is not None:
                    files.update(self._write_shards(folder, join_dtensors(shards, layouts)))
                self._write_receipt(folder, files, frozen_in)
            self._copied.set()  # without a copy, the state itself is written now: the optimizer may change it
            if self.uploads is not None:  # the store: each rank uploads its part, rank 0 commits (store.py)
                self.uploads.submit(step)
            elif self.env.is_main:
                self.commit(folder, step)
        except BaseException as exc:  # handed to the training thread by wait() or wait_until_copied()
            self._error = exc
            self._copied.set()

    def commit(self, folder, step):
        """Rank 0, on the writer thread: write the manifest once every rank's receipt is in, then prune."""
        deadline = time.monotonic() + self.commit_timeout

        def arrives(rank):
            path = os.path.join(folder, receipt_file(rank))
            while not os.path.exists(path):  # finish_after_failure may give up on the save meanwhile
                if time.monotonic() > min(deadline, self._give_up_at):
                    break
                time.sleep(0.01)
            if not os.path.exists(path):
                raise SnapshotError(
                    f"rank {rank}'s part of {folder} did not appear within {self.commit_timeout:.0f} s: is "
                    "--snapshot-dir a folder every machine shares?"
                )

        manifest = receipts_manifest(folder, step, folder, arrives)
        if self._closed:
            raise SnapshotError(f"not committing {folder}: the snapshot folder was closed while it was written")
        if self.job_lock is not None and self.job_lock.lost:
            raise SnapshotError(f"not committing {folder}: {self.job_lock.lost}")
        write_json_atomic(os.path.join(folder, MANIFEST), manifest)
        log.debug("snapshot %s committed", folder)
        self._prune()

    def _write_shards(self, folder, state):
        """DCP writes this rank's shards (rank 0 also the metadata) on the snapshot group; their receipt entries."""
        sharded = os.path.join(folder, SHARDED_DIR)
        dcp.save(state, storage_writer=dcp.FileSystemWriter(sharded, sync_files=True), process_group=self._group)
        receipts = {
            f"{SHARDED_DIR}/{name}": file_entry(os.path.join(sharded, name))
            for name in sorted(os.listdir(sharded))
            if shard_of(f"{SHARDED_DIR}/{name}") == self.env.rank
        }
        if self.env.is_main and f"{SHARDED_DIR}/.metadata" not in receipts:
            raise SnapshotError(f"{sharded}: torch.distributed.checkpoint wrote no .metadata")
        return receipts
