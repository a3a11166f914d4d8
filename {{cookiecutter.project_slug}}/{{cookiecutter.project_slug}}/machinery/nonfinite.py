"""A NaN or infinite loss or gradient: the check that stops the run (at each log and snapshot), and where it came
from: the step, trained again in this process from the newest snapshot before it (exact resume makes the replay
faithful), with hooks that name the batch, module, loss or parameter that first turned non-finite. Only a run that
has already failed pays for it; the run then stops, so nothing the replay trains is kept.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import shlex
import sys
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch
from torch import nn

from . import distributed
from .batches import Batches, tensors_in
from .distributed import DistEnv, ranks_text
from .settings import RunError, flag
from .snapshot import restore_rng
from .state import all_finite

log = logging.getLogger(__name__)
REPLAY_FLAGS = ("--resume-from", "--break-at-step")


class Run(Protocol):
    """What the guard reads of the run it watches (trainer.py): the parts a replay trains with."""

    env: DistEnv
    model: nn.Module
    snapshots: Any
    state: Any
    batches: Any
    progress: Any
    stepper: Any
    partners: Any
    checkpointer: Any  # its last_saved: the step of the newest snapshot this run has

    def forward_backward(self, micro_batches: Any) -> None: ...

    def optimizer_step(self) -> bool: ...


@dataclass
class Origin:
    """What the replay saw on one rank: the first non-finite module output and parameter gradient (before the ranks
    average it), by qualified name, and whether the batch or the loss held NaN or infinity."""

    batch: bool = False
    module: str | None = None
    parameter: str | None = None
    loss: bool = False


def replay(trainer: Run, bad_step: int) -> tuple[int, list[Origin]] | None:
    """Every rank together: (the snapshot step the replay started from, each rank's Origin at `bad_step`), or None
    when no snapshot before `bad_step` is kept (or the replay failed: the run's own error is the one to report)."""
    try:
        trainer.snapshots.wait()  # a save in flight is committed first: every rank sees the same newest snapshot
        resumed = trainer.snapshots.resume()
        if resumed is None or resumed["step"] >= bad_step or resumed.get("rank_state") is None:
            return None
        rng_state = trainer.state.restore(resumed, trainer.snapshots.step_folder(resumed["step"]))
        if isinstance(trainer.batches, Batches):
            trainer.batches.restart()  # from the restored position (a stream's restarts with its restored place)
        restore_rng(rng_state)  # last, as at any resume
        progress = trainer.progress
        while progress.step < bad_step - 1:
            trainer.forward_backward(next(trainer.batches))
            trainer.optimizer_step()
        micro_batches = next(trainer.batches)
        with watching(trainer.model) as origin:
            origin.batch = not all_finite(tensors_in(micro_batches))  # data that arrives broken, before any module
            trainer.forward_backward(micro_batches)
        origin.loss = not bool(torch.isfinite(trainer.stepper.step_loss))
        return resumed["step"], distributed.all_gather_object(trainer.env, origin)
    except Exception as exc:  # noqa: BLE001 - the replay only adds detail to an error that stops the run anyway
        log.debug("replaying step %d to find where it turned non-finite failed: %r", bad_step, exc)
        return None


@contextlib.contextmanager
def watching(model: nn.Module) -> Iterator[Origin]:
    """Hooks on every module's output and every parameter's gradient, recording the first non-finite one of each."""
    origin = Origin()

    def output_hook(name: str, module: nn.Module, inputs: Any, output: Any) -> None:
        if origin.module is None and not all_finite(tensors_in(output)):
            origin.module = name or "(the model's own forward)"

    def gradient_hook(name: str, parameter: torch.Tensor) -> None:
        # Called once the gradient is in .grad: after any other hook on it, before DDP averages it
        if origin.parameter is None and not all_finite(tensors_in(parameter.grad)):
            origin.parameter = name

    handles = [
        module.register_forward_hook(functools.partial(output_hook, name)) for name, module in model.named_modules()
    ]
    handles += [
        parameter.register_post_accumulate_grad_hook(functools.partial(gradient_hook, name))
        for name, parameter in model.named_parameters()
        if parameter.requires_grad
    ]
    try:
        yield origin
    finally:
        for handle in handles:
            handle.remove()


def describe(origins: list[Origin], step: int) -> str:
    """Where the replay of `step` saw it first, over the ranks: the batch, a module's output, the loss, a gradient."""
    batches = [rank for rank, o in enumerate(origins) if o.batch]
    if batches:
        return f"the batch of step {step} on {ranks_text(batches)} holds NaN or infinity: check the data"
    modules = [f"module {o.module!r} on rank {rank}" for rank, o in enumerate(origins) if o.module is not None]
    if modules:
        return "the first non-finite forward output: " + ", ".join(modules)
    losses = [rank for rank, o in enumerate(origins) if o.loss]
    if losses:
        return (
            f"every module's output was finite and the loss was not, on {ranks_text(losses)}: loss_fn or compute_loss "
            f"in model.py made it"
        )
    parameters = [f"parameter {o.parameter!r} on rank {rank}" for rank, o in enumerate(origins) if o.parameter]
    if parameters:
        return "the first non-finite gradient (before the ranks average it): " + ", ".join(parameters)
    return "the replay saw no non-finite output or gradient (not reproducible: data loading or threads differ?)"


def replay_command(env: DistEnv, snapshot_step: int, bad_step: int) -> str:
    """The run's own command, with the flags that replay `bad_step` from the snapshot and stop there."""
    args, skip = [], False
    for arg in sys.argv[1:]:
        if skip:
            skip = False
        elif arg in REPLAY_FLAGS:
            skip = True
        elif not arg.startswith(tuple(f"{name}=" for name in REPLAY_FLAGS)):
            args.append(arg)
    script = os.path.relpath(sys.argv[0]) if sys.argv and sys.argv[0] else "train.py"
    launcher = f"torchrun --standalone --nproc_per_node={env.world_size}" if env.is_distributed else "python"
    replay_args = ["--resume-from", str(snapshot_step), "--break-at-step", str(bad_step)]
    return f"{launcher} {shlex.join([script, *args, *replay_args])}"


class NonfiniteGuard:
    """The run's watch over NaN and infinity: the check at each log and snapshot that stops every rank at once, and
    the replay that names where the first non-finite value came from."""

    def __init__(self, run: Run):
        # Not a reference that keeps the run alive: the Trainer and its process group's threads go when train()
        # returns, not at the next garbage collection
        self.run = cast(Run, weakref.proxy(run))
        self.finite_until = -1  # the last step check() found every loss and gradient so far finite

    def check(self) -> None:
        """Stop the run when a step so far had a NaN or infinite loss or gradient, before its weights are saved.
        Once a step (one that both logs and saves asks twice; every rank alike)."""
        run = self.run
        if self.finite_until == run.progress.step:
            return
        found = run.stepper.first_nonfinite()
        if found is None:
            self.finite_until = run.progress.step
            return
        step, ranks = found
        if ranks:
            what = f"the loss is not finite at step {step} on {ranks_text(ranks)}"
        else:
            what = (
                f"the gradient is not finite at step {step} on every rank (averaged over the ranks; the loss was "
                f"finite on every rank: a NaN or infinity arose in backward)"
            )
        where = ""
        replayed = replay(run, step) if run.partners.alone else None
        if replayed is not None:
            snapshot_step, origins = replayed
            command = replay_command(run.env, snapshot_step, step)
            where = f"; replayed from step {snapshot_step}, {describe(origins, step)}; to step into it: {command}"
        raise RunError(
            f"{what}{where}. The run stops, and no snapshot is saved from that step on. Lower {flag('lr')}, set "
            f"{flag('clip_grad')}, or check the data and the model; {self.rerun_advice()}"
        )

    def synced_loss(self) -> float:
        """The mean training loss since the last log, over every rank; a NaN or infinite one stops the run."""
        try:
            return self.run.stepper.mean_loss()
        except FloatingPointError:
            raise RunError(
                f"the training loss is not finite at step {self.run.progress.step}: the run diverged, so no snapshot "
                f"is saved from it. Lower {flag('lr')}, set {flag('clip_grad')}, or check the data; "
                f"{self.rerun_advice()}"
            ) from None

    def rerun_advice(self) -> str:
        """What running the same command again does once a run stopped on a non-finite value."""
        last_saved = self.run.checkpointer.last_saved
        if last_saved is None:
            return (
                f"then run the same command again: no snapshot was saved before this step, so it starts from "
                f"scratch (a smaller {flag('snapshot_every')} keeps one to replay the step from and resume from)"
            )
        return f"then run the same command again to resume from the snapshot of step {last_saved}"
