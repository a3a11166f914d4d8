"""Starting weights: model.py's `pretrained_weights(cfg)` names a .safetensors file, a Hugging Face folder or a
.pt/.pth state dict (pytorch_model.bin), keyed by the model's own state_dict() names (a peft model's: its base's);
a run with no snapshot starts from them. Rank 0 alone reads them, in blocks of rows, and broadcasts each; under fsdp
the model is built with its parameters on the meta device (its buffers, and the adapters no weights hold, as
build_model makes them) and each rank keeps the rows of its own shard, so no rank ever holds a second copy of the
model."""

from __future__ import annotations

import functools
import json
import logging
import math
import re
import sys
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.overrides import TorchFunctionMode

from .distributed import DistEnv, decided_on_rank_0
from .hooks import UserCode
from .settings import RunError, cut_short, first_line

log = logging.getLogger(__name__)
SHOWN = 5  # names shown per kind of misfit; the rest are counted
Reader = Callable[[int, int, torch.Tensor], None]  # rows start to stop of one tensor, copied into the tensor given
BLOCK_BYTES = 16 * 2**20  # what rank 0 reads, and every rank receives, at once: the memory a tensor in flight takes
PEFT_WRAPPERS = re.compile(r"\.(?:base_layer|original_module|modules_to_save\.[^.]+)(?=\.)")  # what peft inserts
TORCH_FILE = "pytorch_model.bin"  # save_pretrained's file without safe_serialization: a torch.save state dict


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
            elif (where / TORCH_FILE).is_file():
                self._read_state(where / TORCH_FILE)
            else:
                raise WeightsError(
                    f"{path} is a folder without model.safetensors or model.safetensors.index.json (save_pretrained "
                    "writes them, with safe_serialization, the default)"
                )
        elif where.suffix == ".safetensors" and where.is_file():
            self._read_header(where)
        elif (where.suffix in (".pt", ".pth") or where.name == TORCH_FILE) and where.is_file():
            self._read_state(where)
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

    def _read_state(self, file: Path) -> None:
        state = self._torch_load(file)
        self.shapes = {name: tuple(tensor.shape) for name, tensor in state.items()}
        self.files = dict.fromkeys(state, file)

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


def peft_names(model: nn.Module) -> tuple[str, str] | None:
    """For a peft model: (what its names add before its base's, what its adapters' module names start with: "lora_");
    None for any other model."""
    peft = sys.modules.get("peft")  # a peft model means peft is imported
    if peft is None:
        return None
    from peft.tuners.tuners_utils import BaseTuner

    if isinstance(model, peft.PeftModel) and isinstance(model.base_model, BaseTuner):
        return "base_model.model.", model.base_model.prefix
    if isinstance(model, BaseTuner):
        return "model.", model.prefix
    return None


def weights_name(name: str, peft: tuple[str, str] | None) -> str | None:
    """The name the model's tensor `name` has in its starting weights: its own, or for a peft model (`peft_names`)
    its base model's, without peft's prefix and the wrappers it inserts (`base_layer.` of a layer with adapters, and
    `original_module.`, `modules_to_save.<adapter>.` of a module trained whole); None for an adapter's own tensor,
    which no base's weights hold: it keeps what build_model made."""
    if peft is None:
        return name
    outer, adapter = peft
    base = name.removeprefix(outer)
    if any(part.startswith(adapter) for part in base.split(".")):
        return None
    return PEFT_WRAPPERS.sub("", base)


def loaded_groups(model: nn.Module) -> list[tuple[list[str], torch.Tensor]]:
    """`tied_groups` under the names the starting weights give them (`weights_name`), adapters left out."""
    peft = peft_names(model)
    groups = []
    for names, tensor in tied_groups(model):
        found = [found for found in (weights_name(name, peft) for name in names) if found is not None]
        if found:
            groups.append((list(dict.fromkeys(found)), tensor))
    return groups


def load(model: nn.Module, path: str, env: DistEnv) -> None:
    """The weights at `path` into `model`, in place, on every rank: rank 0 reads each tensor and broadcasts it. A
    peft model gets its base's weights (its adapters keep what build_model made)."""
    groups = loaded_groups(model)
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
                + ". Their names must be the model's own state_dict() keys (a tied parameter under any of its names; "
                "for a peft model, its base model's)"
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


LIKE = {  # tensors made like another: only its shape, dtype and device matter, never its values
    torch.empty_like,
    torch.zeros_like,
    torch.ones_like,
    torch.full_like,
    torch.rand_like,
    torch.randn_like,
    torch.randint_like,
    torch.Tensor.new_empty,
    torch.Tensor.new_zeros,
    torch.Tensor.new_ones,
    torch.Tensor.new_full,
    torch.Tensor.new_tensor,
}


