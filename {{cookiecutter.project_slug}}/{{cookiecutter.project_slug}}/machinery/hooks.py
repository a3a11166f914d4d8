"""The seam: the functions a user writes in model.py and data.py, declared once, checked at start-up.

| file     | hook                                          | needed               | when absent                       |
|----------|-----------------------------------------------|----------------------|-----------------------------------|
| data.py  | build_datasets(cfg) -> (train, val or None)   | yes                  |                                   |
| data.py  | collate(items) -> batch                       | no                   | torch's default_collate           |
| data.py  | prepare_data(cfg)                             | no                   | (build_datasets does it all)      |
| model.py | build_model(cfg, train_dataset) -> Module     | yes                  |                                   |
| model.py | loss_fn(outputs, targets) -> mean loss        | without compute_loss | (the step on (inputs, target))    |
| model.py | val_metrics(outputs, targets) -> {name: sum}  | no                   | val_loss only                     |
| model.py | compute_loss(model, batch) -> loss or dict    | no                   | loss_fn(model(inputs), targets)   |
| model.py | build_optimizer(cfg, model) -> Optimizer      | no                   | optim.default_optimizer           |
| model.py | build_scheduler(cfg, optimizer, total_steps)  | no                   | optim.SampleSchedule              |
| model.py | shard_units(model) -> [Module or [Module]]    | no                   | parallel.default_shard_units      |
| model.py | extra_state(cfg, model, optimizer) -> {name: part} | no              | model, optimizer, ... only        |
| model.py | pretrained_weights(cfg) -> path or None       | no                   | build_model's own weights         |

A top-level function named close to a hook (`build_optimiser`), which would be ignored without a word, is named in
a warning at start-up; so is a val_metrics that compute_loss makes unused. A hook's exception carries its name
(faults.py), and what a builder returns is checked where it is made, in one line naming the hook.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import logging
import os
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from . import distributed
from .batches import tensors_in
from .faults import BadUserValue, PeerFailed, tag
from .settings import RunError

log = logging.getLogger(__name__)

# file -> hooks it may define
HOOKS: dict[str, tuple[str, ...]] = {
    "data": ("build_datasets", "collate", "prepare_data"),
    "model": (
        "build_model",
        "loss_fn",
        "val_metrics",
        "compute_loss",
        "build_optimizer",
        "build_scheduler",
        "shard_units",
        "extra_state",
        "pretrained_weights",
    ),
}
REQUIRED = {"data": "build_datasets", "model": "build_model"}  # the other hooks have defaults


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


class Hook:
    """A user's function, called as it is: an exception it raises is tagged with the hook's name, and `check`, if
    given, refuses what it returns in one line. A plain object, so a DataLoader worker can take it (collate)."""

    def __init__(self, name: str, file: str, function: Callable, check: Callable[[Any], None] | None = None):
        self.name, self.file, self.function, self.check = name, file, function, check

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            value = self.function(*args, **kwargs)
        except Exception as exc:
            tag(exc, self.name, self.file)
            raise
        if self.check is not None:
            self.check(value)
        return value


# What the step of each kind is, as every rank tells the others at the first step.
MEAN, TOKEN_WEIGHTED, REFUSED = 0, 1, 2
KIND_NAMES = {MEAN: "a scalar tensor (a mean)", TOKEN_WEIGHTED: "a dict (a sum with a count)", REFUSED: "no loss"}


class UserCode:
    """model.py's and data.py's hooks, or their defaults, checked at start; with `env`, every rank agrees on the
    first training step's kind (`step`)."""

    def __init__(self, package: str, env: distributed.DistEnv | None = None):
        self.modules = {name: importlib.import_module(f"{package}.{name}") for name in HOOKS}
        for file, name in REQUIRED.items():
            if not callable(getattr(self.modules[file], name, None)):
                raise RunError(f"{file}.py has no function {name}: the trainer needs it (see machinery/hooks.py)")
        self.env, self._agreed = env, env is None
        self.prepare_data = self._hook("data", "prepare_data")
        self.build_datasets = self._hook("data", "build_datasets", _check_datasets)
        self.collate: Callable[[list], Any] = self._hook("data", "collate") or Hook("collate", "data", _default_collate)
        self.build_model = self._hook("model", "build_model", _check_model)
        self.loss_fn = self._hook("model", "loss_fn")
        self.val_metrics = self._hook("model", "val_metrics")
        self.compute_loss = self._hook("model", "compute_loss")
        self.build_optimizer = self._hook("model", "build_optimizer", _check_optimizer)
        self.build_scheduler = self._hook("model", "build_scheduler", _check_scheduler)
        self.shard_units = self._hook("model", "shard_units")
        self.extra_state = self._hook("model", "extra_state")
        self.pretrained_weights = self._hook("model", "pretrained_weights", _check_weights_path)
        if self.compute_loss is None and self.loss_fn is None:
            raise RunError("model.py has neither compute_loss(model, batch) nor loss_fn(outputs, targets): define one")

    def _hook(self, file: str, name: str, check: Callable[[Any], None] | None = None) -> Any:
        value = getattr(self.modules[file], name, None)
        return Hook(name, file, value, check) if callable(value) else None

    def unused(self) -> list[str]:
        """One line per hook that model.py defines but the trainer does not call."""
        if self.compute_loss is not None and self.val_metrics is not None:
            return [
                "model.py defines both compute_loss and val_metrics: val_metrics is not used (compute_loss replaces "
                "the step on (inputs, target), in evaluation too); return its sums as extra entries of compute_loss's "
                "dict instead, each logged as val_<name>"
            ]
        return []

    def misspelled(self) -> list[str]:
        """One line per top-level function of model.py or data.py that looks like a misspelled hook."""
        lines = []
        hook_files = {hook: file for file, hooks in HOOKS.items() for hook in hooks}
        for file, module in self.modules.items():
            for name, value in vars(module).items():
                if name in hook_files or name.startswith("_") or not isinstance(value, types.FunctionType):
                    continue
                if inspect.getmodule(value) is not module:
                    continue  # imported from elsewhere, not written here
                close = difflib.get_close_matches(name, list(hook_files), n=1, cutoff=0.8)
                if close:
                    lines.append(
                        f"{file}.py defines {name}, which is no hook the trainer calls: did you mean {close[0]} "
                        f"(in {hook_files[close[0]]}.py)? As it is, it is never called"
                    )
        return lines

    def step(self, model: torch.nn.Module, batch: Any) -> StepResult:
        """One batch's loss through compute_loss, or loss_fn on an (inputs, targets) pair; with val_metrics' sums.
        The first call in training mode agrees with the other ranks on the step's kind (`_agree`)."""
        if self._agreed or not model.training:
            return self._step(model, batch)
        self._agreed = True
        try:
            result = self._step(model, batch)
        except BadUserValue as refusal:
            self._agree(REFUSED, refusal)
            raise
        self._agree(TOKEN_WEIGHTED if result.is_sum else MEAN, None)
        return result

    def _agree(self, kind: int, refusal: BadUserValue | None) -> None:
        """Every rank's kind of the first step. Ranks that differ are told now, in one line, instead of meeting in
        different collectives (a sum's all-reduce, DDP's gradients) and waiting there until --dist-timeout.
        A refusal on every rank becomes one agreed error; on some ranks only, the others stop naming them."""
        assert self.env is not None
        kinds = distributed.all_gather_int(self.env, kind)
        if len(set(kinds)) == 1:
            if refusal is not None:
                raise RunError(str(refusal)) from None  # every rank refused alike: rank 0 says it
            return
        refused = [rank for rank, each in enumerate(kinds) if each == REFUSED]
        if refused:
            if refusal is not None:
                return  # this rank's own: raised on by the caller
            ranks = distributed.ranks_text(refused)
            raise PeerFailed(f"{ranks} refused what {self._step_name()} returned at the first step")
        by_kind = {
            KIND_NAMES[each]: distributed.ranks_text([rank for rank, other in enumerate(kinds) if other == each])
            for each in sorted(set(kinds))
        }
        raise RunError(
            "compute_loss in model.py returned "
            + " and ".join(f"{name} on {ranks}" for name, ranks in by_kind.items())
            + " at the first step: every rank must return the same kind, each step"
        )

    def _step_name(self) -> str:
        return "compute_loss" if self.compute_loss is not None else "loss_fn"

    def _step(self, model: torch.nn.Module, batch: Any) -> StepResult:
        if self.compute_loss is not None:
            result = as_step_result(self.compute_loss(model, batch), batch)
            self._check_trainable(model, result)
            return result
        if not isinstance(batch, (list, tuple)) or len(batch) != 2:
            raise BadUserValue(
                f"the items of the training data are not (inputs, target) pairs (a batch is a "
                f"{type(batch).__name__}): define compute_loss(model, batch) in model.py for other shapes"
            )
        inputs, targets = batch
        size = _batch_size(targets)
        outputs = model(inputs)
        count = torch.as_tensor(size, dtype=torch.float64, device=_device_of(outputs, targets))
        mean = self.loss_fn(outputs, targets)
        if not isinstance(mean, torch.Tensor) or mean.numel() != 1:
            what = f"a tensor of shape {tuple(mean.shape)}" if isinstance(mean, torch.Tensor) else type(mean).__name__
            raise BadUserValue(f"loss_fn in model.py returned {what}: return the batch's mean loss, a scalar tensor")
        sums = {}
        if self.val_metrics is not None and not model.training:
            sums = _sums(self.val_metrics(outputs, targets))
        result = StepResult(loss=mean.reshape(()), count=count, sums=sums, is_sum=False)
        self._check_trainable(model, result)
        return result

    def _check_trainable(self, model: torch.nn.Module, result: StepResult) -> None:
        """A training loss that backward cannot go through, told here rather than by autograd's RuntimeError."""
        if model.training and torch.is_grad_enabled() and not result.loss.requires_grad:
            raise BadUserValue(
                f"{self._step_name()} in model.py returned a loss that does not require grad: it was computed under "
                "torch.no_grad() or inference_mode, detached, or made from .item() or a new tensor; compute it from "
                "the model's outputs"
            )


