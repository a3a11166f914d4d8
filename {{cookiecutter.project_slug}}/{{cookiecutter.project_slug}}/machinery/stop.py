"""Stopping on a signal: SIGTERM (preemption) or Ctrl-C stops every rank at the same step, with a snapshot."""

import json
import os
import signal
from collections.abc import Callable

import torch
import torch.distributed as dist

from . import identity
from .distributed import DistEnv

STOP_RECORD = "stopped.json"  # in the snapshot folder: which torchrun job a signal stopped, at which step


def stopped_by_signal(snapshot_dir: str) -> int:
    """The signal that stopped this torchrun job, when this process is one of torchrun's restarts of it; else 0.

    A SIGTERM or Ctrl-C that reaches only the workers (Kubernetes and srun signal every process) stops them with a
    snapshot and exit code 128 + signal, which torchrun takes for a failure: each restart reads the job's stop record
    and exits at once with the same code, so the job stays stopped. A new launch, even with the same --rdzv-id (a
    requeued SLURM job), is no restart: it clears the record and resumes.
    """
    if not int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0):
        return 0
    try:
        if "://" in snapshot_dir:  # a store (snapshot/store.py)
            from .snapshot.store import read_beside

            record = json.loads(read_beside(snapshot_dir, STOP_RECORD) or b"null")
        else:
            with open(os.path.join(snapshot_dir, STOP_RECORD), encoding="utf-8") as handle:
                record = json.load(handle)
    except (OSError, ValueError):
        return 0
    if not isinstance(record, dict):
        return 0
    signum = record.get("signal")
    return signum if record.get("job") == identity.current_job() and isinstance(signum, int) and signum > 0 else 0


class StopRequest:
    """SIGTERM (what torchrun, SLURM and Kubernetes send before a kill) or Ctrl-C asks the job to stop at a step;
    so may a part of the run itself (`asked`, e.g. a sweep's pruner on rank 0: trialreport.py), with no signal.

    The handler only sets a flag; a second Ctrl-C interrupts at once. The ranks agree on when to stop with a
    two-number all_reduce started after each step and read after the next one, so its latency hides behind the
    step and all ranks stop together.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, env: DistEnv, asked: Callable[[], bool] | None = None):
        self.env = env
        self.signal = 0  # the signal this rank received
        self.stopped = False  # set on every rank at the same step once the ranks agree to stop
        self.asked = False  # set with `stopped` when the stop was asked for, not signalled
        self._asks = asked or (lambda: False)
        self._pending = None
        self._flag = torch.zeros(2, dtype=torch.int64)  # [signal, asked], the largest of every rank's
        self._interrupts = 0
        # torchrun forwards each Ctrl-C it gets to its workers (on a loaded machine seconds later), so a worker under
        # torchrun receives every Ctrl-C of a terminal twice: the user's second one is its third SIGINT.
        self._interrupts_per_ctrl_c = 2 if identity.torchrun_worker() else 1
        self._previous = {signum: signal.signal(signum, self._handle) for signum in self.SIGNALS}

    def _handle(self, signum, frame):
        # A second Ctrl-C stops at once, without a snapshot; not the copy torchrun forwards of the first.
        if signum == signal.SIGINT:
            self._interrupts += 1
            if self._interrupts > self._interrupts_per_ctrl_c:
                raise KeyboardInterrupt
        self.signal = self.signal or signum

    def agreed(self) -> bool:
        """True on every rank at the same step, once any rank got the signal."""
        if not self.env.is_distributed:
            self._learn(self._wanted().tolist())
            return self.stopped
        if self._pending is not None:
            self._pending.wait()
            self._learn(self._flag.tolist())
        self._flag.copy_(self._wanted())
        self._pending = dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, async_op=True)
        return self.stopped

    def agree_now(self) -> bool:
        """What agreed() learns a step later, at once (a blocking all-reduce): for a stop before any step."""
        if self._pending is not None:
            self._pending.wait()
            self._pending = None
            self._learn(self._flag.tolist())
        self._flag.copy_(self._wanted())
        if self.env.is_distributed:
            dist.all_reduce(self._flag, op=dist.ReduceOp.MAX)
        self._learn(self._flag.tolist())
        return self.stopped

    def _wanted(self) -> torch.Tensor:
        """This rank's wish: [its signal or 0, 1 when the run asked to stop]."""
        return torch.tensor([self.signal, int(self._asks())], dtype=torch.int64)

    def _learn(self, flag: list[int]) -> None:
        """What the ranks agreed on: a signal (every rank stops with it), or a stop the run asked for."""
        signum, asked = flag
        self.signal = self.signal or signum
        self.asked = self.asked or bool(asked)
        self.stopped = self.stopped or bool(signum or asked)

    def close(self, restore_handlers: bool = True) -> None:
        if self._pending is not None:
            self._pending.wait()  # every rank started the same number of these: finish the last one everywhere
            self._pending = None
        if restore_handlers:
            for signum, previous in self._previous.items():
                signal.signal(signum, previous)
            self._previous = {}

    def __enter__(self) -> "StopRequest":
        return self

    def __exit__(self, kind, *exc_info) -> None:
        # A rank leaving on an error keeps the flag-only handlers while it logs the error and tears down: torchrun
        # sends SIGTERM to every worker once one has died, and the default action would end this one mid-log.
        self.close(restore_handlers=kind is None)
