"""A run's start: its parts built from the user's hooks and settings, restored from the newest good snapshot.

What a resume takes from the snapshot, and what from the command line (or --config) of the new launch:
- From the snapshot: every part of state.py (weights, optimizer state, scheduler, scaler, step, data position,
  every rank's random streams), the run id, and the run's length in samples (see `RunLength`).
- From the command line: everything else, applied from the first resumed step. The default learning-rate schedule
  is a function of the samples seen, so a new --lr, --warmup-steps, --max-steps or --epochs rescales it; an
  optimizer hyperparameter that build_optimizer makes differently with the new settings applies, group by group (a
  new --weight-decay applies, a no-decay group stays no-decay; the others, those a scheduler drives among them,
  come from the snapshot: optim.OptimizerPart); --batch-size and --grad-accum change the step size
  while the data position stays exact in samples. The changed settings are logged once.
- A snapshot of another model (other layer names or shapes) stops the run with one line: use --resume never.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

import torch

from . import distributed, outputs, pretrained, tracking
from .batches import Batches, Progress, RunLength
from .optim import (
    OptimizerPart,
    SampleSchedule,
    SchedulerPart,
    as_optimizer,
    default_optimizer,
    optimizer_warnings,
)
from .settings import RunError, flag
from .snapshot import RUN_FILE, SnapshotError
from .state import ModelPart, ProgressPart, RngPart, TrainState, checked_parts
from .step import Stepper
from .stop import STOP_RECORD
from .stream import StreamBatches

if TYPE_CHECKING:
    from .trainer import Trainer

log = logging.getLogger(__name__)
SCHEDULE_SETTINGS = ("max_steps", "epochs", "warmup_steps", "lr")  # what the default learning-rate schedule follows


class ScalerPart:
    """The fp16 gradient scaler; nothing to save or load when it is off."""

    def __init__(self, scaler: torch.amp.GradScaler):
        self.scaler = scaler

    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler.is_enabled() and state:
            self.scaler.load_state_dict(state)


def check_same_data(env: distributed.DistEnv, train: Any, val: Any) -> None:
    """Map-style data is the whole dataset on every rank: the trainer gives each rank its share. Datasets whose
    lengths differ between ranks (split per rank) are refused; a stream (`train` None here) may be split per rank
    (stream.py)."""
    if not env.is_distributed:
        return
    for kind, dataset in (("training", train), ("validation", val)):
        lengths = distributed.all_gather_int(env, -1 if dataset is None else len(dataset))
        if len(set(lengths)) > 1:
            shown = ", ".join(f"rank {rank}: {'none' if n < 0 else n}" for rank, n in enumerate(lengths))
            raise RunError(
                f"build_datasets in data.py returned {kind} sets of different lengths on different ranks ({shown}): "
                "return the whole dataset on every rank, the trainer gives each rank its share of it (a map-style "
                "dataset split per rank, e.g. with datasets.distributed.split_dataset_by_node, would train on part "
                "of each share only; only a stream, an IterableDataset, may be split per rank)"
            )


def build_and_restore(trainer: Trainer) -> dict | None:
    """The run id, the optimizer, the schedule and the data, restored from the newest good snapshot if there is
    one; return this rank's random streams to restore last (None: re-seed them)."""
    cfg, env = trainer.cfg, trainer.env
    try:
        trainer.run_id = tracking.run_id(env, trainer.snapshots.directory)
        # on a store at once, not with the first snapshot: a restart before that one is committed, whichever
        # machine its rank 0 is on, continues this run id (and its metrics file, its wandb run)
        distributed.decided_on_rank_0(env, lambda: trainer.snapshots.keep_beside(RUN_FILE), SnapshotError)
        resumed = trainer.snapshots.resume()
    except SnapshotError as exc:
        raise RunError(str(exc)) from None
    stop_record = os.path.join(trainer.snapshots.directory, STOP_RECORD)
    if env.is_main and os.path.exists(stop_record):
        os.remove(stop_record)  # a new launch, not a restart of a stopped job: it is no longer stopped
    trainer.progress = Progress(step_samples=trainer.global_batch)
    if resumed is not None:  # first: the run's length and the scheduler's total steps depend on it
        folder = trainer.snapshots.step_folder(resumed["step"])
        check_resumable(trainer, resumed, folder)
        ProgressPart(trainer.progress).load_state_dict(resumed["progress"])
    trainer.resumed_from = trainer.progress.step if resumed is not None else -1
    if resumed is None and trainer.starting_weights is not None:  # a resume has them, trained on, in its snapshot
        pretrained.load(trainer.model, trainer.starting_weights, env)
    trainer.length = RunLength(cfg, trainer.progress.step_samples, None if trainer.stream else len(trainer.train_data))
    trainer.total_steps = trainer.length.steps(trainer.progress, trainer.global_batch)

    trainer.optimizer = as_optimizer((trainer.user.build_optimizer or default_optimizer)(cfg, trainer.model))
    for line in optimizer_warnings(trainer.model, trainer.optimizer):
        trainer.warn_from_rank_0("%s", line)
    trainer.user_scheduler = None
    if trainer.user.build_scheduler is not None:
        trainer.scheduler = trainer.user.build_scheduler(cfg, trainer.optimizer, trainer.total_steps)
        trainer.user_scheduler = SchedulerPart(trainer.scheduler)
    else:
        trainer.scheduler = SampleSchedule(trainer.optimizer, trainer.length, trainer.progress)
    trainer.scaler = torch.amp.GradScaler(env.device.type, enabled=cfg.amp == "fp16" and env.device.type == "cuda")
    if trainer.stream:
        trainer.batches = StreamBatches(trainer.train_data, cfg, env, trainer.progress, trainer.user.collate)
    else:
        trainer.batches = Batches(trainer.train_data, cfg, trainer.data_env, trainer.progress, trainer.user.collate)

    # What a snapshot holds, in the order it is restored (state.py): add your own parts here.
    trainer.state = TrainState(env, trainer.sharded)
    trainer.state.add("model", ModelPart(trainer.model))
    trainer.state.add("optimizer", OptimizerPart(trainer.optimizer))
    trainer.state.add("scheduler", trainer.user_scheduler or trainer.scheduler)
    trainer.state.add("scaler", ScalerPart(trainer.scaler))
    trainer.state.add("progress", ProgressPart(trainer.progress))
    trainer.state.add("rng", RngPart(), per_rank=True)
    if isinstance(trainer.batches, StreamBatches):  # a stream's place is each rank's own
        trainer.state.add("data", trainer.batches, per_rank=True)
    if trainer.user.extra_state is not None:  # model.py's own parts (an EMA of the weights, ...)
        for name, part in checked_parts(trainer.user.extra_state(cfg, trainer.model, trainer.optimizer)).items():
            trainer.state.add(name, part, extra=True)

    trainer.stepper = Stepper(
        trainer.parallel,
        trainer.optimizer,
        trainer.scheduler,
        trainer.scaler,
        trainer.user,
        cfg,
        env,
        trainer.progress,
        trainer.partners,
    )
    if resumed is None:
        return None
    rng_state = trainer.state.restore(resumed, folder)
    log_changed_settings(trainer, resumed, folder)
    return rng_state