def as_step_result(value: Any, batch: Any) -> StepResult:
    """compute_loss's answer as a StepResult: a scalar mean (weighted by the batch's size), or {loss, count, ...}."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise BadUserValue(
                f"compute_loss in model.py returned a tensor of shape {tuple(value.shape)}: return a scalar"
            )
        count = torch.as_tensor(_batch_size(batch), dtype=torch.float64, device=value.device)
        return StepResult(loss=value.reshape(()), count=count, sums={}, is_sum=False)
    if isinstance(value, dict) and "loss" in value and "count" in value:
        loss = value["loss"]
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise BadUserValue("compute_loss in model.py returned a 'loss' that is not a scalar tensor: return its SUM")
        count = torch.as_tensor(value["count"], dtype=torch.float64, device=loss.device).reshape(())
        sums = {}
        for name, total in value.items():
            if name in ("loss", "count"):
                continue
            total = torch.as_tensor(total, device=loss.device)
            if total.numel() != 1:
                raise BadUserValue(
                    f"compute_loss in model.py returned {name!r} of shape {tuple(total.shape)}: not a sum"
                )
            sums[name] = total.reshape(())
        return StepResult(loss=loss.reshape(()), count=count, sums=sums, is_sum=True)
    raise BadUserValue(
        f"compute_loss in model.py returned a {type(value).__name__}: return a scalar tensor (the batch's mean "
        "loss) or a dict with 'loss' (a SUM) and 'count' (what it sums over)"
    )


def _sums(value: Any) -> dict[str, torch.Tensor]:
    """val_metrics' answer as {name: scalar tensor}; one line naming val_metrics and the key otherwise."""
    if not isinstance(value, Mapping):
        raise BadUserValue(
            f"val_metrics in model.py returned a {type(value).__name__}: return a dict of per-batch SUMS"
        )
    if "loss" in value:
        raise BadUserValue("val_metrics in model.py returns 'loss': that name is val_loss's (from loss_fn); rename it")
    sums = {}
    for name, total in value.items():
        try:
            tensor = torch.as_tensor(total)
        except (TypeError, ValueError, RuntimeError):
            tensor = None
        if tensor is None or tensor.numel() != 1 or tensor.is_complex():
            what = f"of shape {tuple(tensor.shape)}" if tensor is not None else f"as a {type(total).__name__}"
            raise BadUserValue(
                f"val_metrics in model.py returned {name!r} {what}: each value must be one real number, the batch's "
                "SUM (e.g. correct.sum())"
            )
        sums[str(name)] = tensor.reshape(())
    return sums


