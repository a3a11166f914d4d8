"""Experiment tracking: wandb and a local metrics file on rank 0, a tracker that does nothing everywhere else, so the
training loop calls `tracker.log(...)` on every rank. The run id lives in the snapshot folder (run.json): restarts
and re-launches that resume from it continue the same wandb run. wandb is imported only when it is used.
"""

import json
import logging
import math
import os
import secrets
import time
from pathlib import Path
from typing import Any, Literal, cast

from . import distributed, outputs
from .batches import Progress, RunLength
from .distributed import DistEnv
from .measure import Measure
from .nonfinite import NonfiniteGuard
from .outputs import RUN_ID
from .plot import records_in
from .settings import RunError, first_line, flag, short_repr
from .snapshot import RUN_FILE, SnapshotError, write_json_atomic
from .step import Stepper

WandbMode = Literal["online", "offline", "disabled"]  # the choices of --wandb

log = logging.getLogger(__name__)


def run_id(env: DistEnv, snapshot_dir: str) -> str:
    """This run's id, created on the first start (`--resume never` sets run.json aside: a new run). Rank 0 reads or
    creates the file (with the folder's job lock held: call it after Snapshots.prepare); every rank gets the id, or
    the same error."""
    path = os.path.join(snapshot_dir, RUN_FILE)
    return distributed.decided_on_rank_0(env, lambda: _read_or_create_run_id(path), SnapshotError)


def _read_or_create_run_id(path: str) -> str:
    remedy = "delete it to start a new run id (a new wandb run)"
    if os.path.isdir(path):
        raise SnapshotError(f"{path} is a folder, not the run file: {remedy}")
    try:
        with open(path, encoding="utf-8") as handle:
            content = json.load(handle)
    except FileNotFoundError:
        # A run that `wandb agent` started (scripts/wandb-sweep.yaml) keeps the run id the agent gave it
        given = os.environ.get("WANDB_RUN_ID", "") if os.environ.get("WANDB_SWEEP_ID") else ""
        created = given if RUN_ID.match(given) else secrets.token_hex(4)
        write_json_atomic(path, {"run_id": created})
        return created
    except (OSError, ValueError, RecursionError) as exc:
        raise SnapshotError(f"{path} is damaged ({first_line(exc)}): {remedy}") from exc
    if not isinstance(content, dict):
        raise SnapshotError(f"{path} holds a JSON {type(content).__name__}, not an object with a run_id: {remedy}")
    found = content.get("run_id")
    if not isinstance(found, str) or not RUN_ID.match(found):
        raise SnapshotError(
            f"{path} has run_id {short_repr(found)}, not a string of 1 to 128 letters, digits, '_', '-' or '.': "
            f"{remedy}"
        )
    return found


class Tracker:
    """Does nothing: what every rank but 0 gets, and rank 0 too when tracking is disabled."""

    metrics_file = ""  # the metrics file it writes (absolute), if any

    def log(self, metrics: dict, step: int) -> None:
        pass

    def finish(self) -> None:
        pass


class WandbTracker(Tracker):
    def __init__(self, project: str, run_id: str, mode: str, config: dict):
        option = f"{flag('wandb')} {mode}"
        try:
            import wandb
        except ImportError:
            raise RunError(f"{option} needs wandb: pip install wandb, or pass {flag('wandb')} disabled") from None
        try:
            self.run = wandb.init(project=project, id=run_id, resume="allow", mode=cast(WandbMode, mode), config=config)
        except wandb.errors.Error as exc:  # no API key, a key refused, no network: wandb's reason, on one line
            reason = " ".join(str(exc).split()) or type(exc).__name__
            raise RunError(
                f"{option}: wandb could not start the run: {reason} (to track without a wandb account or "
                f"network: {flag('wandb')} offline)"
            ) from None
        # Resumed runs log steps the failed attempt may have logged already; a metric of our own as the x axis
        # keeps wandb from dropping them as out of order.
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")
        log.info("wandb run %s (%s mode, project %s)", run_id, mode, project)

    def log(self, metrics: dict, step: int) -> None:
        self.run.log({"step": step, **metrics})

    def finish(self) -> None:
        self.run.finish()