def claim_outputs(trainer: Trainer) -> None:
    """The export folder and the metrics file, for this run (outputs.py); a problem stops every rank alike."""
    cfg, env = trainer.cfg, trainer.env
    trainer.exports = outputs.ExportFolder(env, cfg.export_dir, trainer.run_id)
    problem = None
    # A job that trains with others may take their state and go on past its snapshot, keeping what it trained
    # since: its metrics file drops a failed attempt's records only from the first step it logs
    resumed_from = trainer.resumed_from if trainer.partners.alone else None
    try:
        trainer.tracker = tracking.make_tracker(
            env, cfg.wandb, cfg.wandb_project, trainer.run_id, cfg.to_dict(), cfg.metrics_file, resumed_from
        )
    except (OSError, RunError) as exc:
        problem = str(exc) if isinstance(exc, RunError) else f"{flag('metrics_file')} {cfg.metrics_file}: {exc}"
    problem, trainer.metrics_file = distributed.broadcast_object(
        env, (problem, "" if problem else trainer.tracker.metrics_file)
    )
    if problem:
        trainer.exports.close()
        raise RunError(problem)


def check_resumable(trainer: Trainer, resumed: dict, folder: str) -> None:
    written_with = "fsdp" if resumed["sharded_dir"] else "ddp"
    if written_with != trainer.cfg.strategy:
        raise RunError(
            f"the snapshot {folder} was written with {flag('strategy')} {written_with}: resume with that "
            f"strategy, or start from scratch with {flag('resume')} never (what the folder holds is moved aside)"
        )
    if resumed["world_size"] != trainer.env.world_size:
        if trainer.stream:
            raise RunError(
                f"the snapshot {folder} was written by {resumed['world_size']} rank(s) and this job has "
                f"{trainer.env.world_size}: each rank's place in a stream is its own, so a stream resumes with as "
                f"many ranks only (or start from scratch with {flag('resume')} never)"
            )
        trainer.warn_from_rank_0(
            "the snapshot was written by %d rank(s) and this job has %d: model, optimizer and data position (by "
            "samples seen) are restored and every rank's random streams are re-seeded, so this run will not "
            "match an uninterrupted one bit for bit",
            resumed["world_size"],
            trainer.env.world_size,
        )


