"""Replica groups that keep training when one fails (`--fault-tolerance torchft`, opt-in), built on torchft.

Each replica group is a torchrun job of its own (DDP among its ranks, its own restarts); torchft forms a quorum of
the live groups at every step and averages gradients and floating-point buffers across them. When a rank dies only
its group restarts, taking a live group's state over the network. docs/replica-groups.md has the details; launch:

    torchft_lighthouse --min_replicas 1 --join_timeout_ms 1000 --heartbeat_timeout_ms 500 &   # one per job
    export TORCHFT_LIGHTHOUSE=http://HOST:29510 NUM_REPLICA_GROUPS=2
    REPLICA_GROUP_ID=0 torchrun --standalone --nproc_per_node=N --max-restarts=3 train.py --fault-tolerance torchft &
    REPLICA_GROUP_ID=1 torchrun --standalone --nproc_per_node=N --max-restarts=3 train.py --fault-tolerance torchft

A step: the quorum forms in torchft's thread while the step computes; each DDP bucket, averaged within the group, is
averaged over the groups (a communication hook); then the buffers, then torchft says whether the step commits.
Token-weighted losses: averaged over the group's tokens, then over the groups equally.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import os
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_map

from . import distributed, identity
from .debug import postmortem_requested
from .distributed import DistEnv
from .partners import Partners
from .settings import RunError, flag

log = logging.getLogger(__name__)

MODES = ("off", "torchft")
LIGHTHOUSE = "TORCHFT_LIGHTHOUSE"
GROUP_ID = "REPLICA_GROUP_ID"
GROUPS = "NUM_REPLICA_GROUPS"
# How long a gradient average or a state transfer between groups may take before it counts as failed, and the step
# is dropped. A group that dies mid-step closes its sockets, which the others notice at once; this bounds a group
# that hangs, or one that dies while the groups connect to each other after the quorum changed.
TIMEOUT = datetime.timedelta(seconds=30)
CONNECT_TIMEOUT = datetime.timedelta(seconds=60)  # torchft's own default, for reaching the lighthouse
EXIT_GRACE = 3.0  # seconds a failed run's process may take to exit before it leaves without torchft's threads


@dataclasses.dataclass(frozen=True)
class GroupInfo:
    group: int
    groups: int
    lighthouse: str


def requested(cfg: Any) -> bool:
    return getattr(cfg, "fault_tolerance", "off") == "torchft"


def group_info() -> GroupInfo:
    """This replica group's id, the number of groups and the lighthouse, from torchft's environment variables."""
    lighthouse = os.environ.get(LIGHTHOUSE, "")
    if not lighthouse:
        raise RunError(
            f"{flag('fault_tolerance')} torchft needs {LIGHTHOUSE}=http://HOST:PORT, the address of a running "
            "torchft_lighthouse (one per job; see machinery/replicas.py)"
        )
    values = {}
    for name in (GROUP_ID, GROUPS):
        text = os.environ.get(name, "")
        try:
            values[name] = int(text)
        except ValueError:
            raise RunError(
                f"{flag('fault_tolerance')} torchft needs {name} set to an integer, found {text!r} "
                f"({GROUP_ID}: this group's id, 0 to {GROUPS} - 1)"
            ) from None
    group, groups = values[GROUP_ID], values[GROUPS]
    if groups < 1 or not 0 <= group < groups:
        raise RunError(f"{GROUP_ID}={group} with {GROUPS}={groups}: the id must be 0 to {GROUPS} - 1")
    if "MASTER_ADDR" not in os.environ:
        raise RunError(
            f"{flag('fault_tolerance')} torchft runs each replica group under torchrun: "
            "torchrun --standalone --nproc_per_node=N train.py --fault-tolerance torchft"
        )
    return GroupInfo(group, groups, lighthouse)


def per_group_paths(cfg: Any, group: int) -> None:
    """Give the group its own snapshot folder, export folder, metrics file and log file (in place)."""
    tag = f"group{group}"
    cfg.snapshot_dir = os.path.join(cfg.snapshot_dir, tag)
    cfg.export_dir = os.path.join(cfg.export_dir, tag)
    for name in ("metrics_file", "log_file"):
        path = getattr(cfg, name)
        if path:
            stem, suffix = os.path.splitext(path)
            setattr(cfg, name, f"{stem}.{tag}{suffix}")
    if group != 0:
        cfg.wandb = "disabled"


def check_supported(cfg: Any, stream: bool) -> None:
    if cfg.strategy != "ddp":
        raise RunError(
            f"{flag('fault_tolerance')} torchft works with {flag('strategy')} ddp only (each replica group holds the "
            "whole model)"
        )
    if stream:
        raise RunError(
            f"{flag('fault_tolerance')} torchft needs map-style training data: a stream's place is each rank's own, "
            "and a restarted group could not take it over from a live one"
        )


class ReplicaGroup(Partners):
    """This job as one replica group of several (partners.py's hooks), through torchft's Manager: a quorum of the
    live groups per step, their gradient average, and a live group's state (the snapshot's shared parts) taken
    after a restart (`_state_for_others` on the live group, `_take_live_state` on the restarted one)."""

    alone = False

    def __init__(self, cfg: Any):
        self.info = group_info()
        per_group_paths(cfg, self.info.group)
        self._first = True
        self._pending: list[_Bucket] = []  # this step's gradient buckets, as DDP handed them over
        self._ddp_group: Any = None
        self._skipping = False
        self.token_weighted = False  # set by a (sum, count) loss: the gradients are averaged after they are scaled
        self._closed = threading.Event()
        self._progress_at_quorum: dict[str, Any] = {}  # the data position a live group passes on

    def data_env(self, cfg: Any, env: DistEnv, stream: bool) -> DistEnv:
        """This rank's share of each step's data is among every group's ranks."""
        check_supported(cfg, stream)
        ranks = env.world_size
        return dataclasses.replace(env, rank=self.info.group * ranks + env.rank, world_size=self.info.groups * ranks)

    def join(self, trainer: Any) -> None:
        """From here on, the groups meet at every step: start torchft's Manager, average DDP's gradient buckets over
        the groups during backward, and leave at once when a rank of this group dies."""
        self.trainer, self.env = trainer, trainer.env
        self._start_manager(trainer.progress.step, distributed.collective_timeout(trainer.cfg))
        self._progress_at_quorum = dataclasses.asdict(trainer.progress)
        self.attach(trainer.parallel.distributed)  # the groups average the gradients during backward
        distributed.barrier(self.env)  # every rank of the group is up before each starts watching the others
        self.watch_siblings()

    def _start_manager(self, step: int, quorum_timeout: datetime.timedelta) -> None:
        info, env = self.info, self.env
        os.environ.setdefault("RUST_LOG", "warn")  # torchft's own (Rust) side logs every quorum at INFO
        try:
            import torchft
        except ImportError as exc:
            raise RunError(
                f"{flag('fault_tolerance')} torchft needs the torchft package: pip install torchft "
                f"(or the project's [ft] extra); importing it failed: {exc}"
            ) from None
        for name in ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors"):
            # torchft logs every step at INFO, CUDA-only warnings, and a peer's failure as an error with a traceback
            # on every rank: this class says what happened instead, once per group
            logging.getLogger(name).setLevel(logging.CRITICAL)
        # torchft's state transfer reads tensors from a read-only buffer, which torch warns about on every transfer
        warnings.filterwarnings("ignore", "The given buffer is not writable", UserWarning)
        self._quorum_timeout = quorum_timeout
        store_host, store_port = distributed.store_address()
        kind = torchft.ProcessGroupNCCL if env.device.type == "cuda" else torchft.ProcessGroupGloo
        self._pg = pg = kind(timeout=TIMEOUT)
        connect = min(CONNECT_TIMEOUT, quorum_timeout)  # to reach the lighthouse (or the group's rank 0)
        try:
            self.manager = torchft.Manager(
                pg=pg,
                load_state_dict=self._take_live_state,
                state_dict=self._state_for_others,
                min_replica_size=1,
                # The quorum is formed while the step computes (torchft's default), and a group that is behind fetches
                # a live group's state meanwhile. It takes that state at the end of the step (should_commit), after
                # the step's data was drawn: its share of that step counts as zero in the groups' average.
                use_async_quorum=True,
                replica_id=f"group{info.group}",
                rank=env.rank,
                world_size=env.world_size,
                # This attempt's own store, not torchrun's, which keeps the keys of a failed attempt (the address of
                # its dead manager server) across restarts
                store_addr=store_host,
                store_port=store_port,
                timeout=TIMEOUT,
                quorum_timeout=quorum_timeout,  # how long a group waits for the others to form a quorum: --dist-timeout
                connect_timeout=connect,
                init_sync=False,  # every group builds the same initial weights from --seed
            )
        except RuntimeError as exc:
            # Rank 0 of the group connects to the lighthouse (the others to their rank 0, which names another address)
            if "failed to connect" not in str(exc) or info.lighthouse not in str(exc):
                raise
            raise RunError(
                f"replica group {info.group} could not reach the torchft lighthouse at {LIGHTHOUSE}={info.lighthouse} "
                f"within {connect.total_seconds():g} s ({_first_line(exc).rsplit(': ', 1)[-1][:200]}): start it first "
                "(one per job: torchft_lighthouse --min_replicas 1 --join_timeout_ms 1000 --heartbeat_timeout_ms 500 "
                "--bind [::]:PORT), or correct the address"
            ) from None
        self.manager.load_state_dict({"step": step, "batches_committed": step * info.groups})

    def start_step(self, stopping: Callable[[], bool]) -> bool:
        """The quorum for this step (a group that is behind takes a live group's state here). False: a rank of the
        group was asked to stop while the group waited for the others at its first step."""
        self._progress_at_quorum = dataclasses.asdict(self.trainer.progress)
        self.manager.start_quorum()
        if self._first:
            self._first = False
            return self._wait_for_every_group(stopping)
        return True

    def _wait_for_every_group(self, stopping: Callable[[], bool]) -> bool:
        """A job's groups start together: at its first step, a group that finds none ahead of it waits up to the
        quorum timeout for every group, then goes on with those there; one that finds others ahead (or that torchrun
        restarted) joins whoever trains. A stop request ends the wait once the quorum being formed is there: False."""
        if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
            return True
        start, groups = self.manager.current_step(), self.info.groups
        deadline = time.monotonic() + self._quorum_timeout.total_seconds()

        def alone() -> bool:  # fewer groups than the job's, and none has trained yet
            self._wait_quorum()
            return self.manager.num_participants() < groups and self.manager.current_step() == start

        def waiting() -> bool:  # the group's ranks decide together (their deadlines differ by a little)
            return distributed.all_true(self.env, alone() and time.monotonic() < deadline and not stopping())

        waited = waiting()
        if waited:
            here = self.manager.num_participants()
            log.info("replica group %s waiting for the other replica groups (%s of %s)", self.info.group, here, groups)
            while waiting():
                time.sleep(0.1)
                self.manager.start_quorum()
        go_on = distributed.all_true(self.env, not stopping())
        if waited and go_on and alone():
            here = self.manager.num_participants()
            log.warning(
                "replica group %s starts with %s of %s replica groups: the others did not join within %s",
                self.info.group,
                here,
                groups,
                self._quorum_timeout,
            )
        return go_on

    def attach(self, ddp: Any) -> None:
        """Average the gradients over the groups during backward, bucket by bucket as DDP fills them."""
        from torch.nn.parallel import DistributedDataParallel

        if not isinstance(ddp, DistributedDataParallel):
            raise TypeError(f"replica groups average DDP's gradient buckets, got {type(ddp).__name__}")
        self._ddp_group = ddp.process_group
        # (a lambda: DDP checks the annotations of a hook's arguments, and this module's are strings)
        ddp.register_comm_hook(None, lambda state, bucket: self._comm_hook(bucket))

    def _comm_hook(self, bucket: Any) -> Any:
        """A DDP gradient bucket is ready: start its average over the group's ranks and over the replica groups
        (waited for in average_and_commit); DDP gets it back at once, its gradients views the average lands in."""
        import torch.distributed as dist
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        buffer = bucket.buffer()
        ranks = self.env.world_size
        if self._skipping:  # a backward whose gradients are thrown away (DistributedModel.settle_bucket_order)
            return _ready(buffer)
        if self.token_weighted:  # the groups' average waits until the step's gradients are scaled (_average_flat)
            return default_hooks.allreduce_hook(self._ddp_group, bucket) if ranks > 1 else _ready(buffer)
        pending = _Bucket(buffer)
        if ranks > 1:
            buffer.div_(ranks)  # first, as DDP does
            pending.group_work = dist.all_reduce(buffer, group=self._ddp_group, async_op=True)
        self._pending.append(pending)
        self._start_between_groups(wait=False)
        return _ready(buffer)

    @contextlib.contextmanager
    def skip_averaging(self) -> Iterator[None]:
        self._skipping = True
        try:
            yield
        finally:
            self._skipping = False

    def before_backward(self, token_weighted: bool) -> None:
        self.token_weighted = token_weighted

    def _start_between_groups(self, wait: bool) -> None:
        """Start the groups' average of the buckets whose average within the group is done, in bucket order (the
        same in every group); `wait`: of every bucket, waiting for the group's own average where it runs."""
        for pending in self._pending:
            if pending.work is not None:
                continue
            if pending.group_work is not None:
                if not wait and not pending.group_work.is_completed():
                    return
                pending.group_work.wait()
            self._wait_quorum()
            pending.work = self.manager.allreduce(pending.buffer)  # an error is recorded, not raised

    def _wait_quorum(self) -> None:
        """This step's quorum (formed meanwhile in torchft's thread); none within --dist-timeout is one line."""
        try:
            self.manager.wait_quorum()
        except TimeoutError:
            raise RunError(
                f"replica group {self.info.group}: no quorum of the replica groups within {flag('dist_timeout')} "
                f"({self._quorum_timeout.total_seconds():g} s): the torchft lighthouse at {LIGHTHOUSE}="
                f"{self.info.lighthouse} stopped answering, or it waits for more groups than are running (its "
                "--min_replicas); start it again if it is gone, then launch the groups again to resume"
            ) from None

    def average_and_commit(self, model: torch.nn.Module) -> bool:
        """Finish the gradients' average over the live groups (started during backward) and average the
        floating-point buffers (BatchNorm's statistics), so every group holds the same model. False: the step is
        dropped (a group failed during it)."""
        self._wait_quorum()
        try:
            if self._pending:
                self._start_between_groups(wait=True)
                for pending in self._pending:
                    pending.work.wait()  # an error is recorded, not raised: should_commit says False
            else:  # token-weighted: the gradients scaled within the group after backward
                trained = [parameter for parameter in model.parameters() if parameter.requires_grad]
                for parameter in trained:
                    if parameter.grad is None:  # unused in this group's batch: zero, as DDP treats it
                        parameter.grad = torch.zeros_like(parameter)
                self._average_flat([parameter.grad for parameter in trained])
            self._average_flat([buffer.data for buffer in model.buffers() if buffer.is_floating_point()])
        finally:
            self._pending = []
            self.token_weighted = False
        committed = self.manager.should_commit()
        if not committed and self.env.rank == 0:
            error = self.manager.errored()
            cause = getattr(error, "original_exception", error) if error is not None else "another group's"
            log.warning(
                "replica group %s: step %s dropped, to be taken again (a replica group failed during it: %s)",
                self.info.group,
                self.manager.current_step() + 1,
                _first_line(cause)[:200],
            )
        return committed

    def _average_flat(self, tensors: list) -> None:
        """Average tensors over the groups in one all-reduce per dtype and device, through a flat copy."""
        by_kind: dict[tuple, list] = {}
        for tensor in tensors:
            by_kind.setdefault((tensor.dtype, tensor.device), []).append(tensor)
        for same in by_kind.values():
            flat = torch.cat([tensor.reshape(-1) for tensor in same])
            self.manager.allreduce(flat).wait()  # an error is recorded, not raised: should_commit says False
            offset = 0
            for tensor in same:
                tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
                offset += tensor.numel()

    def watch_siblings(self) -> None:
        """Leave at once when another rank of this group on this machine dies: torchrun restarts the broken group,
        but a rank blocked in torchft's average or commit would stay until TIMEOUT, heartbeating, and the other
        groups would wait for it all that time. Ranks on other machines are left to that timeout."""
        parent = identity.agent_pid()
        siblings = [pid for pid in _children(parent) if pid != identity.worker_pid()]
        if not siblings or not identity.torchrun_worker():
            return

        def watch() -> None:
            while not self._closed.wait(0.1):
                for pid in siblings:
                    if not _is_child(pid, parent):
                        log.error(
                            "replica group %s: rank process %s of this group is gone: leaving at once, so that "
                            "torchrun restarts the group",
                            self.info.group,
                            pid,
                        )
                        _exit_now(1)

        threading.Thread(target=watch, name="replica-group-siblings", daemon=True).start()

    def _state_for_others(self) -> dict[str, Any]:
        """What a restarted group takes from this one: the snapshot's shared parts, copied (the transfer may still
        run when the next optimizer step changes them in place). torchft asks while this group's step computes: the
        data position is the one at the step's start; buffers (BatchNorm's) may be a moment later's, averaged again
        at the next step."""
        state = self.trainer.state.capture()[0]
        state["progress"] = dict(self._progress_at_quorum)
        return tree_map(lambda value: value.clone() if isinstance(value, torch.Tensor) else value, state)

    def _take_live_state(self, state: dict[str, Any]) -> None:
        """A live group's state, loaded at the end of a step as a resume is (the progress first: the default schedule
        follows it); then this group goes on from the live groups' place in the data after that step."""
        trainer = self.trainer
        parts = trainer.state.shared
        parts["progress"].load_state_dict(state["progress"])
        for name, part in parts.items():
            if name != "progress":
                part.load_state_dict(state[name])
        trainer.length.total_steps = trainer.length.steps(trainer.progress, trainer.global_batch)
        trainer.batches.restart()
        next(trainer.batches)  # the share of the step being committed now, which this group did not train
        trainer.checkpointer.last_saved = None
        log.info(
            "replica group %s rejoined at step %s with a live group's state", self.info.group, trainer.progress.step
        )

    def close(self, error: BaseException | None = None) -> None:
        """`error`: the exception that ends the run early, if one does."""
        if not hasattr(self, "manager"):  # the run ended before the groups met
            return
        quorum = getattr(self.manager, "_quorum_future", None)  # the quorum torchft forms alongside each step
        self._closed.set()
        self.manager.shutdown(wait=False)
        # torchft's manager keeps its process group to the end (its shutdown leaves it): dropped here, gloo's threads
        # are joined now, not in the interpreter's shutdown, where a thread still running aborts the process
        # (SIGABRT, "terminate called without an active exception": seen at the end of a run that had succeeded)
        self._pg.shutdown()
        if error is not None and quorum is not None and not quorum.done():
            self._leave_soon(2 if isinstance(error, RunError) else 1)

    def end_process(self, code: int) -> None:
        """Exit now, without the interpreter's shutdown, which tears down torchft's native threads in an order that can
        abort the process (SIGABRT) after a run that succeeded. Not under a debugger."""
        if not _debugged():
            _exit_now(code)

    def _leave_soon(self, code: int) -> None:
        """A run that fails while a quorum forms: the interpreter's exit would wait for torchft's quorum thread (up to
        --dist-timeout), so the process leaves with `code` in EXIT_GRACE seconds, its error recorded. Not debugged."""
        if _debugged():
            return

        def leave() -> None:
            time.sleep(EXIT_GRACE)
            log.warning(
                "replica group %s: leaving without waiting for torchft's quorum thread (exit code %s)",
                self.info.group,
                code,
            )
            _exit_now(code)

        threading.Thread(target=leave, name="replica-group-exit", daemon=True).start()


