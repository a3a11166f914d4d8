"""Experiment tracking: wandb and a local metrics file on rank 0, a tracker that does nothing everywhere else.

The training loop calls `tracker.log(...)` on every rank and never asks which rank it is on. wandb is
imported only when it is used. The run id (`run_id`) lives in the snapshot folder, so restarts and re-launches
that resume from it continue the same wandb run.

The metrics file (`--metrics-file`, JSON Lines) holds one object per logged step: `{"step": 120, "loss": ...,
"lr": ..., "val_loss": ...}`. A resumed run first drops the records of steps after the snapshot it resumed
from, so steps that are trained again replace what the failed attempt wrote instead of repeating it: read the
file top to bottom and every step appears once. Each line is flushed as it is written; a crash loses at
most the line being written, and a partial last line is dropped at the next start.
"""

import json
import logging
import math
import os
import re
import secrets
import time
from typing import Literal, cast

from . import distributed
from .distributed import DistEnv
from .snapshot import RUN_FILE, SnapshotError, short_repr, write_json_atomic

WandbMode = Literal["online", "offline", "disabled"]  # the choices of --wandb
RUN_ID = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")  # what wandb accepts as a run id

log = logging.getLogger(__name__)


def run_id(env: DistEnv, snapshot_dir: str) -> str:
    """This run's id, kept in the snapshot folder (run.json) and created on the first start.

    Every restart and re-launch that resumes from the folder continues the same wandb run; `--resume never` sets
    the folder aside, run.json with it, so a fresh start is a new run. Rank 0 reads or creates the file (with the
    folder's job lock held: call it after Snapshots.prepare); every rank gets the id, or the same error.
    """
    problem, found = None, None
    if env.is_main:
        try:
            found = _read_or_create_run_id(os.path.join(snapshot_dir, RUN_FILE))
        except SnapshotError as exc:
            problem = str(exc)
    problem, found = distributed.broadcast_object(env, (problem, found))
    if problem:
        raise SnapshotError(problem)
    return cast(str, found)


def _read_or_create_run_id(path: str) -> str:
    remedy = "delete it to start a new run id (a new wandb run)"
    if os.path.isdir(path):
        raise SnapshotError(f"{path} is a folder, not the run file: {remedy}")
    try:
        with open(path, encoding="utf-8") as handle:
            content = json.load(handle)
    except FileNotFoundError:
        created = secrets.token_hex(4)
        write_json_atomic(path, {"run_id": created})
        return created
    except (OSError, ValueError, RecursionError) as exc:
        raise SnapshotError(f"{path} is damaged ({type(exc).__name__}: {exc}): {remedy}") from exc
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

    def log(self, metrics: dict, step: int) -> None:
        pass

    def finish(self) -> None:
        pass


class WandbTracker(Tracker):
    def __init__(self, project: str, run_id: str, mode: str, config: dict):
        try:
            import wandb
        except ImportError as exc:
            raise RuntimeError(f"--wandb {mode} needs wandb: pip install wandb, or pass --wandb disabled") from exc

        self._wandb = wandb
        self.run = wandb.init(project=project, id=run_id, resume="allow", mode=cast(WandbMode, mode), config=config)
        # Resumed runs log steps the failed attempt may have logged already; a metric of our own as the x axis
        # keeps wandb from dropping them as out of order.
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")
        log.info("wandb run %s (%s mode, project %s)", run_id, mode, project)

    def log(self, metrics: dict, step: int) -> None:
        self.run.log({"step": step, **metrics})

    def finish(self) -> None:
        self.run.finish()


class MetricsFile(Tracker):
    """JSON Lines on rank 0: one record per logged step, steps after `resumed_from` dropped first (-1: a new run).

    Metrics logged for the step of the last line (validation after training metrics) are merged into it.
    """

    def __init__(self, path: str, resumed_from: int):
        self.path = path
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        if resumed_from < 0 and os.path.exists(path) and os.path.getsize(path) > 0:
            kept_aside = f"{path}.{time.strftime('%Y%m%d-%H%M%S')}"
            os.replace(path, kept_aside)  # a fresh run starts a fresh file; the old one is kept, not overwritten
            log.info("a new run: the previous metrics file is now %s", kept_aside)
        steps = [(_step_of(line), line) for line in _read_lines(path)]
        kept = [line for step, line in steps if step is not None and step <= resumed_from]
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "wb") as handle:
            handle.write("".join(kept).encode())
        os.replace(tmp, path)
        self._file = open(path, "ab")
        self._last: dict = {}
        self._last_offset = self._file.tell()

    def log(self, metrics: dict, step: int) -> None:
        record = {k: _plain(v) for k, v in metrics.items()}
        if self._last.get("step") == step:
            record = {**self._last, **record}
            self._file.truncate(self._last_offset)
        else:
            self._last_offset = self._file.tell()
        self._last = {"step": step, **record}
        self._file.write((json.dumps(self._last) + "\n").encode())
        self._file.flush()

    def finish(self) -> None:
        self._file.close()


class Trackers(Tracker):
    """Several trackers as one."""

    def __init__(self, trackers: list[Tracker]):
        self.trackers = trackers

    def log(self, metrics: dict, step: int) -> None:
        for tracker in self.trackers:
            tracker.log(metrics, step)

    def finish(self) -> None:
        for tracker in self.trackers:
            tracker.finish()


def _read_lines(path: str) -> list[str]:
    try:
        with open(path, encoding="utf-8") as handle:
            return [line if line.endswith("\n") else line + "\n" for line in handle]
    except FileNotFoundError:
        return []


def _step_of(line: str) -> int | None:
    try:
        step = json.loads(line).get("step")
    except (ValueError, AttributeError):
        return None  # the partial last line of a crash, or not ours
    return step if isinstance(step, int) else None


def _plain(value):
    """JSON has no NaN or infinity: write them as null."""
    value = value.item() if hasattr(value, "item") else value
    return None if isinstance(value, float) and not math.isfinite(value) else value


def make_tracker(
    env: DistEnv,
    mode: str,
    project: str,
    run_id: str,
    config: dict,
    metrics_file: str = "",
    resumed_from: int = -1,
) -> Tracker:
    if not env.is_main:
        return Tracker()
    trackers: list[Tracker] = []
    if metrics_file:
        trackers.append(MetricsFile(metrics_file, resumed_from))
    if mode != "disabled":
        trackers.append(WandbTracker(project, run_id, mode, config))
    return Trackers(trackers)