def _batch_size(batch: Any) -> int:
    """The number of samples in a batch: the first dimension of its first tensor."""
    leaves = tensors_in(batch)
    if not leaves or leaves[0].dim() == 0:
        raise BadUserValue(
            "a batch holds no tensor with a batch dimension: return a dict with 'count' from compute_loss"
        )
    if leaves[0].shape[0] == 0:
        raise BadUserValue(
            "a batch of 0 items reached the step: collate(items) in data.py returned an empty batch (did it filter "
            "out every item?); keep at least one item per batch, or return {'loss': ..., 'count': 0} from "
            "compute_loss for a batch that has none"
        )
    return int(leaves[0].shape[0])


def _device_of(*values: Any) -> torch.device:
    for value in values:
        for leaf in tensors_in(value):
            return leaf.device
    return torch.device("cpu")


# -- what the builders return, checked where it is made ----------------------------------------------------------


def _check_datasets(value: Any) -> None:
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        what = f"{len(value)} values" if isinstance(value, (tuple, list)) else f"a {type(value).__name__}"
        raise RunError(f"build_datasets in data.py returned {what}: return (train, val), val may be None")
    for kind, dataset in (("training", value[0]), ("validation", value[1])):
        if dataset is None or isinstance(dataset, torch.utils.data.IterableDataset):
            continue
        try:
            len(dataset)
        except TypeError:
            stream = " or make it a torch.utils.data.IterableDataset (a stream)" if kind == "training" else ""
            raise RunError(
                f"build_datasets in data.py returned a {kind} set ({type(dataset).__name__}) without len(): a "
                f"map-style dataset (dataset[i]) needs __len__ too, for the trainer to give each rank its share; "
                f"define __len__{stream}"
            ) from None
    if isinstance(value[1], torch.utils.data.IterableDataset):
        raise RunError(
            "build_datasets in data.py returned a validation set that is an IterableDataset (a stream): evaluation "
            "takes every validation item once by index, over the ranks; return a map-style dataset (len() and "
            "dataset[i], e.g. a list of items) for validation, or None for no evaluation"
        )


