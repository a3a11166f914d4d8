"""Starting weights: model.py's `pretrained_weights(cfg)` names where they are; a run with no snapshot starts from
them, a resume from its snapshot (the weights are not read again).

Where: a `.safetensors` file, a Hugging Face model folder (`model.safetensors`, or shards listed in
`model.safetensors.index.json`), or a `.pt`/`.pth` state dict (`torch.save(model.state_dict(), path)`). Their names
are the model's own `state_dict()` keys; a tied parameter (GPT-2's `lm_head.weight`, which is
`transformer.wte.weight`) is there under one of its names or both, as `save_pretrained` writes it. A name missing,
unexpected or of another shape stops the run at start-up in one line naming them.

How (at most once per machine, no rank ever holding a second copy of the model):
- Rank 0 alone reads the file, one tensor at a time (each opened, read and closed on its own, so the file's pages do
  not stay mapped), and broadcasts it: under ddp straight into every rank's parameter, in place.
- Under --strategy fsdp, build_model runs with its parameters created on the meta device (no memory; buffers, e.g.
  rotary tables, are made as usual), the model is sharded, its shards allocated (`to_empty`) and the buffers put
  back; each tensor then goes from rank 0 to every rank, which keeps its own shard of it. A rank holds its shards
  plus one full tensor in flight. A model that cannot be built that way (its build reads parameter values) is built
  as usual, with a warning: each rank then holds the whole model once, before it is sharded.
Tied parameters stay one tensor (copied in place, or kept tied by fully_shard through to_empty).
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from .distributed import DistEnv, broadcast_object
from .hooks import UserCode
from .settings import RunError

log = logging.getLogger(__name__)
SHOWN = 5  # names shown per kind of misfit; the rest are counted


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

    def tensor(self, name: str) -> torch.Tensor:
        """The tensor `name`, on the CPU; its file is open only meanwhile, so its pages do not stay mapped."""
        file = self.files[name]
        if file.suffix == ".safetensors":
            with _safe_open(file) as handle:
                return handle.get_tensor(name).clone()  # get_tensor maps the file; a copy outlives the mapping
        return self._torch_load(file)[name].clone()


def _safe_open(file: Path) -> Any:
    try:
        from safetensors import safe_open
    except ImportError:
        raise WeightsError(f"reading {file} needs the safetensors package: pip install safetensors") from None
    return safe_open(str(file), framework="pt", device="cpu")


def tied_groups(model: nn.Module) -> list[tuple[list[str], torch.Tensor]]:
    """The tensors of the model's state_dict, each once, with every name it has (tied parameters have several)."""
    groups: dict[int, tuple[list[str], torch.Tensor]] = {}
    for name, value in model.state_dict(keep_vars=True).items():
        if isinstance(value, torch.Tensor):
            groups.setdefault(id(value), ([], value))[0].append(name)
    return list(groups.values())


def misfit(groups: list[tuple[list[str], torch.Tensor]], shapes: dict[str, tuple[int, ...]], path: str) -> str | None:
    """One line naming the model's tensors the file lacks, the file's the model has not, and those of other shapes."""
    known = {name for names, _ in groups for name in names}
    missing = [names[0] for names, _ in groups if not any(name in shapes for name in names)]
    unexpected = [name for name in shapes if name not in known]
    misshaped = [
        f"{name} {list(shapes[name])} in the file, {list(tensor.shape)} in the model"
        for names, tensor in groups
        for name in names
        if name in shapes and shapes[name] != tuple(tensor.shape)
    ]
    parts = [
        f"{kind} {_listed(names)}"
        for kind, names in (("missing", missing), ("unexpected", unexpected), ("of another shape", misshaped))
        if names
    ]
    if not parts:
        return None
    return (
        f"the weights in {path} (pretrained_weights in model.py) do not fit the model build_model returns: "
        + "; ".join(parts)
        + ". Their names must be the model's own state_dict() keys (a tied parameter under any of its names)"
    )


def _listed(names: list[str]) -> str:
    more = f" and {len(names) - SHOWN} more" if len(names) > SHOWN else ""
    return ", ".join(names[:SHOWN]) + more


def load(model: nn.Module, path: str, env: DistEnv) -> None:
    """The weights at `path` into `model`, in place, on every rank: rank 0 reads each tensor and broadcasts it."""
    groups = tied_groups(model)
    weights, problem = None, None
    if env.is_main:
        try:
            weights = WeightsFile(path)
            problem = misfit(groups, weights.shapes, path)
        except WeightsError as exc:
            problem = f"pretrained_weights in model.py: {exc}"
        except Exception as exc:  # a file that is not what its name says: safetensors', torch's or json's error
            problem = f"pretrained_weights in model.py: cannot read {path}: {type(exc).__name__}: {exc}"
    problem = broadcast_object(env, problem)
    if problem:
        raise RunError(problem)
    with torch.no_grad():
        for names, target in groups:
            source = None
            if weights is not None:
                source = weights.tensor(next(name for name in names if name in weights.shapes))
            _copy_in(target, source, env)
    log.info("started from the weights in %s", path)


def _copy_in(target: torch.Tensor, source: torch.Tensor | None, env: DistEnv) -> None:
    """Rank 0's `source` into `target` on every rank: the whole tensor, or under fsdp each rank's shard of it."""
    if isinstance(target, DTensor):
        full = (
            source.to(env.device, target.dtype)
            if source is not None
            else torch.empty(target.shape, dtype=target.dtype, device=env.device)
        )
        if env.is_distributed:
            dist.broadcast(full, src=0)
        shard = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None)
        target.to_local().copy_(shard.to_local())
        return
    if source is not None:
        target.copy_(source)
    if env.is_distributed:
        dist.broadcast(target.detach(), src=0)


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
                "build_model in model.py cannot run with its parameters on the meta device (%s: %s): the model is "
                "built as usual, so each rank holds all of it once before it is sharded",
                type(exc).__name__,
                str(exc).strip().splitlines()[0] if str(exc).strip() else "",
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
    if user.pretrained_weights is None:
        return None
    where = user.pretrained_weights(cfg)
    return None if where is None else str(where)