def log_changed_settings(trainer: Trainer, resumed: dict, folder: str) -> None:
    changed = [
        f"{key} {value!r} -> {getattr(trainer.cfg, key)!r}"
        for key, value in resumed["config"].items()
        if hasattr(trainer.cfg, key) and value != getattr(trainer.cfg, key)
    ]
    if changed:
        log.info("settings changed since %s was written (applied from now on): %s", folder, ", ".join(changed))
    reshaped = [
        f"{flag(key)} {resumed['config'][key]!r} -> {getattr(trainer.cfg, key)!r}"
        for key in SCHEDULE_SETTINGS
        if key in resumed["config"] and resumed["config"][key] != getattr(trainer.cfg, key)
    ]
    if trainer.cfg.resume_from and reshaped:
        trainer.warn_from_rank_0(
            "this replay changes the learning-rate schedule (%s): its steps are not the run's; give the run's own "
            "values to replay them exactly",
            ", ".join(reshaped),
        )
    if trainer.user_scheduler is not None and trainer.user_scheduler.rescaled:
        log.info(
            "build_scheduler's base learning rates follow build_optimizer's now (%s): the restored learning "
            "rates are rescaled by the same ratio",
            ", ".join(f"{old:.3g} -> {new:.3g}" for old, new in trainer.user_scheduler.rescaled),
        )
    elif trainer.user_scheduler is not None and resumed["config"].get("lr") != trainer.cfg.lr:
        trainer.warn_from_rank_0(
            "%s changed, but the learning rates build_optimizer in model.py makes did not: your optimizer "
            "does not take cfg.lr, so the change does not reach your schedule",
            flag("lr"),
        )


def log_start(trainer: Trainer) -> None:
    cfg, steps = trainer.cfg, trainer.total_steps
    log.info(
        "%s run %s from step %d of %d: %d rank(s) x batch %d x accum %d = %d samples/step, %d parameters",
        "resuming" if trainer.resumed_from >= 0 else "training",
        trainer.run_id,
        trainer.progress.step,
        steps,
        trainer.env.world_size,
        cfg.batch_size,
        cfg.grad_accum,
        trainer.global_batch,
        sum(p.numel() for p in trainer.model.parameters()),
    )
    if (
        trainer.user.build_scheduler is None
        and cfg.warmup_steps >= trainer.length.samples // trainer.length.step_samples
    ):
        trainer.warn_from_rank_0(
            "%s %d is not shorter than the run (%d steps): the learning rate never reaches its peak",
            flag("warmup_steps"),
            cfg.warmup_steps,
            trainer.length.samples // trainer.length.step_samples,
        )
    if cfg.amp == "fp16" and trainer.env.device.type != "cuda":
        trainer.warn_from_rank_0("%s fp16 without CUDA runs without a gradient scaler; prefer bf16 on CPU", flag("amp"))
