"""What a run leaves for people: exported weights, the summary, the resolved settings, the progress bar. The weights
and the summary go to the export folder that outputs.ExportFolder claimed for the run."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import shutil
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from . import checkpointing
from .distributed import DistEnv
from .settings import first_line, flag, to_toml
from .snapshot import write_atomic

if TYPE_CHECKING:
    from tqdm import tqdm

log = logging.getLogger(__name__)
FINAL = "model.pt"  # the final weights; with them, a model that has save_pretrained also gets its own folder:
HF_FOLDER = "hf"  # <export-dir>/hf, loadable with the library's from_pretrained


@dataclass
class Summary:
    run_id: str  # the run these files belong to (run.json in the snapshot folder and the export folder)
    world_size: int
    steps: int
    total_steps: int
    resumed_from: int  # step the run resumed from; -1 for a fresh start
    samples_seen: int
    first_loss: float
    last_loss: float
    val_loss: float  # the last evaluation's; NaN without validation data
    best_val_loss: float
    best_step: int
    snapshot_dir: str
    newest_snapshot: str
    export_dir: str
    log_file: str
    metrics_file: str
    already_complete: bool = False  # the snapshot was already at the end: nothing was trained
    stop_signal: int = 0  # the signal that stopped the run early, 0 if it finished
    snapshot_bytes: int = 0  # the newest snapshot's size on disk, every file of every rank
    pruned: bool = False  # a sweep's pruner stopped this trial early (trialreport.py)
    # Each rank's seconds of its steps in this process by part (data, compute, optimizer, wait, snapshot) and its
    # steps, in rank order; the rank that held the others up, if one did (measure.py)
    step_times: list = field(default_factory=list)
    straggler: dict | None = None


def export(model: nn.Module, sharded: bool, env: DistEnv, export_dir: str, name: str) -> None:
    """Rank 0 writes the model's weights as a plain state dict to <export-dir>/<name>, atomically (under fsdp every
    rank takes part in gathering them: the same file, loadable into a plain build_model(...)). With the final
    weights, a model that has `save_pretrained` (transformers, peft) also gets <export-dir>/hf."""
    state: dict[str, Any] = {}
    if sharded:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = cast(dict[str, Any], get_model_state_dict(model, options=options))
    elif env.is_main:
        state = model.state_dict()
    if not env.is_main:
        return
    os.makedirs(export_dir, exist_ok=True)
    weights = {key: _own_cpu_tensor(value) for key, value in state.items()}
    write_atomic(os.path.join(export_dir, name), lambda handle: torch.save(weights, handle))
    if name == FINAL and callable(getattr(model, "save_pretrained", None)):
        save_pretrained(model, weights, os.path.join(export_dir, HF_FOLDER))


def _own_cpu_tensor(value: Any) -> Any:
    """`value` as a CPU tensor that holds exactly its own elements, copied only when it is not one already: torch.save
    writes a tensor's whole storage, and under fsdp the gathered weights are new CPU tensors already, so a copy of
    every one would hold the whole model twice on rank 0 while it is written."""
    if not isinstance(value, torch.Tensor):
        return value
    value = value.detach()
    whole = value.is_contiguous() and value.untyped_storage().nbytes() == value.numel() * value.element_size()
    return value if value.device.type == "cpu" and whole else value.to("cpu", copy=True)


def save_pretrained(model: nn.Module, weights: dict[str, Any], folder: str) -> None:
    """The library's own folder, written by its `save_pretrained` from `weights` (transformers: config.json and
    model.safetensors; peft: the adapter's config and weights only), into a temporary folder renamed into place.
    A model whose save_pretrained fails is said in one warning: model.pt holds its weights anyway."""
    partial, old = f"{folder}.tmp-{os.getpid()}", f"{folder}.old-{os.getpid()}"
    try:
        with checkpointing.config_as_built(model):  # use_cache as built, not as trained
            cast(Any, model).save_pretrained(partial, state_dict=dict(weights))  # transformers empties the dict given
    except Exception as exc:  # noqa: BLE001 - the user's model's own method; the run's weights are exported already
        shutil.rmtree(partial, ignore_errors=True)
        log.warning(
            "%s.save_pretrained failed (%s): %s is not written; %s holds the final weights",
            type(model).__name__,
            first_line(exc),
            folder,
            os.path.join(os.path.dirname(folder), FINAL),
        )
        return
    if os.path.lexists(folder):
        os.replace(folder, old)
    os.replace(partial, folder)
    shutil.rmtree(old, ignore_errors=True)


def write_summary(summary: Summary, export_dir: str) -> None:
    fields = {
        k: (v if not isinstance(v, float) or math.isfinite(v) else None) for k, v in dataclasses.asdict(summary).items()
    }
    text = json.dumps(fields, indent=1)
    os.makedirs(export_dir, exist_ok=True)
    write_atomic(os.path.join(export_dir, "summary.json"), lambda f: f.write(text.encode()))


def write_config(cfg: Any, snapshot_dir: str) -> None:
    """The resolved settings, logged once and kept beside the snapshots: `--config` reads the file back to continue
    this run, so it says `resume = "auto"` also when this launch started afresh (`--resume never`)."""
    text = to_toml(dataclasses.replace(cfg, resume="auto") if getattr(cfg, "resume", "auto") != "auto" else cfg)
    write_atomic(os.path.join(snapshot_dir, "config.toml"), lambda f: f.write(text.encode()))
    log.info("settings: %s", " ".join(f"{flag(k)}={v!r}" for k, v in dataclasses.asdict(cfg).items()))


def progress_bar(env: DistEnv, total: int, initial: int) -> tqdm:
    """tqdm on rank 0 when the console is a terminal; disabled (drawing nothing) elsewhere."""
    from tqdm import tqdm

    shown = env.is_main and sys.stderr.isatty()
    return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, leave=False, disable=not shown)


def val_text(summary: Summary) -> str:
    return f", val_loss {summary.val_loss:.4f}" if math.isfinite(summary.val_loss) else ""
