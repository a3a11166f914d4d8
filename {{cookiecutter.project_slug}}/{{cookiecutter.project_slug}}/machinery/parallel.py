"""The model across the ranks: DDP (--strategy ddp) or FSDP2 (--strategy fsdp), mixed precision, torch.compile,
activation checkpointing (checkpointing.py) applied to the units first.

Snapshots and exports always use the unwrapped model (`DistributedModel.model`): its own state_dict, no
`module.` prefix.
"""

from __future__ import annotations

import contextlib
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from . import checkpointing
from .distributed import DistEnv
from .hooks import UserCode
from .settings import RunError, flag
from .snapshot import capture_rng, restore_rng

AMP_DTYPES = {"off": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def default_shard_units(model: nn.Module) -> list[nn.Module]:
    """Each direct child that has parameters; a container without forward (ModuleList, ModuleDict) is no unit
    itself (fully_shard refuses it): its children are, recursively. Typically: each transformer block.

    Modules that share a parameter (tied input and output embeddings, as in most causal LMs) must be one unit or
    none: a child that shares a parameter with a module outside it is not a unit, its children are, and a module
    that holds a shared parameter itself is left to the root (sharded with the model as a whole)."""
    names: dict[nn.Parameter, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        names.setdefault(parameter, []).append(name)
    return _units(model, "", {p: n for p, n in names.items() if len(n) > 1})


def _units(module: nn.Module, prefix: str, shared: dict[nn.Parameter, list[str]]) -> list[nn.Module]:
    units: list[nn.Module] = []
    for name, child in module.named_children():
        if not any(True for _ in child.parameters()):
            continue
        path = f"{prefix}{name}."
        shared_outside = any(
            any(not other.startswith(path) for other in others)
            for parameter, others in shared.items()
            if any(other.startswith(path) for other in others)
        )
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)) or shared_outside:
            units += _units(child, path, shared)
        else:
            units.append(child)
    return units


def scalar_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The model's 0-d parameters."""
    return [parameter for parameter in model.parameters() if parameter.dim() == 0]


