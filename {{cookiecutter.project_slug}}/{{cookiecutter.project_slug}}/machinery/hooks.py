"""The seam: the functions a user writes in model.py and data.py, declared once, checked at start-up.

| file     | hook                                          | needed               | when absent                       |
|----------|-----------------------------------------------|----------------------|-----------------------------------|
| data.py  | build_datasets(cfg) -> (train, val or None)   | yes                  |                                   |
| data.py  | collate(items) -> batch                       | no                   | torch's default_collate           |
| model.py | build_model(cfg, train_dataset) -> Module     | yes                  |                                   |
| model.py | loss_fn(outputs, targets) -> mean loss        | without compute_loss | (the step on (inputs, target))    |
| model.py | val_metrics(outputs, targets) -> {name: sum}  | no                   | val_loss only                     |
| model.py | compute_loss(model, batch) -> loss or dict    | no                   | loss_fn(model(inputs), targets)   |
| model.py | build_optimizer(cfg, model) -> Optimizer      | no                   | optim.default_optimizer           |
| model.py | build_scheduler(cfg, optimizer, total_steps)  | no                   | optim.SampleSchedule              |
| model.py | shard_units(model) -> [Module or [Module]]    | no                   | parallel.default_shard_units      |
| model.py | extra_state(cfg, model, optimizer) -> {name: part} | no              | model, optimizer, ... only        |

A top-level function of model.py or data.py whose name is close to a hook's but not one (`build_optimiser`) is
named in a warning at start-up: it would otherwise be ignored without a word.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import logging
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .batches import tensors_in
from .settings import RunError

log = logging.getLogger(__name__)

# file -> hooks it may define; the first of each file's are required.
HOOKS: dict[str, tuple[str, ...]] = {
    "data": ("build_datasets", "collate"),
    "model": (
        "build_model",
        "loss_fn",
        "val_metrics",
        "compute_loss",
        "build_optimizer",
        "build_scheduler",
        "shard_units",
        "extra_state",
    ),
}
REQUIRED = {"data": ("build_datasets",), "model": ("build_model",)}


@dataclass
class StepResult:
    """What one batch's step computed, in sums: `loss` summed over `count` (samples or tokens) and other sums."""

    loss: torch.Tensor  # a scalar: the loss SUM over `count` when is_sum, else the batch's MEAN loss
    count: torch.Tensor  # a scalar (float64): what the loss and the sums run over (samples, or e.g. tokens)
    sums: dict[str, torch.Tensor]  # other sums (evaluation's val_<name>), each over `count`
    is_sum: bool  # True when compute_loss returned a dict: the loss is token-weighted over every rank

    def loss_sum(self) -> torch.Tensor:
        """The loss summed over `count`, in float64 (what evaluation adds up)."""
        return self.loss.double() if self.is_sum else self.loss.double() * self.count


class UserCode:
    """model.py's and data.py's hooks, or their defaults; checked once, when the run starts."""

    def __init__(self, package: str):
        self.modules = {name: importlib.import_module(f"{package}.{name}") for name in HOOKS}
        for file, names in REQUIRED.items():
            for name in names:
                if not callable(getattr(self.modules[file], name, None)):
                    raise RunError(f"{file}.py has no function {name}: the trainer needs it (see machinery/hooks.py)")
        self.build_datasets = self._hook("data", "build_datasets")
        self.collate: Callable[[list], Any] | None = self._hook("data", "collate")
        self.build_model = self._hook("model", "build_model")
        self.loss_fn = self._hook("model", "loss_fn")
        self.val_metrics = self._hook("model", "val_metrics")
        self.compute_loss = self._hook("model", "compute_loss")
        self.build_optimizer = self._hook("model", "build_optimizer")
        self.build_scheduler = self._hook("model", "build_scheduler")
        self.shard_units = self._hook("model", "shard_units")
        self.extra_state = self._hook("model", "extra_state")
        if self.compute_loss is None and self.loss_fn is None:
            raise RunError("model.py has neither compute_loss(model, batch) nor loss_fn(outputs, targets): define one")

    def _hook(self, file: str, name: str) -> Any:
        value = getattr(self.modules[file], name, None)
        return value if callable(value) else None

    def misspelled(self) -> list[str]:
        """One line per top-level function of model.py or data.py that looks like a misspelled hook."""
        lines = []
        every_hook = [hook for hooks in HOOKS.values() for hook in hooks]
        for file, module in self.modules.items():
            for name, value in vars(module).items():
                if name in every_hook or name.startswith("_") or not isinstance(value, types.FunctionType):
                    continue
                if inspect.getmodule(value) is not module:
                    continue  # imported from elsewhere, not written here
                close = difflib.get_close_matches(name, every_hook, n=1, cutoff=0.8)
                if close:
                    where = next(f for f, hooks in HOOKS.items() if close[0] in hooks)
                    lines.append(
                        f"{file}.py defines {name}, which is no hook the trainer calls: did you mean {close[0]} "
                        f"(in {where}.py)? As it is, it is never called"
                    )
        return lines

    def step(self, model: torch.nn.Module, batch: Any) -> StepResult:
        """One batch's loss through compute_loss, or loss_fn on an (inputs, targets) pair; with val_metrics' sums."""
        if self.compute_loss is not None:
            return _as_result(self.compute_loss(model, batch), batch)
        if not isinstance(batch, (list, tuple)) or len(batch) != 2:
            raise RunError(
                f"the items of the training data are not (inputs, target) pairs (a batch is a "
                f"{type(batch).__name__}): define compute_loss(model, batch) in model.py for other shapes"
            )
        inputs, targets = batch
        outputs = model(inputs)
        count = torch.as_tensor(_batch_size(targets), dtype=torch.float64, device=_device_of(outputs, targets))
        mean = self.loss_fn(outputs, targets)
        sums = {}
        if self.val_metrics is not None and not model.training:
            sums = _sums(self.val_metrics(outputs, targets))
        return StepResult(loss=mean, count=count, sums=sums, is_sum=False)


