"""Starting weights: model.py's `pretrained_weights(cfg)` names a .safetensors file, a Hugging Face folder or a
.pt/.pth state dict, keyed by the model's own state_dict() names; a run with no snapshot starts from them. Rank 0
alone reads them, in blocks of rows, and broadcasts each; under fsdp the model is built with its parameters on the
meta device and each rank keeps the rows of its own shard, so no rank ever holds a second copy of the model."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from .distributed import DistEnv, decided_on_rank_0
from .hooks import UserCode
from .settings import RunError, cut_short, first_line

log = logging.getLogger(__name__)
SHOWN = 5  # names shown per kind of misfit; the rest are counted
Reader = Callable[[int, int, torch.Tensor], None]  # rows start to stop of one tensor, copied into the tensor given
BLOCK_BYTES = 16 * 2**20  # what rank 0 reads, and every rank receives, at once: the memory a tensor in flight takes


class WeightsError(Exception):
    """The weights cannot be read, or do not fit the model: one line."""


class WeightsFile:
    """The tensors of a .safetensors file, a Hugging Face folder or a .pt/.pth state dict: every name's shape at
    once (from the headers), each tensor read when asked for."""

    def __init__(self, path: str):
        self.path = path
        where = Path(path)
        self.files: dict[str, Path] = {}  # name -> the file that holds it
        self.shapes: dict[str, tuple[int, ...]] = {}
        if where.is_dir():
            index, single = where / "model.safetensors.index.json", where / "model.safetensors"
            if index.is_file():
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
                for shard in sorted(set(weight_map.values())):
                    self._read_header(where / shard)
            elif single.is_file():
                self._read_header(single)
            else:
                raise WeightsError(
                    f"{path} is a folder without model.safetensors or model.safetensors.index.json (save_pretrained "
                    "writes them, with safe_serialization, the default)"
                )
        elif where.suffix == ".safetensors" and where.is_file():
            self._read_header(where)
        elif where.suffix in (".pt", ".pth") and where.is_file():
            state = self._torch_load(where)
            self.shapes = {name: tuple(tensor.shape) for name, tensor in state.items()}
            self.files = dict.fromkeys(state, where)
        elif not where.exists():
            raise WeightsError(f"{path} does not exist")
        else:
            raise WeightsError(
                f"{path} is neither a .safetensors file, a Hugging Face model folder nor a .pt/.pth state dict"
            )

    def _read_header(self, file: Path) -> None:
        with _safe_open(file) as handle:
            names = handle.keys()  # a safe_open handle is no dict: it has keys() but no iteration
            for name in names:
                self.shapes[name] = tuple(handle.get_slice(name).get_shape())
                self.files[name] = file

    def _torch_load(self, file: Path) -> dict[str, torch.Tensor]:
        state = torch.load(file, map_location="cpu", mmap=True, weights_only=True)  # nothing read until used
        if not isinstance(state, dict) or not all(isinstance(value, torch.Tensor) for value in state.values()):
            inner = [key for key, value in state.items() if isinstance(value, dict)] if isinstance(state, dict) else []
            hint = f" (its {inner[0]!r} may be one: save that alone)" if inner else ""
            raise WeightsError(f"{self.path} holds no state dict (names -> tensors){hint}")
        return state

    def rows(self, name: str, start: int, stop: int, out: torch.Tensor) -> None:
        """Rows `start` to `stop` of the tensor `name` (a 0-d tensor: all of it) copied into `out`; its file is open
        only meanwhile, so no more of its pages than these rows' are ever mapped."""
        file = self.files[name]
        if file.suffix == ".safetensors":
            with _safe_open(file) as handle:
                part = handle.get_slice(name)
                out.copy_(part[start:stop] if self.shapes[name] else part[...])  # the slice may map the file
            return
        tensor = self._torch_load(file)[name]
        out.copy_(tensor[start:stop] if tensor.dim() else tensor)


