"""What a snapshot holds: a dict of named parts, each with state_dict() / load_state_dict().

    shared parts (rank 0 writes them once):  model, optimizer, scheduler, scaler, progress (step, data position,
                                             losses), and model.py's extra_state parts
    rank parts (each rank writes its own):   rng (its random streams), data (its place in a stream, for streams)

Parts are saved and restored in the order they were added: the model before the optimizer (which holds its
parameters), the optimizer before the scheduler (which sets its learning rate). Under fsdp the model, the optimizer
and the extra parts are each rank's shards, written with torch.distributed.checkpoint. The random streams are
restored by the trainer itself, last, right before the first step, so that nothing in between draws from them.
Parts of your own: `extra_state` in model.py (docs/recipes.md); they are copied at the snapshot step, on the
training thread, so a part that compute_loss changes is saved as it was at that step.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from . import distributed
from .batches import Progress
from .distributed import DistEnv
from .frozen import FrozenWeights
from .optim import STARTED_WITH, optimizers_of, reapply_hyperparameters
from .pretrained import misfit, tied_groups
from .runsettings import START_AFRESH
from .settings import RunError, first_line, flag
from .snapshot import capture_rng, sharded_keys
from .snapshot.staging import copied

META = ("step", "config", "run_id", "torch_version", "starting_weights")  # what shared.pt holds beside the parts
# Every name a snapshot holds at its top level (load_latest's answer): the trainer's parts, and beside them META and
# what reading a snapshot adds. None of them can name a part of model.py's extra_state.
BESIDE_PARTS = (
    *META,
    "rank_state",
    "rank_states",
    "world_size",
    "sharded_dir",
    "frozen_in",
    "frozen_dir",
    "frozen_filled",
)
RESERVED = ("model", "optimizer", "scheduler", "scaler", "progress", "rng", "data", *BESIDE_PARTS)


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


class ProgressPart:
    def __init__(self, progress: Progress):
        self.progress = progress

    def state_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self.progress)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for spec in dataclasses.fields(Progress):
            if spec.name in state:
                setattr(self.progress, spec.name, state[spec.name])


class ModelPart:
    """The unwrapped model's state_dict; buffers (BatchNorm statistics) are copied at once: forward changes them."""

    def __init__(self, model: nn.Module):
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return _with_buffers_copied(self.model, self.model.state_dict())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        shapes = {name: tuple(value.shape) for name, value in state.items() if isinstance(value, torch.Tensor)}
        kinds = misfit(tied_groups(self.model), shapes)
        if kinds:
            raise ValueError("; ".join(f"{len(names)} {kind}, e.g. {names[0]}" for kind, names in kinds.items()))
        self.model.load_state_dict(state)


class RngPart:
    """This rank's random streams. Restored by the trainer itself, last (see the module docstring)."""

    def state_dict(self) -> dict[str, Any]:
        return capture_rng()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise AssertionError("the random streams are restored last, by the trainer: TrainState.restore returns them")


class ScalerPart:
    """The fp16 gradient scaler; nothing to save or load when it is off."""

    def __init__(self, scaler: torch.amp.GradScaler):
        self.scaler = scaler

    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler.is_enabled() and state:
            self.scaler.load_state_dict(state)


