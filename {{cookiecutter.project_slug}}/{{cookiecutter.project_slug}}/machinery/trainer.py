"""The training loop. `train()` reads top to bottom: train step -> log -> evaluate -> snapshot -> stop check.

`Trainer` puts the rooms together: the user's hooks (hooks.py), the data position (batches.py, stream.py), the
model across the ranks (parallel.py), one step (step.py), evaluation (evaluate.py), what a snapshot holds
(state.py) and where it goes (snapshot/), and what the run leaves (report.py) in files that belong to it
(runfiles.py: path checks at start-up, the export folder and metrics file claimed by the run id).

What a resume takes from the snapshot, and what from the command line (or --config) of the new launch:
- From the snapshot: every part of state.py (weights, optimizer state, scheduler, scaler, step, data position,
  every rank's random streams), the run id, and the run's length in samples (see `RunLength`).
- From the command line: everything else, applied from the first resumed step. The default learning-rate schedule
  is a function of the samples seen, so a new --lr, --warmup-steps, --max-steps or --epochs rescales it; the
  optimizer's hyperparameters come from build_optimizer with the new settings, group by group (a new
  --weight-decay applies, a no-decay group stays no-decay); --batch-size and --grad-accum change the step size
  while the data position stays exact in samples. The changed settings are logged once.
- A snapshot of another model (other layer names or shapes) stops the run with one line: use --resume never.
"""

from __future__ import annotations

import logging
import math
import os
import random
import time
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset

from . import distributed, identity, logs, nonfinite, runfiles, tracking, watchdog
from .batches import Batches, Progress, RunLength
from .debugflags import DebugFlags, replay_settings
from .distributed import DistEnv
from .evaluate import evaluate
from .hooks import UserCode
from .jobgroup import JobGroup
from .optim import (
    OptimizerPart,
    SampleSchedule,
    SchedulerPart,
    as_optimizer,
    default_optimizer,
    unoptimized_parameters,
)
from .parallel import Parallel
from .report import Summary, export, progress_bar, snapshot_size, val_text, write_config, write_summary
from .settings import RunError, flag
from .snapshot import SnapshotError, Snapshots, restore_rng, step_name, write_json_atomic
from .state import ModelPart, ProgressPart, RngPart, TrainState, checked_parts, estimated_bytes
from .step import Stepper
from .stop import STOP_RECORD, StopRequest
from .stream import StreamBatches

log = logging.getLogger(__name__)
PACKAGE = __name__.rsplit(".", 2)[0]  # the project's package, which holds model.py and data.py
# How long a failing rank waits for the snapshot in flight to be committed: well within torchrun's 30 s between
# its SIGTERM to the other workers and its SIGKILL.
SAVE_GRACE_S = 10.0


class ScalerPart:
    """The fp16 gradient scaler; nothing to save or load when it is off."""

    def __init__(self, scaler: torch.amp.GradScaler):
        self.scaler = scaler

    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler.is_enabled() and state:
            self.scaler.load_state_dict(state)


