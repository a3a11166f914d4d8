"""The optimizer and the learning-rate schedule when model.py brings none, and how both resume.

The default schedule is a function of the samples seen and the current --lr and --warmup-steps, so it needs no state
of its own; the optimizer (`OptimizerPart`) and a user's LRScheduler (`SchedulerPart`) resume from the snapshot.
"""

from __future__ import annotations

import copy
from collections import Counter, OrderedDict
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

from .batches import Progress, RunLength
from .runsettings import START_AFRESH
from .settings import RunError, cut_short


def default_optimizer(cfg: Any, model: nn.Module) -> torch.optim.Optimizer:
    """AdamW with --lr and --weight-decay; no weight decay on parameters of fewer than 2 dimensions (biases, norms)."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW([group for group in groups if group["params"]], lr=cfg.lr)


class Optimizers(torch.optim.Optimizer):
    """Several optimizers as one (build_optimizer returned a list): stepped, zeroed, scaled and saved together.

    Its param_groups are the optimizers' own group dicts, in order (read anew each time), so a scheduler built on
    it sets their learning rates, and the gradient scaler unscales them all; hooks registered on it
    (register_step_post_hook, e.g. to update an EMA) run after every optimizer has stepped."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]):
        # Not Optimizer.__init__, which would make groups of its own: only the hooks' tables and the step wrapper
        # that runs them.
        self.optimizers = optimizers
        self.defaults: dict[str, Any] = {}
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()
        self._patch_step_function()

    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        # Read anew each time: an optimizer's load_state_dict() replaces its group dicts
        return [group for optimizer in self.optimizers for group in optimizer.param_groups]

    @property  # type: ignore[override]  # a view of the optimizers' states, read-only
    def state(self) -> dict[Any, Any]:  # type: ignore[override]
        return {param: state for optimizer in self.optimizers for param, state in optimizer.state.items()}

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for optimizer in self.optimizers:
            optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        states = [optimizer.state_dict() for optimizer in self.optimizers]
        return {"optimizers": states, "param_groups": [group for state in states for group in state["param_groups"]]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict.get("optimizers", [])
        if len(saved) != len(self.optimizers):
            raise RunError(
                f"the snapshot holds {len(saved)} optimizer(s) and build_optimizer now returns "
                f"{len(self.optimizers)}: resume with the same ones, or {START_AFRESH}"
            )
        for optimizer, state in zip(self.optimizers, saved, strict=True):
            optimizer.load_state_dict(state)


def as_optimizer(value: Any) -> torch.optim.Optimizer:
    """build_optimizer's answer (checked in hooks.py) as one optimizer: a list of several as Optimizers."""
    if isinstance(value, torch.optim.Optimizer):
        return value
    return value[0] if len(value) == 1 else Optimizers(list(value))


def optimizers_of(optimizer: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
    """The optimizers one stands for: its own list when it is an Optimizers, else itself."""
    return optimizer.optimizers if isinstance(optimizer, Optimizers) else [optimizer]


class SampleSchedule(LRScheduler):
    """Linear warmup, then cosine decay to 10% of --lr, as a function of the samples seen (see RunLength): the same
    curve at any world size, and a changed --lr or --warmup-steps applies from the first resumed step."""

    def __init__(self, optimizer: torch.optim.Optimizer, length: RunLength, progress: Progress):
        self.length, self.progress = length, progress
        super().__init__(optimizer)

    def get_lr(self) -> list[float | torch.Tensor]:
        # Each group keeps its ratio to the first whose lr is not 0 (the default groups share one lr); a group
        # built with lr 0 (frozen for now) stays at 0.
        lr = self.length.lr(self.progress.samples_seen)
        reference = next((float(base) for base in self.base_lrs if float(base) != 0.0), 1.0)
        return [lr * float(base) / reference for base in self.base_lrs]

    def state_dict(self) -> dict[str, Any]:
        return {}  # a function of the progress, which the snapshot holds

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for group, lr in zip(self.optimizer.param_groups, self.get_lr(), strict=True):
            group["lr"] = lr


STARTED_WITH = "started_with"  # beside an optimizer's state in a snapshot: what the run's start made


class OptimizerPart:
    """The optimizer as a snapshot part: its state and hyperparameters from the snapshot, but for each hyperparameter
    this run's start (build_optimizer, then build_scheduler) made differently from the snapshot's run's start: a new
    --weight-decay applies, a no-decay group stays no-decay, and what a scheduler moves as it steps (OneCycleLR's
    betas) resumes where it was. The learning rate is the scheduler's, restored after it."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self.started: dict[str, Any] = {
            "optimizers": [type(each).__name__ for each in optimizers_of(optimizer)],
            "param_groups": hyperparameters(optimizer),
        }

    def state_dict(self) -> dict[str, Any]:
        return {**self.optimizer.state_dict(), STARTED_WITH: self.started}

    def check(self, state: dict[str, Any]) -> None:
        """Refuse a snapshot of other optimizers (another number of them, or another class) in one line."""
        then = state.get(STARTED_WITH, {}).get("optimizers")
        now = self.started["optimizers"]
        if then is not None and list(then) != now:
            raise RunError(
                f"the snapshot holds the optimizer(s) {', '.join(then)} and build_optimizer now returns "
                f"{', '.join(now)}: resume with the same ones, or {START_AFRESH}"
            )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.check(state)
        current = self.started["param_groups"]
        saved = state.get("param_groups", [])
        if len(saved) != len(current):
            raise RunError(
                f"the optimizer in the snapshot has {len(saved)} parameter group(s) and build_optimizer now makes "
                f"{len(current)}: resume with the same groups, or {START_AFRESH}"
            )
        self.optimizer.load_state_dict({key: value for key, value in state.items() if key != STARTED_WITH})
        reapply_hyperparameters(self.optimizer, current, state.get(STARTED_WITH, {}).get("param_groups"))


def scheduler_leaves(scheduler: LRScheduler) -> list[LRScheduler]:
    """The schedulers that hold base learning rates: those inside a SequentialLR or ChainedScheduler, else itself."""
    inner = getattr(scheduler, "_schedulers", None)
    if inner is None:
        return [scheduler] if hasattr(scheduler, "base_lrs") else []
    return [leaf for each in inner for leaf in scheduler_leaves(each)]


class SchedulerPart:
    """Your LRScheduler as a snapshot part: its position from the snapshot, its base learning rates (each inner
    scheduler's too) from the current build_optimizer, so a resume with another --lr reaches it: the restored rates
    are rescaled by new base / old base, exact for schedules that scale with the base (LambdaLR, StepLR, ...)."""

    def __init__(self, scheduler: LRScheduler):
        self.scheduler = scheduler
        self.rescaled: list[tuple[float, float]] = []  # (old base, new base) per group, when a resume changed them

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        leaves = scheduler_leaves(self.scheduler)
        current = [[float(base) for base in leaf.base_lrs] for leaf in leaves]
        self.scheduler.load_state_dict(state)
        saved = [[float(base) for base in leaf.base_lrs] for leaf in leaves]
        if not leaves or saved == current or any(len(a) != len(b) for a, b in zip(saved, current, strict=True)):
            return
        for leaf, bases in zip(leaves, current, strict=True):
            leaf.base_lrs = list(bases)
        groups = self.scheduler.optimizer.param_groups
        for group, old, new in zip(groups, saved[0], current[0], strict=True):
            group["initial_lr"] = new
            group["lr"] = group["lr"] * new / old if old else new
        for each in (self.scheduler, *leaves):
            each._last_lr = [group["lr"] for group in groups]  # what get_last_lr() reports
        self.rescaled = list(zip(saved[0], current[0], strict=True))


def unoptimized_parameters(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The names of the parameters that get gradients (requires_grad) but are in no group of the optimizer."""
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    return [name for name, p in model.named_parameters() if p.requires_grad and id(p) not in held]


def optimizer_warnings(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """One line per kind of parameter build_optimizer gets wrong: left out of every group, or in several."""
    lines, held = [], Counter(id(p) for group in optimizer.param_groups for p in group["params"])
    for names, what in (
        (
            unoptimized_parameters(model, optimizer),
            "leaves out {count} parameter(s) that get gradients: {names}. They are never trained: add them to a "
            "group, or set requires_grad=False on them",
        ),
        (
            [name for name, p in model.named_parameters() if held[id(p)] > 1],
            "puts {count} parameter(s) in more than one group or optimizer: {names}. Each step moves them once "
            "per group: keep each parameter in one group only",
        ),
    ):
        if names:
            lines.append("build_optimizer in model.py " + what.format(count=len(names), names=cut_short(names, 5)))
    return lines


def hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """A copy of each group's settings, without its parameters (a tensor among them may change in place)."""
    return [
        {key: copy.deepcopy(value) for key, value in group.items() if key != "params"}
        for group in optimizer.param_groups
    ]


def reapply_hyperparameters(
    optimizer: torch.optim.Optimizer, current: list[dict[str, Any]], then: list[dict[str, Any]] | None = None
) -> None:
    """Put back each group's hyperparameter from `current` (this run's start) that differs from `then` (the start
    of the run that wrote the snapshot; None: unknown, put back every one), element by element in a tuple such as
    Adam's betas; never the learning rate (the scheduler's)."""
    for index, (group, settings) in enumerate(zip(optimizer.param_groups, current, strict=True)):
        before = then[index] if then is not None and index < len(then) else None
        for key, value in settings.items():
            if key in ("lr", "initial_lr"):
                continue
            if before is None or key not in before or key not in group:
                group[key] = value
            else:
                group[key] = _changed(group[key], before[key], value)


def _changed(restored: Any, then: Any, now: Any) -> Any:
    """`restored`, unless the start's value went from `then` to `now`: `now` then (per element of a tuple)."""
    if _same(then, now):
        return restored
    sequences = all(isinstance(value, (tuple, list)) for value in (restored, then, now))
    if sequences and len(restored) == len(then) == len(now):
        return type(now)(_changed(*each) for each in zip(restored, then, now, strict=True))
    return now


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        tensors = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
        return tensors and a.shape == b.shape and torch.equal(a.detach().cpu(), b.detach().cpu())
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    try:
        return bool(a == b)
    except (TypeError, ValueError, RuntimeError):
        return False