class MetricsFile(Tracker, outputs.Claim):
    """JSON Lines on rank 0 (`--metrics-file`): one record per logged step, with this run's id, each line flushed as
    it is written. The file holds one run's records (outputs.Claim): another run's move aside to
    `metrics.<its run id>.jsonl`. The records of steps after `resumed_from` are dropped first, so steps trained again
    replace the failed attempt's (-1: a new run; None: a job that took its partners' state drops those from the
    first step it logs). Metrics logged for the step of the last line (validation after training) merge into it."""

    what = "metrics records"

    def __init__(self, path: str, run_id: str, resumed_from: int | None):
        fd = self.claim(path, run_id)
        self.metrics_file = self.path
        content = outputs.read_held(fd)
        records, skipped = records_in(content)
        if skipped:
            log.warning(
                "%s: skipped %d line(s) that are not metrics records (not UTF-8 JSON objects with a step); they are "
                "left out of the file",
                self.metrics_file,
                skipped,
            )
        self._file: Any = None  # opened once the records to keep are known
        self._held: Any = (fd, content, records)
        self._last: dict = {}
        self._last_offset = 0
        if resumed_from is not None:
            self._keep(resumed_from)

    def _keep(self, last: int) -> None:
        """Keep the records of steps up to `last` only, and open the file to append."""
        fd, content, records = self._held
        self._held = None
        kept = b"".join(line for record, line in records if record["step"] <= last)
        if kept != content:
            fd = outputs.replace_held(fd, self.metrics_file, kept)
        self._file = os.fdopen(fd, "ab")
        self._file.seek(0, os.SEEK_END)
        self._last_offset = self._file.tell()

    def log(self, metrics: dict, step: int) -> None:
        if self._file is None:  # the first step logged: the records of this step and later ones are a failed attempt's
            self._keep(step - 1)
        record = {k: _plain(v) for k, v in metrics.items()}
        if self._last.get("step") == step:
            record = {**self._last, **record}
            self._file.truncate(self._last_offset)
        else:
            self._last_offset = self._file.tell()
        self._last = {"step": step, "run_id": self.run_id, **record}
        self._file.write((json.dumps(self._last) + "\n").encode())
        self._file.flush()

    def finish(self) -> None:
        if self._file is None:  # nothing logged: the file stays as it was
            os.close(self._held[0])
        else:
            self._file.close()

    def owner(self, fd: int | None) -> str | None:
        """The run of the last record of another run than this one; this run if every record is its own."""
        if fd is not None:
            content = outputs.read_held(fd)
        elif os.path.isfile(self.path):
            content = Path(self.path).read_bytes()
        else:
            content = b""
        found = [record.get("run_id") for record, _ in records_in(content)[0]]
        foreign = [run for run in found if run != self.run_id] or found[-1:]
        if not foreign:
            return None
        run = foreign[-1]
        return run if isinstance(run, str) and RUN_ID.match(run) else None

    def set_aside(self, fd: int, aside: str, owner: str | None) -> bool:
        content = outputs.read_held(fd)
        if not records_in(content)[0]:
            return False
        outputs.write_synced(aside, content)
        os.ftruncate(fd, 0)  # held by this process: nobody appends to it
        return True

    def take_back(self, fd: int, own: str) -> int:
        fd = outputs.replace_held(fd, self.path, Path(own).read_bytes())
        os.remove(own)
        return fd


class Trackers(Tracker):
    """Several trackers as one."""

    def __init__(self, trackers: list[Tracker]):
        self.trackers = trackers
        self.metrics_file = next((t.metrics_file for t in trackers if t.metrics_file), "")

    def log(self, metrics: dict, step: int) -> None:
        for tracker in self.trackers:
            tracker.log(metrics, step)

    def finish(self) -> None:
        for tracker in self.trackers:
            tracker.finish()


class MetricsLog:
    """The training metrics, logged at every --log-every step and the last: the mean loss since the last log over
    every rank, the learning rate, the speed (samples/s of training time only, and tokens/s, peak memory and mfu from
    measure.py); a run whose loss diverged stops."""

    def __init__(
        self,
        cfg: Any,
        tracker: Tracker,
        stepper: Stepper,
        nonfinite: NonfiniteGuard,
        progress: Progress,
        length: RunLength,
        global_batch: int,
        measure: Measure,
    ):
        self.cfg, self.tracker, self.stepper, self.nonfinite = cfg, tracker, stepper, nonfinite
        self.measure = measure
        self.progress, self.length, self.global_batch = progress, length, global_batch
        self.timer = time.perf_counter()  # since the last log, less the time spent apart from training

    def maybe_log(self) -> None:
        if self.length.due(self.progress.step, self.cfg.log_every):
            self.log()

    def log(self) -> None:
        progress, stepper, elapsed = self.progress, self.stepper, time.perf_counter() - self.timer
        measured = self.measure.interval(elapsed, stepper.loss_steps)  # first: its all-gather times the wait
        self.nonfinite.check()
        loss = self.nonfinite.synced_loss()
        progress.last_loss = loss
        if math.isnan(progress.first_loss):
            progress.first_loss = loss
        metrics = {
            "loss": loss,
            "lr": stepper.lr,
            "epoch": progress.epoch,
            "samples_per_s": stepper.loss_steps * self.global_batch / elapsed,
            **measured,
        }
        if self.cfg.clip_grad:
            metrics["grad_norm"] = float(stepper.grad_norm)
        log.info(
            "step %d/%d  epoch %d  loss %.4f  lr %.2e  %.0f samples/s%s  peak %.0f MiB (rank %d)%s%s",
            progress.step,
            self.length.total_steps,
            progress.epoch,
            loss,
            metrics["lr"],
            metrics["samples_per_s"],
            f"  {metrics['tokens_per_s']:.0f} tokens/s" if "tokens_per_s" in metrics else "",
            metrics["peak_memory_mib"],
            metrics["peak_memory_rank"],
            f"  mfu {metrics['mfu']:.1%}" if "mfu" in metrics else "",
            f"  grad norm {metrics['grad_norm']:.3g}" if "grad_norm" in metrics else "",
        )
        self.tracker.log(metrics, progress.step)
        stepper.reset_loss()
        self.timer = time.perf_counter()

    def add(self, results: dict[str, float], seconds: float) -> None:
        """Results measured apart from training (an evaluation), which took `seconds` of the time since the last
        log: samples/s counts training time only."""
        self.tracker.log(results, self.progress.step)
        self.timer += seconds


def _plain(value):
    """JSON has no NaN or infinity: write them as null."""
    value = value.item() if hasattr(value, "item") else value
    return None if isinstance(value, float) and not math.isfinite(value) else value


def make_tracker(
    env: DistEnv, mode: str, project: str, run_id: str, config: dict, metrics_file: str, resumed_from: int | None
) -> Tracker:
    """What rank 0 tracks to (a metrics file, wandb); a tracker that does nothing on the others."""
    if not env.is_main:
        return Tracker()
    trackers: list[Tracker] = []
    if metrics_file:
        trackers.append(MetricsFile(metrics_file, run_id, resumed_from))
    if mode != "disabled":
        trackers.append(WandbTracker(project, run_id, mode, config))
    return Trackers(trackers)
