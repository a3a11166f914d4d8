"""--activation-checkpointing: units whose activations are recomputed in backward instead of kept from forward.

The units are the model's shard units (model.py's `shard_units(model)`, else parallel.default_shard_units), under
ddp as under fsdp. `full` checkpoints every unit, `selective` every second one (the 2nd, 4th, ... in the order the
units come; each module of a list unit on its own): a checkpointed unit keeps only its inputs from forward and runs
its forward again in backward, which costs about one more forward of it per step.

How: the unit's class is swapped for a subclass whose `forward` runs the original one under
`torch.utils.checkpoint.checkpoint(use_reentrant=False, preserve_rng_state=True)`, before fully_shard, DDP and
torch.compile see the model. So the module tree and its state_dict keys do not change (snapshots, exports and
pretrained weights are unaffected, unlike with checkpoint_wrapper's `_checkpoint_wrapped_module.` prefix), module
hooks (FSDP's gathers) stay outside the recomputed region as they are outside `forward`, the recompute draws the
same random numbers as the forward did (dropout replays its masks), and buffers the forward changes in place
(BatchNorm's running statistics) are put back after the recompute, so they are updated once: a run ends
bitwise-equal with it on or off.

A unit's forward may take keyword arguments and non-tensor values; what a recompute cannot replay is an argument
with state of its own that the forward may change (a Hugging Face `Cache`, updated in place): a training call that
passes one stops the run in one line naming the unit and the argument (checked in eager mode, not while
torch.compile traces). A model without units is refused at start-up; a model that is one unit (a wrapper such as a
peft model, whose default unit is its one child) is warned about: recomputed whole, it saves nothing.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import logging
import types
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase
from torch.utils.checkpoint import checkpoint

from . import logs
from .faults import BadUserValue
from .settings import RunError, flag

log = logging.getLogger(__name__)

# What a recompute replays as it is: plain values, and tuples, lists and dicts of them. Anything else may hold state
# the forward changes (a cache it appends to), which the recompute would then see changed and change again.
PLAIN = (
    torch.Tensor,
    type(None),
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    torch.dtype,
    torch.device,
    torch.Size,
    slice,
    type(Ellipsis),
    enum.Enum,
    nn.Module,  # a module passed in (a shared embedding): its parameters are the graph's, not state of the call
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodType,
    functools.partial,
)
_CLASSES: dict[type[nn.Module], type] = {}  # a module class -> its checkpointed subclass
# the configs whose use_cache apply() set to False, by id (a Hugging Face config has no hash)
_CACHE_TURNED_OFF: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def chosen(units: Sequence[Sequence[nn.Module]], mode: str) -> list[nn.Module]:
    """The modules `mode` checkpoints: every unit's (full), or every second unit's, starting with the second
    (selective); none (off)."""
    if mode == "off":
        return []
    picked = units if mode == "full" else units[1::2]
    return [module for unit in picked for module in unit]


def apply(model: nn.Module, units: Sequence[Sequence[nn.Module]], mode: str, is_main: bool = True) -> list[nn.Module]:
    """Checkpoint the modules `mode` picks among `units` (each a list of modules); return them. Before fully_shard,
    DDP and torch.compile: they then see a module whose forward checkpoints itself. `is_main`: this rank says the
    warning every rank meets alike."""
    if mode == "off":
        return []
    if not units:
        raise RunError(
            f"{flag('activation_checkpointing')} {mode}: the model has no units to recompute (no submodule with "
            "parameters): split it into submodules, or return them from shard_units(model) in model.py"
        )
    names = {module: name for name, module in model.named_modules()}
    if len(units) == 1:  # a wrapper (a peft model) is one unit by default: recomputed whole, it keeps it all
        logs.warn_from_rank_0(
            log,
            is_main,
            "%s %s: the model is one unit (%s), so %s; return its blocks from shard_units(model) in model.py",
            flag("activation_checkpointing"),
            mode,
            names.get(units[0][0]) or type(units[0][0]).__name__,
            "nothing is recomputed" if mode == "selective" else "backward recomputes it whole: no memory is saved",
        )
    config: Any = getattr(model, "config", None)  # a Hugging Face model's (a peft model's: its base's)
    if getattr(config, "use_cache", None) is True:  # a cache the blocks update: the recompute cannot replay it
        config.use_cache = False  # for training; an export writes the config as built (config_as_built)
        _CACHE_TURNED_OFF[id(config)] = config
        if is_main:
            log.info("activation checkpointing %s: the model's config.use_cache set to False to train", mode)
    modules = chosen(units, mode)
    for module in modules:
        if not getattr(type(module), "_recomputes_in_backward", False):
            module.__class__ = _checkpointed(type(module))
        module._checkpoint_name = names.get(module, type(module).__name__)
    if modules:
        shown = ", ".join(names.get(m, type(m).__name__) or "(the model)" for m in modules[:4])
        more = f", ... ({len(modules)} in all)" if len(modules) > 4 else ""
        log.info("activation checkpointing %s: recomputed in backward: %s%s", mode, shown, more)
    return modules


def _checkpointed(cls: type[nn.Module]) -> type:
    """`cls` with a forward that checkpoints the original: the same name, so messages and repr are unchanged."""
    if cls not in _CLASSES:

        def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            original = types.MethodType(cls.forward, self)  # the forward this class overrides
            if not torch.is_grad_enabled() or not _needs_backward(self, args, kwargs):
                return original(*args, **kwargs)  # evaluation, a frozen unit: nothing is kept for a backward
            if not torch.compiler.is_compiling():  # a few isinstance checks per call: nothing beside the forward
                _check_replayable(self, args, kwargs)
            # Keyword arguments go in as positional ones: checkpoint looks for the device whose random stream it
            # saves (a GPU's, for dropout) among the positional arguments only.
            keys, count = tuple(kwargs), len(args)

            def run(*values: Any) -> Any:
                return original(*values[:count], **dict(zip(keys, values[count:], strict=True)))

            if torch.compiler.is_compiling():  # the compiled graph changes buffers once, in forward
                return checkpoint(run, *args, *kwargs.values(), use_reentrant=False, preserve_rng_state=True)
            buffers = _ChangedBuffers(self)
            return checkpoint(
                run,
                *args,
                *kwargs.values(),
                use_reentrant=False,
                preserve_rng_state=True,
                context_fn=lambda: (buffers.forward(), buffers.recompute()),
            )

        subclass = type(cls.__name__, (cls,), {"forward": forward, "_recomputes_in_backward": True})
        subclass.__qualname__, subclass.__module__ = cls.__qualname__, cls.__module__
        _CLASSES[cls] = subclass
    return _CLASSES[cls]


@contextlib.contextmanager
def config_as_built(model: nn.Module) -> Iterator[None]:
    """Within: a Hugging Face model's config.use_cache as it was built, where apply() turned it off to train (what
    its save_pretrained writes for inference)."""
    config: Any = getattr(model, "config", None)
    turned_off = config is not None and _CACHE_TURNED_OFF.get(id(config)) is config
    if turned_off:
        config.use_cache = True
    try:
        yield
    finally:
        if turned_off:
            config.use_cache = False


def _needs_backward(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> bool:
    """Whether backward reaches the unit: a parameter of it, or a tensor given to it, requires a gradient. A unit
    that backward does not reach keeps nothing to recompute (and, compiled, its dropout could not be replayed)."""
    if any(parameter.requires_grad for parameter in module.parameters()):
        return True
    return any(isinstance(value, torch.Tensor) and value.requires_grad for value in _leaves((args, kwargs)))


class _ChangedBuffers:
    """The buffers a unit's forward changes in place, put back as they were after its recompute in backward: updated
    once per forward, as without checkpointing. Those whose version counter the forward moved, and the running
    statistics of norm layers (BatchNorm's kernel updates them without moving it)."""

    def __init__(self, module: nn.Module):
        self.module = module
        self.changed: list[torch.Tensor] = []

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        versions = [(buffer, buffer._version) for buffer in self.module.buffers()]
        yield
        self.changed = [buffer for buffer, version in versions if buffer._version != version]
        for module in self.module.modules():
            if isinstance(module, _NormBase) and module.track_running_stats:
                self.changed += [b for b in module.buffers(recurse=False) if all(b is not c for c in self.changed)]

    @contextlib.contextmanager
    def recompute(self) -> Iterator[None]:
        kept = [(buffer, buffer.clone()) for buffer in self.changed]
        try:
            yield
        finally:
            with torch.no_grad():
                for buffer, value in kept:
                    buffer.copy_(value)


def _check_replayable(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
    arguments = [(f"positional argument {i + 1}", value) for i, value in enumerate(args)]
    arguments += [(f"argument {key!r}", value) for key, value in kwargs.items()]
    for where, value in arguments:
        odd = _not_plain(value)
        if odd is not None:
            raise BadUserValue(
                f"{flag('activation_checkpointing')}: {module._checkpoint_name or 'the model'} "
                f"({type(module).__name__}) gets {where} of type {type(odd).__name__}, which its recompute in "
                "backward cannot replay (an object the forward may change, such as a cache it updates): pass "
                "tensors and plain values only (for a Hugging Face model: use_cache=False), or turn "
                f"{flag('activation_checkpointing')} off"
            )


def _not_plain(value: Any) -> Any:
    """The first value inside `value` (a tuple, list or dict of them) that is not plain, or None."""
    return next((leaf for leaf in _leaves(value) if not isinstance(leaf, PLAIN)), None)


def _leaves(value: Any) -> Iterator[Any]:
    """The values inside `value`, in order: tuples, lists and dicts are looked into, to any depth."""
    if isinstance(value, (tuple, list)):
        for item in value:
            yield from _leaves(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _leaves(item)
    else:
        yield value
