"""Every setting of a run, its default and what it means, in one dataclass.

Each field becomes a command-line flag (`batch_size` -> `--batch-size`); unknown flags are an error.
"""

import argparse
import dataclasses
import os
from dataclasses import dataclass, field

from . import baked

AMP_MODES = ("off", "bf16", "fp16")
WANDB_MODES = ("online", "offline", "disabled")
BACKENDS = ("auto", "nccl", "gloo")


def option(default, help, **argparse_kwargs):
    """A config field with its help text (shown by --help) and extra argparse settings."""
    return field(default=default, metadata={"help": help, **argparse_kwargs})


@dataclass
class Config:
    # How long to train.
    epochs: int = option(3, "passes over the dataset (ignored when --max-steps is set)")
    max_steps: int = option(0, "stop after this many optimizer steps in total; 0 = run all epochs")
    # Optimization.
    batch_size: int = option(32, "samples per rank per micro-step")
    grad_accum: int = option(1, "micro-steps per optimizer step (gradients sync on the last one only)")
    lr: float = option(3e-3, "peak learning rate (linear warmup, then cosine decay to 10%%)")
    warmup_steps: int = option(20, "learning-rate warmup, in optimizer steps")
    weight_decay: float = option(0.01, "AdamW weight decay")
    amp: str = option("off", "mixed precision: bf16, or fp16 (with a gradient scaler on CUDA)", choices=AMP_MODES)
    seed: int = option(1337, "seed for weights, data order and every rank's random streams")
    # Model and data (the defaults are a small demo: replace model.py and data.py with yours).
    width: int = option(256, "hidden width of the demo model")
    depth: int = option(3, "hidden layers of the demo model")
    dropout: float = option(0.1, "dropout probability of the demo model")
    dataset_size: int = option(8192, "samples in the demo dataset")
    num_workers: int = option(0, "DataLoader worker processes per rank")
    # Snapshots (fault tolerance).
    snapshot_dir: str = option("snapshots", "folder for snapshots; a run resumes from the newest good one in it")
    snapshot_every: int = option(100, "save a snapshot every this many optimizer steps (and always at the end)")
    keep_snapshots: int = option(3, "snapshots to keep (>= 2: the newest may be mid-write when a job dies)")
    # Logging and tracking.
    log_every: int = option(10, "log the loss every this many optimizer steps")
    log_file: str = option(
        "logs/train.log",
        "log file: rank 0's records and every rank's warnings; put {rank} in the name for one full file per rank; "
        "'' for none",
    )
    wandb: str = option(
        "",
        "wandb mode on rank 0; default: " + ("online if a wandb API key is set up, else offline" if baked.USE_WANDB else "disabled"),
        choices=WANDB_MODES,
    )
    wandb_project: str = option(baked.WANDB_PROJECT, "wandb project")
    # Distributed.
    backend: str = option(baked.BACKEND, "process group backend: auto = nccl with CUDA, else gloo", choices=BACKENDS)
    dist_timeout: float = option(600.0, "seconds a collective may wait for a rank before the job fails (long while debugging)")
    threads_per_rank: int = option(0, "CPU threads per rank; 0 = this machine's cores / ranks on it")

    def to_dict(self):
        return dataclasses.asdict(self)


def _flag(name):
    return "--" + name.replace("_", "-")


def build_parser():
    parser = argparse.ArgumentParser(
        prog="train.py",
        description="Train with DistributedDataParallel. Runs as `python train.py` or under torchrun.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    for spec in dataclasses.fields(Config):
        extra = {k: v for k, v in spec.metadata.items() if k != "help"}
        parser.add_argument(_flag(spec.name), type=spec.type, default=spec.default, help=spec.metadata["help"], **extra)
    return parser


POSITIVE = ("epochs", "batch_size", "grad_accum", "snapshot_every", "log_every", "width", "depth", "dataset_size")
NON_NEGATIVE = ("max_steps", "warmup_steps", "num_workers", "threads_per_rank")


def validate(cfg, fail):
    """Call fail(message) for the first setting that cannot work."""
    for name in POSITIVE:
        if getattr(cfg, name) < 1:
            fail(f"{_flag(name)} must be >= 1, got {getattr(cfg, name)}")
    for name in NON_NEGATIVE:
        if getattr(cfg, name) < 0:
            fail(f"{_flag(name)} must be >= 0, got {getattr(cfg, name)}")
    if cfg.keep_snapshots < 2:
        fail(f"--keep-snapshots must be >= 2 (the newest snapshot may be mid-write when a job dies), got {cfg.keep_snapshots}")
    if not 0 <= cfg.dropout < 1:
        fail(f"--dropout must be in [0, 1), got {cfg.dropout}")
    if not cfg.lr > 0:
        fail(f"--lr must be > 0, got {cfg.lr}")
    if not cfg.dist_timeout > 0:
        fail(f"--dist-timeout must be > 0 seconds, got {cfg.dist_timeout}")
    if not cfg.snapshot_dir:
        fail("--snapshot-dir must not be empty")


def default_wandb_mode():
    """Online only when wandb can log in without asking; never stop a run at a login prompt."""
    if not baked.USE_WANDB:
        return "disabled"
    if os.environ.get("WANDB_MODE") in WANDB_MODES:
        return os.environ["WANDB_MODE"]
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    netrc = os.path.join(os.path.expanduser("~"), ".netrc")
    try:
        with open(netrc, encoding="utf-8") as handle:
            return "online" if "api.wandb.ai" in handle.read() else "offline"
    except OSError:
        return "offline"


def parse_args(argv=None):
    parser = build_parser()
    cfg = Config(**vars(parser.parse_args(argv)))
    validate(cfg, parser.error)
    if not cfg.wandb:
        cfg.wandb = default_wandb_mode()
    return cfg
