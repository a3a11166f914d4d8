"""When the run saves a snapshot, and of what: at every --snapshot-every step and the last, of a finite state only."""

from __future__ import annotations

from typing import Any

import torch

from . import distributed
from .distributed import DistEnv
from .nonfinite import NonfiniteGuard
from .settings import RunError, flag
from .snapshot import Snapshots
from .startup import Start


class Checkpointer:
    """Saves what the run's start built a snapshot of (`start.state`) into `snapshots` (snapshot/), in the
    background; `last_saved`: the step of the newest snapshot this run has (None: none yet)."""

    def __init__(self, cfg: Any, env: DistEnv, snapshots: Snapshots, nonfinite: NonfiniteGuard, start: Start):
        self.cfg, self.env, self.snapshots, self.nonfinite = cfg, env, snapshots, nonfinite
        self.state, self.progress, self.length, self.run_id = start.state, start.progress, start.length, start.run_id
        self.starting_weights = start.starting_weights
        self.last_saved: int | None = start.resumed_from if start.resumed_from >= 0 else None

    def maybe_save(self) -> None:
        if self.length.due(self.progress.step, self.cfg.snapshot_every):
            self.save()

    def save(self, blocking: bool = False) -> None:
        """Start writing a snapshot of this step in the background; refuse a diverged state."""
        self.nonfinite.check()  # no snapshot of what a step with a NaN or infinite loss or gradient made
        step = self.progress.step
        if not distributed.all_true(self.env, self.state.finite()):
            raise RunError(
                f"the weights or the optimizer state are not finite at step {step} (their gradients were): no "
                f"snapshot is saved from them. Lower {flag('lr')} or check the optimizer's settings; "
                f"{self.nonfinite.rerun_advice()}"
            )
        # A store slower than --snapshot-every: no queue of uploads builds up (a blocking save, the last, always saves)
        may_skip = self.snapshots.store is not None and not blocking
        if may_skip and not distributed.all_true(self.env, not self.snapshots.uploading()):
            self.snapshots.skip(step)
            return
        frozen_in = self.state.frozen.held_by(step)  # an older snapshot may hold the frozen parameters (frozen.py)
        shared, rank_state, sharded_state = self.state.capture(without_frozen=frozen_in not in (None, step))
        shared.update(step=step, config=self.cfg.to_dict(), run_id=self.run_id, torch_version=str(torch.__version__))
        shared.update(starting_weights=self.starting_weights)
        self.snapshots.save(
            step, shared, rank_state, blocking=blocking, sharded_state=sharded_state, frozen_in=frozen_in
        )
        self.last_saved = step