class ParametersOnMeta(TorchFunctionMode):
    """Meanwhile, every nn.Parameter registered is made on the meta device (no memory), but for those `real` counts
    (the how-manieth parameter registered); `made` lists each one in that order. A tensor made like a parameter on
    meta (`ones_like(weight)`, `weight.new_zeros(n)`, `arange(n, device=weight.device)`, `x.to(weight.device)`) is
    made on the default device instead, so buffers made from parameters' shapes hold what build_model makes as
    usual; one made from their values stays on meta (`meta_buffers` finds it)."""

    def __init__(self, real: Collection[int] = ()):
        super().__init__()
        self.real = real
        self.made: list[nn.Parameter] = []
        self.moving = False  # while a parameter goes to meta: not redirected

    def __enter__(self) -> ParametersOnMeta:
        register = self.register = nn.Module.register_parameter

        def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
            if type(param) is nn.Parameter and param.device.type != "meta" and len(self.made) not in self.real:
                self.moving = True
                try:
                    param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
                finally:
                    self.moving = False
            if param is not None:
                self.made.append(param)
            register(module, name, param)

        nn.Module.register_parameter = on_meta  # type: ignore[method-assign, assignment]
        return cast(ParametersOnMeta, super().__enter__())

    def __exit__(self, *exc_info: Any) -> None:
        nn.Module.register_parameter = self.register  # type: ignore[method-assign]
        super().__exit__(*exc_info)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self.moving:
            return func(*args, **kwargs)
        device = kwargs.get("device")
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if func is torch.Tensor.to:
            target, dtype = torch._C._nn._parse_to(*args[1:], **kwargs)[:2]
            if first is not None and not first.is_meta and target is not None and target.type == "meta":
                return first if dtype is None else first.to(dtype)  # made as usual, moved beside a parameter
        elif device is not None:
            if torch.device(device).type == "meta":  # beside a parameter: arange(n, device=weight.device)
                kwargs = {**kwargs, "device": torch.get_default_device()}
        elif func in LIKE and first is not None and first.is_meta:
            kwargs = {**kwargs, "device": torch.get_default_device()}
        return func(*args, **kwargs)


def parameters_on_meta(real: Collection[int] = ()) -> ParametersOnMeta:
    """What accelerate's init_empty_weights(include_buffers=False) does, and more: `ParametersOnMeta`."""
    return ParametersOnMeta(real)


def meta_buffers(model: nn.Module) -> list[str]:
    """The model's buffers left on the meta device that no weights fill (a snapshot's or the starting weights'):
    the non-persistent ones, made from a parameter's values."""
    unsaved = {
        f"{prefix}.{name}" if prefix else name
        for prefix, module in model.named_modules()
        for name in module._non_persistent_buffers_set
    }
    return [name for name, buffer in model.named_buffers() if buffer.is_meta and name in unsaved]


def build_model(
    user: UserCode, cfg: Any, train_data: Any, env: DistEnv, on_meta: bool, warn: Callable[..., None]
) -> nn.Module:
    """build_model's model on this rank's device; with `on_meta`, its parameters on the meta device (for fsdp to
    shard before they take memory: `materialize` then allocates the shards), but for those no starting weights hold
    (a peft model's adapters): build_model runs again (the same random streams) and makes them as usual."""
    if on_meta:
        streams = torch.random.get_rng_state()
        try:
            with parameters_on_meta() as building:
                model = user.build_model(cfg, train_data)
            peft = peft_names(model)
            made: dict[int, int] = {}  # a parameter's first registration (a tied one is registered again)
            for index, parameter in enumerate(building.made):
                made.setdefault(id(parameter), index)
            kept = {
                made[id(parameter)]
                for name, parameter in model.named_parameters(remove_duplicate=False)
                if weights_name(name, peft) is None and id(parameter) in made
            }
            if kept:
                torch.random.set_rng_state(streams)
                with parameters_on_meta(kept):
                    model = user.build_model(cfg, train_data)
            unknown = meta_buffers(model)
            if not unknown:
                return model
            reason = f"its buffer {cut_short(unknown, SHOWN)} is made from a parameter's values"
        except Exception as exc:
            reason = first_line(exc)
        warn(
            "build_model in model.py cannot run with its parameters on the meta device (%s): the model is "
            "built as usual, so each rank holds all of it once before it is sharded",
            reason,
        )
        torch.random.set_rng_state(streams)
    return user.build_model(cfg, train_data).to(env.device)


def materialize(model: nn.Module, device: torch.device) -> None:
    """The (sharded) parameters that are on the meta device, allocated on `device` (not initialized: the weights or
    a snapshot fill them); the other parameters and the buffers keep the values build_model gave them. A no-op when
    none is on meta."""
    if not any(parameter.is_meta for parameter in model.parameters()):
        return
    kept = {
        name: (value.to_local() if isinstance(value, DTensor) else value).detach().to(device)
        for name, value in [*model.named_parameters(), *model.named_buffers()]
        if not value.is_meta
    }
    names: dict[nn.Parameter, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        names.setdefault(parameter, []).append(name)
    model.to_empty(device=device)  # fully_shard keeps tied parameters one; without it, each is made anew: tie them
    for first, *others in (tied for tied in names.values() if len(tied) > 1):
        for name in others:
            owner, _, attribute = name.rpartition(".")
            if model.get_parameter(name) is not model.get_parameter(first):
                setattr(model.get_submodule(owner), attribute, model.get_parameter(first))
    with torch.no_grad():
        for name, value in [*model.named_parameters(), *model.named_buffers()]:
            if name in kept:
                (value.to_local() if isinstance(value, DTensor) else value).copy_(kept[name])


def source(user: UserCode, cfg: Any) -> str | None:
    """Where pretrained_weights in model.py says the starting weights are; None without it, or when it says None."""
    where = None if user.pretrained_weights is None else user.pretrained_weights(cfg)
    return None if where is None else str(where)