class DistributedModel:
    """The user's model on this rank's device, sharded (fsdp) or wrapped (ddp), with autocast for --amp."""

    def __init__(self, model: nn.Module, cfg: Any, env: DistEnv, user: UserCode):
        self.model, self.cfg, self.env, self.user = model, cfg, env, user
        self.sharded = cfg.strategy == "fsdp"
        self.amp_dtype = AMP_DTYPES[cfg.amp]
        units = self.units() if self.sharded or cfg.activation_checkpointing != "off" else []
        # Before fully_shard, DDP and torch.compile: they see modules whose forward recomputes in backward
        self.recomputed = checkpointing.apply(model, units, cfg.activation_checkpointing, env.is_main)
        if self.sharded:
            self._shard(units)  # before the optimizer is built: it must hold the sharded parameters
        self.distributed: nn.Module = model  # what forward runs through: DDP's wrapper, or the (sharded) model
        self.for_steps: nn.Module = model  # the same, compiled when --compile
        self._settle_pending = False
        self._sync = True  # whether this micro-batch's backward reduces the gradients over the ranks

    def wrap(self, resumed: bool, with_other_jobs: bool = False) -> None:
        """DDP (--strategy ddp with 2 or more ranks: for one, DDP would only copy its gradients into buckets), then
        torch.compile if asked. `with_other_jobs` (partners.py): DDP at any number of ranks, its buckets averaged with
        the other jobs' too, which must line up (settle_bucket_order). Under fsdp, the 0-d parameters it leaves whole
        on every rank (`_shard`) get their gradients averaged over the ranks here, once they are the model's own
        (after `pretrained.materialize`)."""
        if self.sharded and self.env.world_size > 1:
            for parameter in scalar_parameters(self.model):
                if parameter.requires_grad:
                    parameter.register_post_accumulate_grad_hook(self._average)
        if (self.env.world_size > 1 or with_other_jobs) and not self.sharded:
            device_ids = [self.env.device.index] if self.env.device.type == "cuda" else None
            self.distributed = DistributedDataParallel(self.model, device_ids=device_ids, gradient_as_bucket_view=True)
            self._settle_pending = resumed or with_other_jobs
        self.for_steps = cast(nn.Module, torch.compile(self.distributed)) if self.cfg.compile else self.distributed

    def autocast(self) -> contextlib.AbstractContextManager:
        return torch.autocast(self.env.device.type, dtype=self.amp_dtype, enabled=self.amp_dtype is not None)

    def sync_gradients(self, last: bool) -> contextlib.AbstractContextManager:
        """Gradients are reduced over the ranks on the last micro-batch of a step only."""
        if self.sharded:  # FSDP reduce-scatters gradients on the last micro-step only
            cast(FSDPModule, self.model).set_requires_gradient_sync(last)
            self._sync = last
            return contextlib.nullcontext()
        if last or not isinstance(self.distributed, DistributedDataParallel):
            return contextlib.nullcontext()
        return cast(DistributedDataParallel, self.distributed).no_sync()

    def settle_bucket_order(self, batch: Any) -> None:
        """Give a resumed job's fresh DDP the gradient buckets an uninterrupted job has by now; once, before the
        first resumed step (a no-op otherwise).

        DDP rebuilds its buckets in the order gradients arrive in the first backward. Until then, gloo's ring
        all-reduce over 3 or more ranks sums in another order (the first resumed step would differ in the last
        bits), and a job that joins others (partners.py) would average its buckets with theirs in another layout.
        So: one extra forward and backward in eval mode on the step's first micro-batch, its gradients thrown away
        and the random streams put back; weights, optimizer, buffers and data position are unchanged.
        """
        if not self._settle_pending:
            return
        self._settle_pending = False
        rng_state = capture_rng()
        self.distributed.eval()
        with self.autocast():
            result = self.user.step(self.distributed, batch)
        result.loss.backward()
        for parameter in self.model.parameters():  # every parameter's, not only those the optimizer holds
            parameter.grad = None
        self.distributed.train()
        restore_rng(rng_state)

    def _average(self, parameter: torch.Tensor) -> None:
        """A whole 0-d parameter's gradient, summed over its micro-batches, averaged over the ranks (as FSDP's)."""
        if self._sync and parameter.grad is not None:
            dist.all_reduce(parameter.grad)
            parameter.grad.div_(self.env.world_size)

    def _shard(self, units: list[list[nn.Module]]) -> None:
        """FSDP2: fully_shard each unit (model.py's shard_units(model), else default_shard_units), then the root.
        Mixed precision (--amp bf16) is FSDP's: bf16 compute, fp32 gradient reduction. A 0-d parameter (CLIP's
        logit_scale), which fully_shard cannot cut, stays whole on every rank, as under ddp (`wrap`)."""
        if not self.env.is_distributed:
            raise RunError(
                f"{flag('strategy')} fsdp shards the model across the ranks of a torchrun job: start it with torchrun "
                f"(one rank works: --nproc_per_node=1), or use {flag('strategy')} ddp"
            )
        if self.cfg.amp == "fp16":
            raise RunError(f"{flag('amp')} fp16 is not available with {flag('strategy')} fsdp: use {flag('amp')} bf16")
        policy = MixedPrecisionPolicy(
            param_dtype=self.amp_dtype, reduce_dtype=torch.float32 if self.amp_dtype else None
        )
        whole = set(scalar_parameters(self.model))
        for modules in units:
            try:
                fully_shard(modules if len(modules) > 1 else modules[0], mp_policy=policy, ignored_params=whole)
            except ValueError as exc:
                if "shared" not in str(exc):
                    raise
                raise RunError(
                    f"shard_units in model.py puts modules that share a parameter into different units ({exc}): "
                    "return them together as one list, e.g. [model.embed, model.lm_head], or leave one out (the "
                    "root shards it)"
                ) from None
        fully_shard(self.model, mp_policy=policy, ignored_params=whole)

    def units(self) -> list[list[nn.Module]]:
        """The model's units, each as a list of modules: model.py's shard_units(model), else default_shard_units.
        fsdp shards each on its own; --activation-checkpointing recomputes them."""
        shard_units = self.user.shard_units or default_shard_units
        units = []
        for unit in shard_units(self.model):
            modules = list(unit) if isinstance(unit, (list, tuple)) else [unit]
            for module in modules:
                if not isinstance(module, nn.Module) or isinstance(module, (nn.ModuleList, nn.ModuleDict)):
                    what = type(module).__name__
                    raise RunError(
                        f"shard_units in model.py returned a {what} as a unit: return submodules with a forward, or "
                        "lists of them (each list sharded as one unit); for a ModuleList or ModuleDict, name its "
                        "children"
                    )
            units.append(modules)
        return units