class Trainer:
    """Everything one run holds: model, data, optimizer, snapshots, trackers; resumed if a snapshot is there."""

    def __init__(self, cfg: Any, env: DistEnv, jobs: JobGroup | None = None):
        self.cfg, self.env = cfg, env
        self.jobs = jobs or JobGroup()  # the jobs this one trains the model with (jobgroup.py): none by default
        runfiles.check_paths(cfg, env)  # before anything slow: a path that cannot be written is refused at once
        self.user = UserCode(PACKAGE, env)
        for line in self.user.misspelled() + self.user.unused():
            self._warn_once("%s", line)
        torch.manual_seed(cfg.seed)  # the same initial weights on every rank
        self.train_data, self.val_data = self.user.build_datasets(cfg)
        self.stream = isinstance(self.train_data, IterableDataset)
        # Whose share of each step's data this rank trains on: its own among the job's ranks, or among the ranks
        # of every job it trains with.
        self.data_env = self.jobs.data_env(cfg, env, self.stream)
        self.global_batch = self.data_env.world_size * cfg.batch_size * cfg.grad_accum
        if not self.stream and len(self.train_data) < self.global_batch:
            raise RunError(
                f"the training data has {len(self.train_data)} samples, fewer than one optimizer step takes "
                f"({self.data_env.world_size} rank(s) x {flag('batch_size')} {cfg.batch_size} x "
                f"{flag('grad_accum')} {cfg.grad_accum} = {self.global_batch}): lower them"
            )
        self.model = self.user.build_model(cfg, self.train_data).to(env.device)
        self.parallel = Parallel(self.model, cfg, env, self.user)  # fsdp shards here, before the optimizer
        self.sharded = self.parallel.sharded

        timeout = distributed.collective_timeout(cfg).total_seconds()  # how long one rank may wait for the others
        self.snapshots = Snapshots(
            cfg.snapshot_dir, env, keep=cfg.keep_snapshots, commit_timeout=timeout, sharded=self.sharded
        )
        try:  # each decided on rank 0 or agreed by every rank: the same error everywhere
            self.snapshots.prepare(estimated_bytes(self.model), fresh_start=cfg.resume == "never")
        except SnapshotError as exc:  # prepare has let the folder go
            raise RunError(str(exc)) from None
        logs.follow_moved_files()  # a log file in a folder that a fresh start moved aside: this run's lines come along
        try:  # the folder's job lock is this run's now: a start-up that fails lets it go
            rng_state = self._build_and_restore()
            self._claim_outputs()
        except BaseException:
            self.snapshots.close()
            raise
        if env.is_main:
            write_config(cfg, self.snapshots.directory)
        self._warn_about_settings()

        self.parallel.wrap(resumed=self.resumed_from >= 0, with_other_jobs=not self.jobs.alone)
        self.last_saved = self.resumed_from if self.resumed_from >= 0 else None
        self.hang_watch = watchdog.HangWatch(env.rank, timeout * 0.8, cfg.log_file)  # stacks, before the timeout
        self.jobs.join(self)  # from here on, the jobs meet at every step
        self._timer = time.perf_counter()
        self._finite_at = -1  # the last step _check_finite found every loss and gradient so far finite
        # The random streams last, right before the first step, so nothing in between can draw from them.
        if rng_state is not None:
            restore_rng(rng_state)
        else:  # a fresh start, or a resume with another number of ranks: new streams, distinct per rank and step
            seed_everything(cfg.seed + self.data_env.rank + 1_000_003 * self.progress.step)

    def _build_and_restore(self) -> dict | None:
        """The run id, the optimizer, the schedule and the data, restored from the newest good snapshot if there is
        one; return this rank's random streams to restore last (None: re-seed them)."""
        cfg, env = self.cfg, self.env
        try:
            self.run_id = tracking.run_id(env, self.snapshots.directory)
            resumed = self.snapshots.resume()
        except SnapshotError as exc:
            raise RunError(str(exc)) from None
        stop_record = os.path.join(self.snapshots.directory, STOP_RECORD)
        if env.is_main and os.path.exists(stop_record):
            os.remove(stop_record)  # a new launch, not a restart of a stopped job: it is no longer stopped
        self.progress = Progress(step_samples=self.global_batch)
        if resumed is not None:  # first: the run's length and the scheduler's total steps depend on it
            self._check_resumable(resumed)
            ProgressPart(self.progress).load_state_dict(resumed["progress"])
        self.resumed_from = self.progress.step if resumed is not None else -1
        self.length = RunLength(cfg, self.progress.step_samples, None if self.stream else len(self.train_data))
        self.total_steps = self.length.steps(self.progress, self.global_batch)

        self.optimizer = as_optimizer((self.user.build_optimizer or default_optimizer)(cfg, self.model))
        left_out = unoptimized_parameters(self.model, self.optimizer)
        if left_out:
            more = f" and {len(left_out) - 5} more" if len(left_out) > 5 else ""
            self._warn_once(
                "build_optimizer in model.py leaves out %d parameter(s) that get gradients: %s%s. They are never "
                "trained: add them to a group, or set requires_grad=False on them",
                len(left_out),
                ", ".join(left_out[:5]),
                more,
            )
        self.user_scheduler: SchedulerPart | None = None
        if self.user.build_scheduler is not None:
            self.scheduler = self.user.build_scheduler(cfg, self.optimizer, self.total_steps)
            self.user_scheduler = SchedulerPart(self.scheduler)
        else:
            self.scheduler = SampleSchedule(self.optimizer, self.length, self.progress)
        self.scaler = torch.amp.GradScaler(env.device.type, enabled=cfg.amp == "fp16" and env.device.type == "cuda")
        if self.stream:
            self.batches: Batches | StreamBatches = StreamBatches(
                self.train_data, cfg, env, self.progress, self.user.collate
            )
        else:
            self.batches = Batches(self.train_data, cfg, self.data_env, self.progress, self.user.collate)

        # What a snapshot holds, in the order it is restored (state.py): add your own parts here.
        self.state = TrainState(env, self.sharded)
        self.state.add("model", ModelPart(self.model))
        self.state.add("optimizer", OptimizerPart(self.optimizer))
        self.state.add("scheduler", self.user_scheduler or self.scheduler)
        self.state.add("scaler", ScalerPart(self.scaler))
        self.state.add("progress", ProgressPart(self.progress))
        self.state.add("rng", RngPart(), per_rank=True)
        if isinstance(self.batches, StreamBatches):  # a stream's place is each rank's own
            self.state.add("data", self.batches, per_rank=True)
        if self.user.extra_state is not None:  # model.py's own parts (an EMA of the weights, ...)
            for name, part in checked_parts(self.user.extra_state(cfg, self.model, self.optimizer)).items():
                if self.state.has(name):
                    raise RunError(
                        f"extra_state in model.py returns a part named {name!r}, which the snapshot holds already: "
                        "rename it"
                    )
                self.state.add(name, part, extra=True)

        self.stepper = Stepper(
            self.parallel, self.optimizer, self.scheduler, self.scaler, self.user, cfg, env, self.progress, self.jobs
        )
        if resumed is None:
            return None
        folder = os.path.join(self.snapshots.directory, step_name(resumed["step"]))
        rng_state = self.state.restore(resumed, folder)
        self._log_changed_settings(resumed, folder)
        return rng_state

    def _claim_outputs(self) -> None:
        """The export folder and the metrics file, for this run (runfiles.py); a problem stops every rank alike."""
        cfg, env = self.cfg, self.env
        self.exports = runfiles.ExportFolder(env, cfg.export_dir, self.run_id)
        problem = None
        # A job that trains with others may take their state and go on past its snapshot, keeping what it trained
        # since: its metrics file drops a failed attempt's records only from the first step it logs
        resumed_from = self.resumed_from if self.jobs.alone else None
        try:
            self.tracker = tracking.make_tracker(
                env, cfg.wandb, cfg.wandb_project, self.run_id, cfg.to_dict(), cfg.metrics_file, resumed_from
            )
        except (OSError, RunError) as exc:
            problem = str(exc) if isinstance(exc, RunError) else f"{flag('metrics_file')} {cfg.metrics_file}: {exc}"
        problem, self.metrics_file = distributed.broadcast_object(
            env, (problem, "" if problem else self.tracker.metrics_file)
        )
        if problem:
            self.exports.close()
            raise RunError(problem)

    def _check_resumable(self, resumed: dict) -> None:
        folder = os.path.join(self.snapshots.directory, step_name(resumed["step"]))
        written_with = "fsdp" if resumed["sharded_dir"] else "ddp"
        if written_with != self.cfg.strategy:
            raise RunError(
                f"the snapshot {folder} was written with {flag('strategy')} {written_with}: resume with that "
                f"strategy, or start from scratch with {flag('resume')} never (what the folder holds is moved aside)"
            )
        if resumed["world_size"] != self.env.world_size:
            if self.stream:
                raise RunError(
                    f"the snapshot {folder} was written by {resumed['world_size']} rank(s) and this job has "
                    f"{self.env.world_size}: each rank's place in a stream is its own, so a stream resumes with as "
                    f"many ranks only (or start from scratch with {flag('resume')} never)"
                )
            self._warn_once(
                "the snapshot was written by %d rank(s) and this job has %d: model, optimizer and data position (by "
                "samples seen) are restored and every rank's random streams are re-seeded, so this run will not "
                "match an uninterrupted one bit for bit",
                resumed["world_size"],
                self.env.world_size,
            )

    # -- one optimizer step ------------------------------------------------------------------------------------

    def start_step(self, stop: StopRequest) -> bool:
        """The start of a step among the jobs this one trains with (a no-op for a job alone). False: the job was
        asked to stop while it waited for the others; every rank of the job knows it then (`stop.stopped`)."""
        if self.jobs.start_step(lambda: bool(stop.signal)):
            return True
        stop.agree_now()
        return False

    def forward_backward(self, micro_batches: list) -> None:
        """Forward and backward over the micro-batches of one optimizer step (step.py)."""
        self.stepper.forward_backward(micro_batches)

    def optimizer_step(self) -> bool:
        """Clip, step, move the schedule and the step count on (step.py); False: the jobs this one trains with
        dropped the step (one failed during it)."""
        stepped = self.stepper.optimizer_step()
        self.hang_watch.beat()
        if not stepped and isinstance(self.batches, Batches):
            self.batches.repeat_last_step()  # the dropped step's data, once more
        return stepped

    def due(self, every: int) -> bool:
        """True at every `every`-th step and at the last one (`every` = 0: only at the last one)."""
        step = self.progress.step
        return step >= self.total_steps or (every > 0 and step % every == 0)

    # -- logging, evaluation, snapshots ------------------------------------------------------------------------

    def log_metrics(self) -> None:
        """Mean loss since the last log over every rank, learning rate, speed; stops a run whose loss diverged."""
        progress, elapsed = self.progress, time.perf_counter() - self._timer
        self._check_finite()
        loss = self._synced_loss()
        progress.last_loss = loss
        if math.isnan(progress.first_loss):
            progress.first_loss = loss
        metrics = {
            "loss": loss,
            "lr": self.stepper.lr,
            "epoch": progress.epoch,
            "samples_per_s": self.stepper.loss_steps * self.global_batch / elapsed,
        }
        if self.cfg.clip_grad:
            metrics["grad_norm"] = float(self.stepper.grad_norm)
        log.info(
            "step %d/%d  epoch %d  loss %.4f  lr %.2e  %.0f samples/s%s",
            progress.step,
            self.total_steps,
            progress.epoch,
            loss,
            metrics["lr"],
            metrics["samples_per_s"],
            f"  grad norm {metrics['grad_norm']:.3g}" if "grad_norm" in metrics else "",
        )
        self.tracker.log(metrics, progress.step)
        self.stepper.reset_loss()
        self._timer = time.perf_counter()

    def evaluate(self) -> dict[str, float]:
        """val_loss and val_<name> over every validation sample, each counted once across the ranks (evaluate.py)."""
        started = time.perf_counter()
        results, count = evaluate(self.val_data, self.parallel, self.user, self.cfg, self.env, self.hang_watch.beat)
        if results:
            self._record_evaluation(results, count, time.perf_counter() - started)
        return results

    def save_snapshot(self, blocking: bool = False) -> None:
        """Start writing a snapshot of this step in the background (snapshot/); refuse a diverged state."""
        self._check_finite()  # no snapshot of what a step with a NaN or infinite loss or gradient made
        if not distributed.all_true(self.env, self.state.finite()):
            raise RunError(
                f"the weights or the optimizer state are not finite at step {self.progress.step} (their gradients "
                f"were): no snapshot is saved from them (newest: step {self.last_saved}). Lower {flag('lr')} or "
                f"check the optimizer's settings; then run the same command again to resume from that snapshot"
            )
        shared, rank_state, sharded_state = self.state.capture()
        shared.update(
            step=self.progress.step,
            config=self.cfg.to_dict(),
            run_id=self.run_id,
            torch_version=str(torch.__version__),
        )
        self.snapshots.save(self.progress.step, shared, rank_state, blocking=blocking, sharded_state=sharded_state)
        self.last_saved = self.progress.step

    def export(self, name: str) -> None:
        export(self.model, self.sharded, self.env, self.exports.directory, name)

    def finish(self, stop: StopRequest) -> Summary:
        """Final snapshot, export and summary (also for a run that was already complete when it started)."""
        # The flag-only handlers stay until train() leaves its StopRequest: torchrun SIGTERMs this rank as soon as
        # another stopped rank has exited, and the default action would end it before its stop record is written
        # (then the restart trains on, and the job ends with code 0)
        stop.close(restore_handlers=False)
        stopped = stop.stopped
        if stopped:
            self._warn_once(
                "stopping at step %d of %d on signal %d: saving a snapshot; run the same command again to resume",
                self.progress.step,
                self.total_steps,
                stop.signal,
            )
        if self.last_saved != self.progress.step:
            self.save_snapshot(blocking=True)
        self.snapshots.wait()
        if stopped and self.env.is_main:
            write_json_atomic(
                os.path.join(self.snapshots.directory, STOP_RECORD),
                {"job": identity.current_job(), "step": self.progress.step, "signal": stop.signal},
            )
        summary = self._summary(
            already_complete=self.resumed_from >= self.total_steps, stop_signal=stop.signal if stopped else 0
        )
        if not stopped:
            self.export("model.pt")  # final weights only from a run that finished
        if self.env.is_main:
            write_summary(summary, self.exports.directory)  # a stopped run's too, with its stop_signal
        if summary.already_complete:
            log.info(
                "already complete: %d of %d steps, last loss %.4f%s; nothing to train (raise --max-steps or "
                "--epochs to train on, or pass --resume never to start over)",
                summary.steps,
                summary.total_steps,
                summary.last_loss,
                val_text(summary),
            )
        elif not stopped:
            log.info(
                "done: %d rank(s), %d steps%s, loss %.4f -> %.4f%s",
                summary.world_size,
                summary.steps,
                f" (resumed at step {self.resumed_from})" if self.resumed_from >= 0 else "",
                summary.first_loss,
                summary.last_loss,
                val_text(summary),
            )
        log.info(
            "snapshots: %s (newest %s); exported weights: %s",
            summary.snapshot_dir,
            summary.newest_snapshot,
            self.exports.directory,
        )
        return summary

    def close(self, error: BaseException | None = None) -> None:
        """`error`: the exception that ends the run early, if one does."""
        self.jobs.close(error)
        self.hang_watch.close()
        self.tracker.finish()
        self.exports.close()
        self.snapshots.close()

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, kind, error, traceback) -> None:
        try:
            if kind is None or issubclass(kind, RunError):
                self.snapshots.wait()  # a save in flight holds a good state: let it commit
            else:  # a rank's own error, or a lost peer: a part that may never come is waited for a while only
                self.snapshots.settle(SAVE_GRACE_S)
        finally:
            self.close(error)

    # -- helpers -----------------------------------------------------------------------------------------------

    def _log_changed_settings(self, resumed: dict, folder: str) -> None:
        changed = [
            f"{key} {value!r} -> {getattr(self.cfg, key)!r}"
            for key, value in resumed["config"].items()
            if hasattr(self.cfg, key) and value != getattr(self.cfg, key)
        ]
        if changed:
            log.info("settings changed since %s was written (applied from now on): %s", folder, ", ".join(changed))
        if self.user_scheduler is not None and self.user_scheduler.rescaled:
            log.info(
                "build_scheduler's base learning rates follow build_optimizer's now (%s): the restored learning "
                "rates are rescaled by the same ratio",
                ", ".join(f"{old:.3g} -> {new:.3g}" for old, new in self.user_scheduler.rescaled),
            )
        elif self.user_scheduler is not None and resumed["config"].get("lr") != self.cfg.lr:
            self._warn_once(
                "%s changed, but the learning rates build_optimizer in model.py makes did not: your optimizer "
                "does not take cfg.lr, so the change does not reach your schedule",
                flag("lr"),
            )

    def _warn_about_settings(self) -> None:
        cfg, steps = self.cfg, self.total_steps
        log.info(
            "%s run %s from step %d of %d: %d rank(s) x batch %d x accum %d = %d samples/step, %d parameters",
            "resuming" if self.resumed_from >= 0 else "training",
            self.run_id,
            self.progress.step,
            steps,
            self.env.world_size,
            cfg.batch_size,
            cfg.grad_accum,
            self.global_batch,
            sum(p.numel() for p in self.model.parameters()),
        )
        if self.user.build_scheduler is None and cfg.warmup_steps >= self.length.samples // self.length.step_samples:
            self._warn_once(
                "%s %d is not shorter than the run (%d steps): the learning rate never reaches its peak",
                flag("warmup_steps"),
                cfg.warmup_steps,
                self.length.samples // self.length.step_samples,
            )
        if cfg.amp == "fp16" and self.env.device.type != "cuda":
            self._warn_once("%s fp16 without CUDA runs without a gradient scaler; prefer bf16 on CPU", flag("amp"))

    def _warn_once(self, message: str, *args) -> None:
        """A warning that every rank reaches alike (settings, an agreed stop): rank 0 says it, the others at DEBUG."""
        log.log(logging.WARNING if self.env.is_main else logging.DEBUG, message, *args)

    def _record_evaluation(self, results: dict[str, float], count: int, seconds: float) -> None:
        progress = self.progress
        progress.val_loss = results["val_loss"]
        log.info(
            "eval at step %d: %s (%d samples, %.1f s)",
            progress.step,
            "  ".join(f"{k} {v:.4f}" for k, v in results.items()),
            count,
            seconds,
        )
        self.tracker.log(results, progress.step)
        self._timer += seconds  # samples/s counts training time only
        if progress.val_loss < progress.best_val_loss:
            progress.best_val_loss, progress.best_step = progress.val_loss, progress.step
            self.export("best.pt")

    def _check_finite(self) -> None:
        """Stop the run (every rank at once) when a step so far had a NaN or infinite loss or gradient: the
        weights it made are not saved, and the newest snapshot is from before it. Once a step (a step that both
        logs and saves asks twice; every rank alike)."""
        if self._finite_at == self.progress.step:
            return
        found = self.stepper.first_nonfinite()
        if found is None:
            self._finite_at = self.progress.step
            return
        step, ranks = found
        if ranks:
            what = f"the loss is not finite at step {step} on {', '.join(f'rank {rank}' for rank in ranks)}"
        else:
            what = (
                f"the gradient is not finite at step {step} on every rank (averaged over the ranks; the loss was "
                f"finite on every rank: a NaN or infinity arose in backward)"
            )
        where = ""
        replayed = nonfinite.replay(self, step) if self.jobs.alone else None
        if replayed is not None:
            snapshot_step, origins = replayed
            command = nonfinite.replay_command(self.env, snapshot_step, step)
            where = f"; replayed from step {snapshot_step}, {nonfinite.describe(origins)}; to step into it: {command}"
        raise RunError(
            f"{what}{where}. The run stops, and no snapshot is saved from that step on (newest: step "
            f"{self.last_saved}). Lower {flag('lr')}, set {flag('clip_grad')}, or check the data and the model; then "
            "run the same command again to resume from that snapshot"
        )

    def _synced_loss(self) -> float:
        """The mean training loss since the last log, over every rank; a NaN or infinite one stops the run."""
        try:
            return self.stepper.mean_loss()
        except FloatingPointError:
            raise RunError(
                f"the training loss is not finite at step {self.progress.step}: the run diverged, so no snapshot is "
                f"saved over the good ones (newest: step {self.last_saved}). Lower {flag('lr')}, set "
                f"{flag('clip_grad')}, or check the data; then run the same command again to resume from that snapshot"
            ) from None

    def _summary(self, already_complete: bool, stop_signal: int) -> Summary:
        cfg, progress = self.cfg, self.progress
        return Summary(
            run_id=self.run_id,
            world_size=self.env.world_size,
            steps=progress.step,
            total_steps=self.total_steps,
            resumed_from=self.resumed_from,
            samples_seen=progress.samples_seen,
            first_loss=progress.first_loss,
            last_loss=progress.last_loss,
            val_loss=progress.val_loss,
            best_val_loss=progress.best_val_loss,
            best_step=progress.best_step,
            snapshot_dir=self.snapshots.directory,
            newest_snapshot=step_name(progress.step),
            export_dir=self.exports.directory,
            log_file=os.path.abspath(cfg.log_file.replace("{rank}", "0")) if cfg.log_file else "",
            metrics_file=self.metrics_file,
            already_complete=already_complete,
            stop_signal=stop_signal,
            snapshot_bytes=snapshot_size(os.path.join(self.snapshots.directory, step_name(progress.step))),
        )


