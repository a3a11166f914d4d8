"""A run's start: its parts built from the user's hooks and settings, restored from the newest good snapshot.

A resume takes every part of state.py, the run id and the run's length in samples (`RunLength`) from the snapshot;
everything else comes from the new launch's settings, applied from the first resumed step and logged once: a new
--lr or --warmup-steps rescales the default schedule, a changed hyperparameter applies (optim.OptimizerPart), and
--batch-size or --grad-accum change the step size while the data position stays exact in samples.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch.utils.data import IterableDataset

from . import distributed, logs, outputs, pretrained, tracking
from .batches import Batches, Progress, RunLength
from .distributed import DistEnv
from .hooks import UserCode
from .optim import OptimizerPart, SampleSchedule, SchedulerPart, as_optimizer, default_optimizer, optimizer_warnings
from .parallel import DistributedModel
from .partners import Partners
from .runsettings import START_AFRESH
from .settings import RunError, flag
from .snapshot import RUN_FILE, SnapshotError, Snapshots
from .state import ModelPart, ProgressPart, RngPart, ScalerPart, TrainState, checked_parts
from .step import Stepper
from .stop import STOP_RECORD
from .stream import StreamBatches

log = logging.getLogger(__name__)
SCHEDULE_SETTINGS = ("max_steps", "epochs", "warmup_steps", "lr")  # what the default learning-rate schedule follows


class Building(Protocol):
    """What start-up reads of the run it builds (trainer.py)."""

    cfg: Any
    env: DistEnv
    user: UserCode
    parallel: DistributedModel
    snapshots: Snapshots
    partners: Partners
    train_data: Any
    data_env: DistEnv  # this rank's place among the ranks that share each step's data (partners.py)
    global_batch: int
    starting_weights: Any  # pretrained.source


@dataclass
class Start:
    """What start-up builds for the run, restored from the newest good snapshot if there is one."""

    run_id: str
    progress: Progress
    resumed_from: int  # the step the run resumed at; -1 for a fresh start
    length: RunLength
    batches: Batches | StreamBatches
    state: TrainState  # what a snapshot holds
    stepper: Stepper
    rng_state: dict | None  # this rank's random streams, to restore last; None: re-seed them
    starting_weights: str | None = None  # where the run's first weights came from (pretrained_weights), if anywhere


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


def build_and_restore(run: Building) -> Start:
    """The run id, the optimizer, the schedule and the data, restored from the newest good snapshot if any."""
    cfg, env, user, parallel, snapshots = run.cfg, run.env, run.user, run.parallel, run.snapshots
    train_data, global_batch = run.train_data, run.global_batch
    try:
        run_id = tracking.run_id(env, snapshots.directory)
        # on a store at once, not with the first snapshot: a restart before that one is committed, whichever
        # machine its rank 0 is on, continues this run id (and its metrics file, its wandb run)
        distributed.decided_on_rank_0(env, lambda: snapshots.keep_beside(RUN_FILE), SnapshotError)
        resumed = snapshots.resume()
    except SnapshotError as exc:
        raise RunError(str(exc)) from None
    stop_record = os.path.join(snapshots.directory, STOP_RECORD)
    if env.is_main and os.path.exists(stop_record):
        os.remove(stop_record)  # a new launch, not a restart of a stopped job: it is no longer stopped
    stream, model = isinstance(train_data, IterableDataset), parallel.model
    progress = Progress(step_samples=global_batch)
    folder = ""
    if resumed is not None:  # first: the run's length and the scheduler's total steps depend on it
        folder = snapshots.step_folder(resumed["step"])
        check_resumable(cfg, env, stream, resumed, folder)
        ProgressPart(progress).load_state_dict(resumed["progress"])
    resumed_from = progress.step if resumed is not None else -1
    if resumed is None and run.starting_weights is not None:  # a resume has them, trained on, in its snapshot
        pretrained.load(model, run.starting_weights, env)
    length = RunLength(cfg, progress.step_samples, None if stream else len(train_data))
    length.total_steps = length.steps(progress, global_batch)

    optimizer = as_optimizer((user.build_optimizer or default_optimizer)(cfg, model))
    for line in optimizer_warnings(model, optimizer):
        warn(env, line)
    user_scheduler = None
    if user.build_scheduler is not None:
        scheduler = user.build_scheduler(cfg, optimizer, length.total_steps)
        user_scheduler = SchedulerPart(scheduler)
    else:
        scheduler = SampleSchedule(optimizer, length, progress)
    scaler = torch.amp.GradScaler(env.device.type, enabled=cfg.amp == "fp16" and env.device.type == "cuda")
    if stream:
        batches: Batches | StreamBatches = StreamBatches(train_data, cfg, env, progress, user.collate)
    else:
        batches = Batches(train_data, cfg, run.data_env, progress, user.collate)

    # What a snapshot holds, in the order it is restored (state.py): add your own parts here.
    state = TrainState(env, parallel.sharded)
    state.add("model", ModelPart(model))
    state.add("optimizer", OptimizerPart(optimizer))
    state.add("scheduler", user_scheduler or scheduler)
    state.add("scaler", ScalerPart(scaler))
    state.add("progress", ProgressPart(progress))
    state.add("rng", RngPart(), per_rank=True)
    if isinstance(batches, StreamBatches):  # a stream's place is each rank's own
        state.add("data", batches, per_rank=True)
    if user.extra_state is not None:  # model.py's own parts (an EMA of the weights, ...)
        for name, part in checked_parts(user.extra_state(cfg, model, optimizer)).items():
            state.add(name, part, extra=True)

    stepper = Stepper(parallel, optimizer, scheduler, scaler, user, cfg, env, progress, run.partners)
    start = Start(run_id, progress, resumed_from, length, batches, state, stepper, None, run.starting_weights)
    if resumed is not None:
        start.rng_state = state.restore(resumed, folder)
        log_changed_settings(cfg, env, user_scheduler, resumed, folder)
        start.starting_weights = resumed.get("starting_weights", run.starting_weights)
        if start.starting_weights != run.starting_weights:
            warn(
                env,
                "pretrained_weights in model.py says %s, and this run started from %s: it resumes from its snapshot "
                "%s, which wins. To start from the new weights, %s",
                run.starting_weights,
                "build_model's own weights" if start.starting_weights is None else start.starting_weights,
                folder,
                START_AFRESH,
            )
    log_start(cfg, env, start, global_batch, user)
    return start


def claim_outputs(
    cfg: Any, env: DistEnv, run_id: str, resumed_from: int | None
) -> tuple[outputs.ExportFolder, tracking.Tracker, str]:
    """The export folder, the tracker and the metrics file it writes, for this run (outputs.py); a problem stops
    every rank alike. `resumed_from` None: the metrics file drops a failed attempt's records only from the first
    step it logs (a job that trains with others may take their state and go on past its snapshot)."""
    exports = outputs.ExportFolder(env, cfg.export_dir, run_id)
    problem, tracker = None, tracking.Tracker()
    try:
        tracker = tracking.make_tracker(
            env, cfg.wandb, cfg.wandb_project, run_id, cfg.to_dict(), cfg.metrics_file, resumed_from
        )
    except (OSError, RunError) as exc:
        problem = str(exc) if isinstance(exc, RunError) else f"{flag('metrics_file')} {cfg.metrics_file}: {exc}"
    problem, metrics_file = distributed.broadcast_object(env, (problem, "" if problem else tracker.metrics_file))
    if problem:
        exports.close()
        raise RunError(problem)
    return exports, tracker, metrics_file


def check_resumable(cfg: Any, env: DistEnv, stream: bool, resumed: dict, folder: str) -> None:
    written_with = "fsdp" if resumed["sharded_dir"] else "ddp"
    if written_with != cfg.strategy:
        raise RunError(
            f"the snapshot {folder} was written with {flag('strategy')} {written_with}: resume with that "
            f"strategy, or {START_AFRESH}"
        )
    if resumed["world_size"] != env.world_size:
        if stream:
            raise RunError(
                f"the snapshot {folder} was written by {resumed['world_size']} rank(s) and this job has "
                f"{env.world_size}: each rank's place in a stream is its own, so a stream resumes with as "
                f"many ranks only; or {START_AFRESH}"
            )
        warn(
            env,
            "the snapshot was written by %s rank(s) and this job has %s: model, optimizer and data position (by "
            "samples seen) are restored and every rank's random streams are re-seeded, so this run will not match an "
            "uninterrupted one bit for bit",
            resumed["world_size"],
            env.world_size,
        )


def log_changed_settings(
    cfg: Any, env: DistEnv, user_scheduler: SchedulerPart | None, resumed: dict, folder: str
) -> None:
    changed = [
        f"{key} {value!r} -> {getattr(cfg, key)!r}"
        for key, value in resumed["config"].items()
        if hasattr(cfg, key) and value != getattr(cfg, key)
    ]
    if changed:
        log.info("settings changed since %s was written (applied from now on): %s", folder, ", ".join(changed))
    reshaped = [
        f"{flag(key)} {resumed['config'][key]!r} -> {getattr(cfg, key)!r}"
        for key in SCHEDULE_SETTINGS
        if key in resumed["config"] and resumed["config"][key] != getattr(cfg, key)
    ]
    if cfg.resume_from and reshaped:
        warn(
            env,
            "this replay changes the learning-rate schedule (%s): its steps are not the run's; give the run's own "
            "values to replay them exactly",
            ", ".join(reshaped),
        )
    if user_scheduler is not None and user_scheduler.rescaled:
        ratios = ", ".join(f"{old:.3g} -> {new:.3g}" for old, new in user_scheduler.rescaled)
        log.info(
            "build_scheduler's base learning rates follow build_optimizer's now (%s): the restored learning rates are "
            "rescaled by the same ratio",
            ratios,
        )
    elif user_scheduler is not None and resumed["config"].get("lr") != cfg.lr:
        warn(
            env,
            "%s changed, but the learning rates build_optimizer in model.py makes did not: your optimizer does not "
            "take cfg.lr, so the change does not reach your schedule",
            flag("lr"),
        )


def log_start(cfg: Any, env: DistEnv, start: Start, global_batch: int, user: UserCode) -> None:
    length, steps = start.length, start.length.samples // start.length.step_samples
    parameters = sum(p.numel() for p in start.stepper.parallel.model.parameters())
    log.info(
        "%s run %s from step %s of %s: %s rank(s) x batch %s x accum %s = %s samples/step, %s parameters",
        "resuming" if start.resumed_from >= 0 else "training",
        start.run_id,
        start.progress.step,
        length.total_steps,
        env.world_size,
        cfg.batch_size,
        cfg.grad_accum,
        global_batch,
        parameters,
    )
    if user.build_scheduler is None and cfg.warmup_steps >= steps:
        warn(
            env,
            "%s %s is not shorter than the run (%s steps): the learning rate never reaches its peak",
            flag("warmup_steps"),
            cfg.warmup_steps,
            steps,
        )
    if cfg.amp == "fp16" and env.device.type != "cuda":
        warn(env, "%s fp16 without CUDA runs without a gradient scaler; prefer bf16 on CPU", flag("amp"))


def warn(env: DistEnv, message: str, *args: Any) -> None:
    logs.warn_from_rank_0(log, env.is_main, message, *args)
