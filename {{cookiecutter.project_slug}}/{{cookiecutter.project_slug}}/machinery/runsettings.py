"""The engine's settings, one dataclass per `train.py --help` group (its docstring is the group's title); config.py's
`Config` extends `RunSettings` with the model's and data's. To change a default, declare the field again in `Config`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import baked, settings
from .settings import SettingsT, option
from .storeurl import url_spelling_problem

AMP_MODES = ("off", "bf16", "fp16")
WANDB_MODES = ("online", "offline", "disabled")
BACKENDS = ("auto", "nccl", "gloo")
STRATEGIES = ("ddp", "fsdp")
RESUME_MODES = ("auto", "never")
CHECKPOINTING_MODES = ("off", "full", "selective")  # machinery/checkpointing.py's
START_AFRESH = "start from scratch with --resume never (what the folder holds is moved aside)"


@dataclass
class TrainingSettings:
    """training"""

    epochs: int = option(3, "passes over the dataset (ignored when --max-steps is set)", min=1)
    max_steps: int = option(0, "stop after this many optimizer steps in total; 0 = run all epochs", min=0)
    batch_size: int = option(32, "samples per rank per micro-step", min=1)
    grad_accum: int = option(1, "micro-steps per optimizer step (gradients sync on the last one only)", min=1)
    lr: float = option(3e-3, "peak learning rate (linear warmup, then cosine decay to 10%%)", above=0, max=10)
    warmup_steps: int = option(20, "learning-rate warmup, in optimizer steps", min=0)
    weight_decay: float = option(0.01, "AdamW weight decay", min=0, max=1)
    clip_grad: float = option(0.0, "clip the gradient norm to this; 0 = off", min=0)
    amp: str = option("off", "mixed precision: bf16, or fp16 (with a gradient scaler on CUDA)", choices=AMP_MODES)
    compile: bool = option(False, "torch.compile the model")
    strategy: str = option(
        "ddp",
        "ddp: every rank holds the whole model; fsdp: parameters, gradients and optimizer state are sharded across "
        "the ranks (FSDP2), for a model that does not fit one device (needs torchrun)",
        choices=STRATEGIES,
    )
    activation_checkpointing: str = option(
        "off",
        "recompute activations in backward instead of keeping them from forward, unit by unit (model.py's "
        "shard_units, else each child with parameters), under ddp and fsdp: full = every unit (least memory, about "
        "one more forward per step), selective = every second unit (the 2nd, 4th, ...: about half of each); the "
        "same weights as off. A model without units is refused; so is a unit given an object it may change, such "
        "as a cache (a Hugging Face model's config.use_cache is set to False)",
        choices=CHECKPOINTING_MODES,
    )
    seed: int = option(1337, "seed for weights, data order and every rank's random streams", min=0, max=2**32 - 1)
    num_workers: int = option(0, "DataLoader worker processes per rank", min=0, max=256)


@dataclass
class EvaluationSettings:
    """evaluation and export"""

    eval_every: int = option(100, "evaluate every this many optimizer steps; 0 = only at the end", min=0)
    export_dir: str = option(
        "export",
        "final weights (model.pt) and the best by val_loss (best.pt) go here (a folder or store URL)",
        nonempty=True,
        check=url_spelling_problem,
    )
    metrics_file: str = option("logs/metrics.jsonl", "one JSON object per logged step, written by rank 0; '' for none")


@dataclass
class SnapshotSettings:
    """snapshots (fault tolerance)"""

    snapshot_dir: str = option(
        "snapshots",
        "folder (or store URL: s3://bucket/prefix, gs://, az://) for snapshots; a run resumes from the newest good one",
        nonempty=True,
        check=url_spelling_problem,
    )
    snapshot_every: int = option(100, "save a snapshot every this many optimizer steps (and always at the end)", min=1)
    snapshot_copy: bool = option(
        True,
        "copy the state at a snapshot step into memory kept for it, so that training goes on while it is written "
        "(one more copy of each rank's state, or its shards under fsdp, in CPU memory); --no-snapshot-copy writes "
        "CPU tensors from the state itself, no copy, and the next optimizer step waits until they are written. GPU "
        "tensors are copied into pinned host memory either way",
    )
    keep_snapshots: int = option(
        3,
        "snapshots to keep (>= 2: the newest may be mid-write when a job dies)",
        min=2,
        reason="the newest snapshot may be mid-write when a job dies",
    )
    resume: str = option(
        "auto",
        "auto: continue from the newest good snapshot in --snapshot-dir; never: start from scratch, moving what the "
        "folder holds aside (restarts of this same torchrun job still resume)",
        choices=RESUME_MODES,
    )


@dataclass
class TrackingSettings:
    """logging and tracking"""

    log_every: int = option(10, "log the loss every this many optimizer steps", min=1)
    log_file: str = option(
        "logs/train.log",
        "log file: rank 0's records and every rank's warnings; put {rank} in the name for one full file per rank; "
        "'' for none",
    )
    wandb: str = option(
        "",
        "wandb mode on rank 0; default: "
        + ("online if a wandb API key is set up, else offline" if baked.USE_WANDB else "disabled"),
        choices=WANDB_MODES,
    )
    wandb_project: str = option(baked.WANDB_PROJECT, "wandb project")


@dataclass
class ProcessSettings:
    """processes and devices"""

    backend: str = option(baked.BACKEND, "process group backend: auto = nccl with CUDA, else gloo", choices=BACKENDS)
    dist_timeout: float = option(
        600.0,
        "seconds a collective may wait for a rank before the job fails (long while debugging)",
        above=0,
        max=7 * 24 * 3600,
    )
{%- if cookiecutter.replica_groups == "yes" %}
    fault_tolerance: str = option(
        "off",
        "off: a failed rank restarts the whole torchrun job from the newest snapshot; torchft: replica groups that "
        "keep training while a failed one restarts and takes their state (one torchrun job per group; needs "
        "torchft, TORCHFT_LIGHTHOUSE, REPLICA_GROUP_ID and NUM_REPLICA_GROUPS: see machinery/replicas.py)",
        choices=("off", "torchft"),
    )
{%- endif %}
    threads_per_rank: int = option(0, "CPU threads per rank; 0 = this machine's cores / ranks on it", min=0, max=4096)
    deterministic: bool = option(
        False,
        "deterministic algorithms only (cuBLAS, cuDNN): the same bits from the same inputs on the same GPU, "
        "which a bitwise resume on GPUs needs; slower, and an operation without one fails",
    )


@dataclass
class DebugSettings:
    """finding bugs (docs/debugging.md)"""

    resume_from: int = option(
        0,
        "replay from the kept snapshot of this optimizer step in --snapshot-dir, into <snapshot-dir>.replay-<step> "
        "(snapshots and export; metrics only to a --metrics-file of its own): the original run's files stay as "
        "they are; 0 = off",
        min=0,
    )
    break_at_step: int = option(
        0,
        "call breakpoint() right before optimizer step N's forward (N counted from 1), with batch, model and step "
        "as locals, on every rank or on those DEBUG_RANK names; PYTHONBREAKPOINT picks the debugger; 0 = off",
        min=0,
    )
    profile_steps: str = option(
        "",
        "A:B traces optimizer steps A to B with torch.profiler on every rank, into profile/ beside --log-file "
        "(logs/ when it is ''), and prints the top operators on rank 0; '' = off",
        check=settings.step_range_problem,
    )
    check_replicas: int = option(
        0,
        "every N optimizer steps, compare every rank's parameters and buffers bit for bit and stop at the first "
        "that differs (buffers the forward changes, running statistics, are left out; under fsdp, sharded "
        "parameters too); 0 = off",
        min=0,
    )


@dataclass
class RunSettings(
    DebugSettings, ProcessSettings, TrackingSettings, SnapshotSettings, EvaluationSettings, TrainingSettings
):
    """Every setting of the engine: the groups above, in --help's order (a dataclass takes the fields of its bases
    from the last one to the first)."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def default_wandb_mode() -> str:
    """Online only when wandb can log in without asking; never stop a run at a login prompt."""
    if not baked.USE_WANDB:
        return "disabled"
    if os.environ.get("WANDB_MODE") in WANDB_MODES:
        return os.environ["WANDB_MODE"]
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    try:  # expanduser, not Path.home(): without HOME and a passwd entry (arbitrary-uid containers) it raises
        netrc = Path(os.path.expanduser("~/.netrc")).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return "offline"
    return "online" if "api.wandb.ai" in netrc else "offline"


def parse_args(argv: Sequence[str] | None, config_cls: type[SettingsT]) -> SettingsT:
    """settings.parse_args, with --wandb's default decided."""
    cfg = settings.parse_args(argv, config_cls)
    if isinstance(cfg, RunSettings) and not cfg.wandb:
        cfg = dataclasses.replace(cfg, wandb=default_wandb_mode())
    return cfg
