"""A run's end: the final snapshot, the stop record of a stopped job, the exported weights and the summary."""

from __future__ import annotations

import logging
import os
from typing import Any, Protocol

from . import identity, logs
from .measure import PARTS
from .report import Summary, val_text, write_summary
from .snapshot import step_name, write_json_atomic
from .stop import STOP_RECORD, StopRequest

log = logging.getLogger(__name__)


class Ending(Protocol):
    """What a run's end reads and calls of the run (trainer.py)."""

    cfg: Any
    env: Any
    progress: Any
    length: Any
    parallel: Any
    snapshots: Any
    checkpointer: Any
    exports: Any
    measure: Any
    run_id: str
    metrics_file: str
    resumed_from: int

    def warn_from_rank_0(self, message: str, *args: Any) -> None: ...


def finish(trainer: Ending, stop: StopRequest) -> Summary:
    """Final snapshot, export and summary (also for a run that was already complete when it started)."""
    # The flag-only handlers stay until train() leaves its StopRequest: torchrun SIGTERMs this rank as soon as
    # another stopped rank has exited, and the default action would end it before its stop record is written
    # (then the restart trains on, and the job ends with code 0)
    stop.close(restore_handlers=False)
    stopped = stop.stopped
    if stopped and not stop.signal:  # the run asked to stop itself: a sweep's pruner (trialreport.py)
        log.info(
            "stopping at step %s of %s: the sweep pruned this trial; saving a snapshot",
            trainer.progress.step,
            trainer.length.total_steps,
        )
    elif stopped:
        trainer.warn_from_rank_0(
            "stopping at step %s of %s on signal %s: saving a snapshot; run the same command again to resume",
            trainer.progress.step,
            trainer.length.total_steps,
            stop.signal,
        )
    if trainer.checkpointer.last_saved != trainer.progress.step:
        trainer.checkpointer.save(blocking=True)
    trainer.snapshots.wait()
    trainer.snapshots.release_buffers()  # no save comes after the last: room for the export's gather
    if stop.signal and trainer.env.is_main:
        write_json_atomic(
            os.path.join(trainer.snapshots.directory, STOP_RECORD),
            {"job": identity.current_job(), "step": trainer.progress.step, "signal": stop.signal},
        )
        trainer.snapshots.keep_beside(STOP_RECORD)
    summary = run_summary(trainer, trainer.resumed_from >= trainer.length.total_steps, stop.signal if stopped else 0)
    summary.pruned = stop.asked
    if not stopped:
        trainer.exports.export(trainer.parallel, "model.pt")  # final weights only from a run that finished
    if trainer.env.is_main:
        write_summary(summary, trainer.exports.path)  # a stopped run's too, with its stop_signal
        if trainer.metrics_file:  # and beside the metrics file, with the records it sums up
            write_summary(summary, os.path.dirname(trainer.metrics_file))
        trainer.exports.publish()
    if summary.already_complete:
        log.info(
            "already complete: %s of %s steps, last loss %.4f%s; nothing to train (raise --max-steps or --epochs to "
            "train on, or pass --resume never to start over)",
            summary.steps,
            summary.total_steps,
            summary.last_loss,
            val_text(summary),
        )
    elif not stopped:
        resumed = f" (resumed at step {trainer.resumed_from})" if trainer.resumed_from >= 0 else ""
        log.info(
            "done: %s rank(s), %s steps%s, loss %.4f -> %.4f%s",
            summary.world_size,
            summary.steps,
            resumed,
            summary.first_loss,
            summary.last_loss,
            val_text(summary),
        )
    log_step_times(summary)
    log.info(
        "snapshots: %s (newest %s); exported weights: %s",
        summary.snapshot_dir,
        summary.newest_snapshot,
        summary.export_dir,
    )
    return summary


def log_step_times(summary: Summary) -> None:
    """Where each rank's step time went (every rank up to 8; beyond, the median rank and the slowest), and the
    straggler if there is one."""
    times = summary.step_times
    if not times or not any(each["steps"] for each in times):
        return
    busy = [sum(each[part] for part in PARTS if part != "wait") for each in times]
    shown = list(range(len(times)))
    if len(times) > 8:
        ordered = sorted(shown, key=busy.__getitem__)
        shown = sorted({ordered[(len(ordered) - 1) // 2], ordered[-1]})
    parts = lambda rank: " ".join(f"{part} {times[rank][part]:.2f}" for part in PARTS)  # noqa: E731
    rows = "; ".join(f"rank {rank} {parts(rank)}" for rank in shown)
    log.info("step time in seconds over %s steps: %s", times[0]["steps"], rows)
    found = summary.straggler
    if found is not None:
        log.info(
            "straggler: rank %s, %.0f%% slower than the median rank without waiting, most in %s",
            found["rank"],
            100 * (found["seconds"] / found["median_seconds"] - 1),
            found["part"],
        )


def run_summary(trainer: Ending, already_complete: bool, stop_signal: int) -> Summary:
    cfg, progress = trainer.cfg, trainer.progress
    step_times, straggler = trainer.measure.summary()  # every rank: one all-gather
    return Summary(
        run_id=trainer.run_id,
        world_size=trainer.env.world_size,
        steps=progress.step,
        total_steps=trainer.length.total_steps,
        resumed_from=trainer.resumed_from,
        samples_seen=progress.samples_seen,
        first_loss=progress.first_loss,
        last_loss=progress.last_loss,
        val_loss=progress.val_loss,
        best_val_loss=progress.best_val_loss,
        best_step=progress.best_step,
        snapshot_dir=trainer.snapshots.store.url if trainer.snapshots.store else trainer.snapshots.directory,
        newest_snapshot=step_name(progress.step),
        export_dir=trainer.exports.store.url if trainer.exports.store else trainer.exports.path,
        log_file=logs.rank_file(cfg.log_file, 0),
        metrics_file=trainer.metrics_file,
        already_complete=already_complete,
        stop_signal=stop_signal,
        snapshot_bytes=trainer.snapshots.size(progress.step),
        step_times=step_times,
        straggler=straggler,
    )