def _safe_open(file: Path) -> Any:
    try:
        from safetensors import safe_open
    except ImportError:
        raise WeightsError(f"reading {file} needs the safetensors package: pip install safetensors") from None
    return safe_open(str(file), framework="pt", device="cpu")


def tied_groups(model: nn.Module) -> list[tuple[list[str], torch.Tensor]]:
    """The tensors of the model's state_dict, each once, with every name it has (tied parameters have several: they
    stay one tensor, filled in place, or kept tied by fully_shard through to_empty)."""
    groups: dict[int, tuple[list[str], torch.Tensor]] = {}
    for name, value in model.state_dict(keep_vars=True).items():
        if isinstance(value, torch.Tensor):
            groups.setdefault(id(value), ([], value))[0].append(name)
    return list(groups.values())


def misfit(groups: list[tuple[list[str], torch.Tensor]], shapes: dict[str, tuple[int, ...]]) -> dict[str, list[str]]:
    """How weights (their shapes by name: a file's, a snapshot's) do not fit the model's tensors (`tied_groups`): the
    model's they lack, theirs the model has not, and those of another shape; each kind found, none when they fit."""
    known = {name for names, _ in groups for name in names}
    missing = [names[0] for names, _ in groups if not any(name in shapes for name in names)]
    unexpected = [name for name in shapes if name not in known]
    misshaped = [
        f"{name} {list(shapes[name])} in the file, {list(tensor.shape)} in the model"
        for names, tensor in groups
        for name in names
        if name in shapes and shapes[name] != tuple(tensor.shape)
    ]
    kinds = {"missing": missing, "unexpected": unexpected, "of another shape": misshaped}
    return {kind: names for kind, names in kinds.items() if names}


def load(model: nn.Module, path: str, env: DistEnv) -> None:
    """The weights at `path` into `model`, in place, on every rank: rank 0 reads each tensor and broadcasts it."""
    groups = tied_groups(model)
    opened: list[WeightsFile] = []  # rank 0's: it reads, the others receive each tensor

    def open_checked() -> None:
        try:
            opened.append(WeightsFile(path))
        except Exception as exc:  # ours, or a file that is not what its name says: safetensors', torch's or json's
            detail = str(exc) if isinstance(exc, WeightsError) else f"cannot read {path}: {first_line(exc)}"
            raise RunError(f"pretrained_weights in model.py: {detail}") from exc
        kinds = misfit(groups, opened[0].shapes)
        if kinds:
            raise RunError(
                f"the weights in {path} (pretrained_weights in model.py) do not fit the model build_model returns: "
                + "; ".join(f"{kind} {cut_short(names, SHOWN)}" for kind, names in kinds.items())
                + ". Their names must be the model's own state_dict() keys (a tied parameter under any of its names)"
            )

    decided_on_rank_0(env, open_checked, RunError)
    weights = opened[0] if opened else None
    space: list[torch.Tensor] = []  # _copy_in's buffer
    with torch.no_grad():
        for names, target in groups:
            read = None
            if weights is not None:
                read = functools.partial(weights.rows, next(name for name in names if name in weights.shapes))
            _copy_in(target, read, env, space)
    log.info("started from the weights in %s", path)