def _check_model(value: Any) -> None:
    if not isinstance(value, torch.nn.Module):
        raise RunError(f"build_model in model.py returned a {type(value).__name__}: return the torch.nn.Module")


def _check_weights_path(value: Any) -> None:
    if value is not None and not isinstance(value, (str, os.PathLike)):
        raise RunError(
            f"pretrained_weights in model.py returned a {type(value).__name__}: return the path of the starting "
            "weights (a .safetensors file, a Hugging Face model folder, a .pt/.pth state dict), or None for none"
        )


def _check_optimizer(value: Any) -> None:
    optimizers = value if isinstance(value, (list, tuple)) else [value]
    if not optimizers or not all(isinstance(each, torch.optim.Optimizer) for each in optimizers):
        raise RunError(
            f"build_optimizer in model.py returned {_shown(value)}: return a torch.optim.Optimizer (param groups "
            "allowed), or a list of them; delete build_optimizer for the default AdamW"
        )


def _check_scheduler(value: Any) -> None:
    if isinstance(value, (list, tuple)):
        raise RunError(
            f"build_scheduler in model.py returned {_shown(value)}: return one LRScheduler of the optimizer it is "
            "given. When build_optimizer returns several optimizers, build_scheduler is given them as one, whose "
            "param_groups are all of theirs: one schedule moves them all (LambdaLR(optimizer, [f, g, ...]) gives "
            "each group a function of its own)"
        )
    if isinstance(value, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise RunError(
            "build_scheduler in model.py returned a ReduceLROnPlateau, which steps on a metric: the trainer "
            "steps the schedule once per optimizer step, with no argument; return a schedule of the steps "
            "(LambdaLR, OneCycleLR, CosineAnnealingLR, ...)"
        )
    if not isinstance(value, torch.optim.lr_scheduler.LRScheduler):
        raise RunError(
            f"build_scheduler in model.py returned {_shown(value)}: return a torch.optim.lr_scheduler.LRScheduler "
            "of the optimizer it is given; delete build_scheduler for the default warmup and cosine decay"
        )


def _shown(value: Any) -> str:
    if value is None:
        return "None"
    if isinstance(value, (list, tuple)):
        return f"a {type(value).__name__} of {', '.join(sorted({type(each).__name__ for each in value})) or 'nothing'}"
    return f"a {type(value).__name__}"


def _default_collate(items: list) -> Any:
    """torch's default collate; items it cannot stack (tensors of different lengths) are told in one line."""
    try:
        return torch.utils.data.default_collate(items)
    except RuntimeError as exc:
        if "stack expects each tensor to be equal size" not in str(exc):
            raise
        raise BadUserValue(
            f"the items of a batch have different sizes ({exc}), and torch's default collate stacks them: write "
            "collate(items) in data.py to make one batch of them (pad them to the longest, or cut them to one length)"
        ) from None