def _debugged() -> bool:
    """Whether a debugger holds this process (F5, DEBUG_POSTMORTEM): it then ends as usual, not by _exit_now."""
    return bool(os.environ.get("DEBUGPY_RUNNING")) or postmortem_requested()


def _exit_now(code: int) -> None:
    """Leave the process at once with `code`, without the interpreter's shutdown; the log and the standard streams
    are flushed first."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def _first_line(error: Any) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _ready(tensor: Any) -> Any:
    """A future that holds `tensor` already (what a DDP communication hook returns when nothing is left to wait for)."""
    done: Any = torch.futures.Future()
    done.set_result(tensor)
    return done


@dataclasses.dataclass
class _Bucket:
    """One DDP gradient bucket of this step: its flat buffer (the gradients of its parameters are views into it)."""

    buffer: Any
    group_work: Any = None  # the average over the group's own ranks (2 or more), when in flight
    work: Any = None  # the average over the replica groups


def _children(parent: int) -> list[int]:
    """The processes whose parent is `parent` (Linux /proc; none elsewhere)."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    return [int(entry) for entry in entries if entry.isdigit() and _is_child(int(entry), parent)]


def _is_child(pid: int, parent: int) -> bool:
    fields = identity.proc_stat(pid)
    return fields is not None and len(fields) > 1 and fields[1] == str(parent) and fields[0] != "Z"  # zombie: dead