def train(cfg: Any, env: DistEnv, jobs: JobGroup | None = None) -> Summary:
    """Train until --max-steps or --epochs; resume from the newest good snapshot in --snapshot-dir if there is one.
    `jobs`: the jobs this one trains the model with (jobgroup.py), if any."""
    cfg = replay_settings(cfg, env)  # --resume-from: a scratch copy of that snapshot is the run's snapshot folder
    with (
        Trainer(cfg, env, jobs) as trainer,  # model, data, optimizer, snapshots: restored from the newest good snapshot
        StopRequest(env) as stop,
        progress_bar(env, trainer.total_steps, trainer.progress.step) as bar,
        DebugFlags(cfg, env, trainer.model, trainer.progress) as flags,  # --break-at-step, --profile-steps, ...
    ):
        progress, snapshots = trainer.progress, trainer.snapshots
        while progress.step < trainer.total_steps and not stop.stopped:
            if not trainer.start_step(stop):  # the jobs this one trains with, if any, start the step together
                break
            trainer.forward_backward(flags.before_forward(next(trainer.batches)))
            # Between backward and the optimizer step, always: the save in flight must have copied the weights
            # before the optimizer changes them in place (a test fails when it moves).
            snapshots.wait_until_copied()
            if not trainer.optimizer_step():
                continue  # a job failed during this step: it is dropped, and taken again with the same data
            flags.after_step()  # before the snapshot: --check-replicas stops a run whose replicas drifted apart
            bar.update()

            if trainer.due(cfg.log_every):
                trainer.log_metrics()
            if trainer.due(cfg.eval_every):
                trainer.evaluate()
            if trainer.due(cfg.snapshot_every):
                trainer.save_snapshot()
            stop.agreed()  # every rank learns of a SIGTERM or Ctrl-C at the same step
        return trainer.finish(stop)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
