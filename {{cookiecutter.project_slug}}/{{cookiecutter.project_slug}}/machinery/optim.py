"""The optimizer and the learning-rate schedule when model.py brings none, and how both resume.

On resume the optimizer's state (moments, step counts) comes from the snapshot, and its hyperparameters from
build_optimizer with the current settings, group by group (`OptimizerPart`): a new --weight-decay applies, and a
no-decay group stays no-decay. The learning rate is the scheduler's: the default schedule is a function of the
samples seen and the current --lr and --warmup-steps, so it needs no state of its own; a user's LRScheduler is saved
and restored whole (its position and base learning rates).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

from .batches import Progress, RunLength
from .settings import RunError


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
                f"{len(self.optimizers)}: resume with the same ones, or start from scratch with --resume never"
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
        # Each group keeps its ratio to the first (the default groups share one lr).
        lr = self.length.lr(self.progress.samples_seen)
        return [lr * float(base) / float(self.base_lrs[0]) for base in self.base_lrs]

    def state_dict(self) -> dict[str, Any]:
        return {}  # a function of the progress, which the snapshot holds

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for group, lr in zip(self.optimizer.param_groups, self.get_lr(), strict=True):
            group["lr"] = lr


class OptimizerPart:
    """The optimizer as a snapshot part: state from the snapshot, hyperparameters from the current build_optimizer.

    The learning rate is left as the snapshot has it: the scheduler restored after it sets it.
    """

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        current = [{k: v for k, v in group.items() if k != "params"} for group in self.optimizer.param_groups]
        saved = state.get("param_groups", [])
        if len(saved) != len(current):
            raise RunError(
                f"the optimizer in the snapshot has {len(saved)} parameter group(s) and build_optimizer now makes "
                f"{len(current)}: resume with the same groups, or start from scratch with --resume never"
            )
        self.optimizer.load_state_dict(state)
        reapply_hyperparameters(self.optimizer, current)


class SchedulerPart:
    """Your LRScheduler as a snapshot part: its position from the snapshot, its base learning rates from the current
    build_optimizer. A resume with another --lr (when build_optimizer uses it) thus reaches your schedule: the
    restored learning rates are rescaled by new base / old base, which is exact for the schedules that scale with
    the base rate (LambdaLR, StepLR, CosineAnnealingLR to 0, ...)."""

    def __init__(self, scheduler: LRScheduler):
        self.scheduler = scheduler
        self.rescaled: list[tuple[float, float]] = []  # (old base, new base) per group, when a resume changed them

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        current: list[float | torch.Tensor] = [float(base) for base in self.scheduler.base_lrs]
        self.scheduler.load_state_dict(state)
        saved = [float(base) for base in self.scheduler.base_lrs]
        if saved == current or len(saved) != len(current):
            return
        self.scheduler.base_lrs = current
        groups = self.scheduler.optimizer.param_groups
        for group, old, new in zip(groups, saved, current, strict=True):
            group["initial_lr"] = new
            group["lr"] = group["lr"] * new / old if old else new
        self.scheduler._last_lr = [group["lr"] for group in groups]  # what get_last_lr() reports
        self.rescaled = [(old, float(new)) for old, new in zip(saved, current, strict=True)]


def unoptimized_parameters(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The names of the parameters that get gradients (requires_grad) but are in no group of the optimizer."""
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    return [name for name, p in model.named_parameters() if p.requires_grad and id(p) not in held]


def reapply_hyperparameters(optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]]) -> None:
    """Put each group's hyperparameters from `groups` back, except the learning rate (the scheduler's)."""
    for group, settings in zip(optimizer.param_groups, groups, strict=True):
        for key, value in settings.items():
            if key not in ("lr", "initial_lr"):
                group[key] = value