def blocks(shape: torch.Size, element_size: int) -> list[tuple[int, int]]:
    """A tensor's rows in blocks of at most BLOCK_BYTES (at least one row each); a 0-d tensor is one block."""
    if not shape:
        return [(0, 1)]
    step = max(1, BLOCK_BYTES // max(1, element_size * math.prod(shape[1:])))
    return [(start, min(start + step, shape[0])) for start in range(0, shape[0], step)]


def own_rows(target: DTensor) -> tuple[int, int] | None:
    """The rows of `target` this rank's shard holds when it is sharded by rows on a 1-d mesh (fsdp's Shard(0):
    torch.chunk's cut, checked against the shard's own length); None when it is sharded otherwise."""
    mesh, placements = target.device_mesh, target.placements
    if mesh.ndim != 1 or len(placements) != 1 or not placements[0].is_shard(0) or target.dim() == 0:
        return None
    rows = target.shape[0]
    chunk = -(-rows // mesh.size())
    start = min(rows, mesh.get_local_rank() * chunk)
    stop = min(rows, start + chunk)
    return (start, stop) if target.to_local().shape[0] == stop - start else None


def _copy_in(target: torch.Tensor, read: Reader | None, env: DistEnv, space: list[torch.Tensor]) -> None:
    """The tensor `read` gives on rank 0 (rows start to stop at a time; None on the other ranks) into `target` on
    every rank: the whole tensor, or under fsdp each rank's shard of it. In flight: one block of rows, or the whole
    tensor when it is not sharded by rows (a ddp parameter is itself filled on rank 0 and broadcast in place)."""
    mine = own_rows(target) if isinstance(target, DTensor) else None
    if mine is None:
        if isinstance(target, DTensor):
            whole = torch.empty(target.shape, dtype=target.dtype, device=env.device)
        else:
            whole = target.detach()
        if read is not None:
            for start, stop in blocks(whole.shape, whole.element_size()):
                read(start, stop, whole[start:stop] if whole.dim() else whole)
        if env.is_distributed:
            dist.broadcast(whole, src=0)
        if isinstance(target, DTensor):  # this rank's shard of it
            shard = distribute_tensor(whole, target.device_mesh, target.placements, src_data_rank=None)
            target.to_local().copy_(shard.to_local())
        return
    local, (first, last) = cast(DTensor, target).to_local(), mine
    for start, stop in blocks(target.shape, target.element_size()):
        size = (stop - start) * math.prod(target.shape[1:]) * target.element_size()
        if not space or space[0].numel() < size:  # one buffer for every block: fresh ones would leave memory behind
            space.clear()
            space.append(torch.empty(size, dtype=torch.uint8, device=env.device))
        block = space[0][:size].view(target.dtype).view(stop - start, *target.shape[1:])
        if read is not None:
            read(start, stop, block)
        if env.is_distributed:
            dist.broadcast(block, src=0)
        low, high = max(start, first), min(stop, last)
        if low < high:
            local[low - first : high - first].copy_(block[low - start : high - start])


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Every nn.Parameter registered meanwhile is made on the meta device (no memory); buffers as usual. What
    accelerate's init_empty_weights(include_buffers=False) does: buffers such as rotary tables keep their values."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if type(param) is nn.Parameter and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def build_model(
    user: UserCode, cfg: Any, train_data: Any, env: DistEnv, on_meta: bool, warn: Callable[..., None]
) -> nn.Module:
    """build_model's model on this rank's device; with `on_meta`, its parameters on the meta device (for fsdp to
    shard before they take memory: `materialize` then allocates the shards)."""
    if on_meta:
        try:
            with parameters_on_meta():
                return user.build_model(cfg, train_data)
        except Exception as exc:
            warn(
                "build_model in model.py cannot run with its parameters on the meta device (%s): the model is "
                "built as usual, so each rank holds all of it once before it is sharded",
                first_line(exc),
            )
    return user.build_model(cfg, train_data).to(env.device)


def materialize(model: nn.Module, device: torch.device) -> None:
    """The (sharded) parameters that are on the meta device, allocated on `device` (not initialized: the weights or
    a snapshot fill them); the buffers keep the values build_model gave them. A no-op when none is on meta."""
    if not any(parameter.is_meta for parameter in model.parameters()):
        return
    buffers = {name: buffer for name, buffer in model.named_buffers() if not buffer.is_meta}
    model.to_empty(device=device)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name in buffers:
                buffer.copy_(buffers[name])


def source(user: UserCode, cfg: Any) -> str | None:
    """Where pretrained_weights in model.py says the starting weights are; None without it, or when it says None."""
    where = None if user.pretrained_weights is None else user.pretrained_weights(cfg)
    return None if where is None else str(where)