class TrainState:
    """The parts of a snapshot, in order; `sharded` (fsdp): the model, the optimizer and the extra parts are shards."""

    def __init__(self, env: DistEnv, sharded: bool):
        self.env, self.sharded = env, sharded
        self.shared: dict[str, Stateful] = {}
        self.rank: dict[str, Stateful] = {}
        self.extra: list[str] = []  # model.py's extra_state parts, among the shared ones
        self._frozen: FrozenWeights | None = None

    def add(self, name: str, part: Stateful, per_rank: bool = False, extra: bool = False) -> None:
        if name in self.shared or name in self.rank or name in BESIDE_PARTS:
            raise ValueError(f"a snapshot part named {name!r} exists already")
        (self.rank if per_rank else self.shared)[name] = part
        if extra:
            self.extra.append(name)

    def _sharded_parts(self) -> list[str]:
        return ["model", "optimizer", *self.extra] if self.sharded else []

    @property
    def frozen(self) -> FrozenWeights:
        if self._frozen is None:
            self._frozen = FrozenWeights(self._model(), self.env, self.sharded)
        return self._frozen

    def capture(self, without_frozen: bool = False) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any] | None]:
        """(shared parts, this rank's parts, sharded parts or None), the tensors still live (the writer copies them);
        `without_frozen`: the model's frozen parameters are left out (an older snapshot holds them, see frozen.py)."""
        left_out = self.frozen.names if without_frozen else set()
        sharded_state = None
        if self.sharded:
            # DCP keeps one copy of each buffer (BatchNorm statistics): make it rank 0's, as under ddp
            model = self._model()
            distributed.broadcast_buffers(self.env, model)
            model_state, optimizer_state = get_state_dict(model, optimizers_of(self._optimizer()))
            model_state = {key: value for key, value in model_state.items() if key not in left_out}
            _with_buffers_copied(model, model_state)
            sharded_state = {"model": model_state, "optimizer": optimizer_state}
            sharded_state.update({name: copied(self.shared[name].state_dict()) for name in self.extra})
        shared = {name: self._unsharded_state(name, part) for name, part in self.shared.items()}
        if left_out and "model" in shared:
            shared["model"] = {key: value for key, value in shared["model"].items() if key not in left_out}
        return shared, {name: part.state_dict() for name, part in self.rank.items()}, sharded_state

    def _unsharded_state(self, name: str, part: Stateful) -> dict[str, Any]:
        """What shared.pt holds of a part: under fsdp, the optimizer's start only (its state is in the shards)."""
        if name == "optimizer" and self.sharded:
            return {STARTED_WITH: part.started}  # type: ignore[attr-defined]
        if name in self._sharded_parts():
            return {}
        return copied(part.state_dict()) if name in self.extra else part.state_dict()

    def finite(self) -> bool:
        """Whether this rank's weights and optimizer state (its shards, under fsdp) hold no NaN or infinity."""
        tensors = [p.detach() for p in self._model().parameters()]
        for per_parameter in self._optimizer().state.values():
            tensors += [v for v in per_parameter.values() if isinstance(v, torch.Tensor) and v.is_floating_point()]
        return bool(all_finite(tensors))

    def restore(self, resumed: dict[str, Any], folder: str) -> dict[str, Any] | None:
        """Load a snapshot into every part but the random streams; return this rank's random streams (to restore
        last), or None when the snapshot was written by another number of ranks (re-seed them then)."""
        for name in self.extra:
            if name not in resumed:
                raise RunError(
                    f"the snapshot {folder} holds no part {name!r}, which extra_state in model.py returns now: "
                    f"resume without it, or {START_AFRESH}"
                )
        filled: set[str] = set(resumed.get("frozen_filled", ()))  # the model's entries the older snapshot gave
        try:
            if self.sharded:
                filled = self._load_shards(resumed, folder)
            for name, part in self.shared.items():
                if name in self._sharded_parts():
                    continue
                if name not in resumed:
                    raise KeyError(f"no part {name!r}")
                if name in self.extra:
                    self._load_extra(name, resumed[name], folder)
                else:
                    part.load_state_dict(resumed[name])
        except (RuntimeError, ValueError, KeyError, dcp.api.CheckpointException) as exc:
            raise RunError(
                f"the snapshot {folder} does not fit this model ({first_line(exc)}): it was written for another "
                f"model or optimizer: {START_AFRESH}, or pass another {flag('snapshot_dir')}"
            ) from None
        step, held_in = resumed["step"], resumed.get("frozen_in", resumed["step"])
        self.frozen.loaded(step if held_in == step else held_in if self.frozen.names <= filled else None)
        rank_state = resumed.get("rank_state")
        if rank_state is None:  # another world size: no state of this rank's
            return None
        for name, part in self.rank.items():
            if name != "rng":
                part.load_state_dict(rank_state[name])
        return rank_state["rng"]

    def _load_shards(self, resumed: dict[str, Any], folder: str) -> set[str]:
        """Load the model's and optimizer's shards (DCP reshards them for another number of ranks), the entries left
        to an older snapshot from its frozen_dir; return the names of those."""
        model, optimizer = self._model(), self._optimizer()
        started = resumed.get("optimizer", {})
        self.shared["optimizer"].check(started)  # type: ignore[attr-defined]
        current = self.shared["optimizer"].started["param_groups"]  # type: ignore[attr-defined]
        model_state, optimizer_state = get_state_dict(model, optimizers_of(optimizer))
        shards, frozen_folder = resumed["sharded_dir"], resumed.get("frozen_dir", "")
        held = set(sharded_keys(shards, "model")) if frozen_folder else set(model_state)
        elsewhere = {key: value for key, value in model_state.items() if key not in held}
        state: dict[str, Any] = {"model": {k: v for k, v in model_state.items() if k in held}}
        state.update(optimizer=optimizer_state, **{name: self.shared[name].state_dict() for name in self.extra})
        dcp.load(state, checkpoint_id=shards)
        if elsewhere:
            dcp.load({"model": elsewhere}, checkpoint_id=frozen_folder)
            state["model"].update(elsewhere)
        set_state_dict(
            model, optimizers_of(optimizer), model_state_dict=state["model"], optim_state_dict=state["optimizer"]
        )
        reapply_hyperparameters(optimizer, current, started.get(STARTED_WITH, {}).get("param_groups"))
        for name in self.extra:
            self._load_extra(name, state[name], folder)
        return set(elsewhere)

    def _load_extra(self, name: str, state: Any, folder: str) -> None:
        """One part of model.py's extra_state: an error of its own load_state_dict is told as that part's."""
        try:
            self.shared[name].load_state_dict(state)
        except Exception as exc:
            raise RunError(
                f"the part {name!r} of extra_state in model.py cannot load its state from the snapshot {folder}: "
                f"its load_state_dict raised {first_line(exc)}. Fix it, or {START_AFRESH}"
            ) from None

    def _model(self) -> nn.Module:
        return self.shared["model"].model  # type: ignore[attr-defined]

    def _optimizer(self) -> torch.optim.Optimizer:
        return self.shared["optimizer"].optimizer  # type: ignore[attr-defined]