def _as_result(value: Any, batch: Any) -> StepResult:
    """compute_loss's answer as a StepResult: a scalar mean (weighted by the batch's size), or {loss, count, ...}."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise RunError(f"compute_loss in model.py returned a tensor of shape {tuple(value.shape)}: return a scalar")
        count = torch.as_tensor(_batch_size(batch), dtype=torch.float64, device=value.device)
        return StepResult(loss=value.reshape(()), count=count, sums={}, is_sum=False)
    if isinstance(value, dict) and "loss" in value and "count" in value:
        loss = value["loss"]
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise RunError("compute_loss in model.py returned a 'loss' that is not a scalar tensor: return its SUM")
        count = torch.as_tensor(value["count"], dtype=torch.float64, device=loss.device).reshape(())
        sums = {}
        for name, total in value.items():
            if name in ("loss", "count"):
                continue
            total = torch.as_tensor(total, device=loss.device)
            if total.numel() != 1:
                raise RunError(f"compute_loss in model.py returned {name!r} of shape {tuple(total.shape)}: not a sum")
            sums[name] = total.reshape(())
        return StepResult(loss=loss.reshape(()), count=count, sums=sums, is_sum=True)
    raise RunError(
        f"compute_loss in model.py returned a {type(value).__name__}: return a scalar tensor (the batch's mean "
        "loss) or a dict with 'loss' (a SUM) and 'count' (what it sums over)"
    )


def _sums(value: Any) -> dict[str, torch.Tensor]:
    """val_metrics' answer as {name: scalar tensor}; one line naming val_metrics and the key otherwise."""
    if not isinstance(value, Mapping):
        raise RunError(f"val_metrics in model.py returned a {type(value).__name__}: return a dict of per-batch SUMS")
    if "loss" in value:
        raise RunError("val_metrics in model.py returns 'loss': that name is val_loss's (from loss_fn); rename it")
    sums = {}
    for name, total in value.items():
        try:
            tensor = torch.as_tensor(total)
        except (TypeError, ValueError, RuntimeError):
            tensor = None
        if tensor is None or tensor.numel() != 1 or tensor.is_complex():
            what = f"of shape {tuple(tensor.shape)}" if tensor is not None else f"as a {type(total).__name__}"
            raise RunError(
                f"val_metrics in model.py returned {name!r} {what}: each value must be one real number, the batch's "
                "SUM (e.g. correct.sum())"
            )
        sums[str(name)] = tensor.reshape(())
    return sums


def _batch_size(batch: Any) -> int:
    """The number of samples in a batch: the first dimension of its first tensor."""
    leaves = tensors_in(batch)
    if not leaves or leaves[0].dim() == 0:
        raise RunError("a batch holds no tensor with a batch dimension: return a dict with 'count' from compute_loss")
    return int(leaves[0].shape[0])


def _device_of(*values: Any) -> torch.device:
    for value in values:
        for leaf in tensors_in(value):
            return leaf.device
    return torch.device("cpu")