def all_finite(tensors: list[torch.Tensor]) -> torch.Tensor:
    """A 0-dim bool tensor, on the tensors' device (no wait for it): whether none holds a NaN or an infinity. Each
    tensor's sum carries a NaN or infinity on (a sum is 25x cheaper than a max of absolute values on CPU); a finite
    sum beyond float32's range, 3e38, would read as infinite, far past any trained value."""
    tensors = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
    sums = [t.sum(dtype=torch.float32) for t in tensors if t.numel() and t.is_floating_point()]
    if not sums:
        return torch.ones((), dtype=torch.bool)
    return torch.isfinite(torch.stack(sums)).all()


def checked_parts(parts: Any) -> dict[str, Stateful]:
    """extra_state's answer, checked: a dict of names to parts that have state_dict() and load_state_dict()."""
    if not isinstance(parts, dict):
        raise RunError(f"extra_state in model.py returned a {type(parts).__name__}: return a dict of names to parts")
    for name, part in parts.items():
        if not isinstance(name, str) or not name.isidentifier():
            raise RunError(f"extra_state in model.py returned a part named {name!r}: name each with an identifier")
        if name in RESERVED:
            raise RunError(
                f"extra_state in model.py returned a part named {name!r}, a name the snapshot holds already "
                f"({', '.join(RESERVED)}): rename it"
            )
        if not (callable(getattr(part, "state_dict", None)) and callable(getattr(part, "load_state_dict", None))):
            raise RunError(
                f"extra_state in model.py returned {name!r} as a {type(part).__name__}, which has no state_dict() "
                "and load_state_dict(): return parts that have both (a module, an optimizer, an AveragedModel, ...)"
            )
    return parts


def estimated_bytes(model: nn.Module) -> int:
    """Room the first snapshot needs, checked before it is written: the weights, and as much again twice for the
    optimizer's state of those that train (Adam's two moments). The summary reports the size measured on disk."""
    sizes = [(p.numel() * p.element_size(), p.requires_grad) for p in model.parameters()]
    return sum(size * (3 if trains else 1) for size, trains in sizes) + 2**20


def _with_buffers_copied(model: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """`state` with the model's buffers in it copied now: the next forward changes them (BatchNorm statistics)."""
    for name, buffer in model.named_buffers():
        if name in state:
            state[name] = buffer.detach().clone()
    return state
