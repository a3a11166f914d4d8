"""A run that is one trial of a sweep (sweeps.py starts it with SWEEP_* in its environment): rank 0 reports each
value of the study's metric to the study, and asks the study's pruner whether to go on; a pruned trial stops on
every rank at the same step, with a snapshot (stop.py). A run outside a sweep has no such part, and imports nothing
of optuna."""

from __future__ import annotations

import json
import logging
import math
import os
from typing import Any

from .distributed import DistEnv
from .tracking import Tracker

log = logging.getLogger(__name__)
# What the sweep tells a trial's ranks: the study's storage, its name, this trial's id and the metric to report,
# and the pruner's settings (a JSON object)
STORAGE, STUDY, TRIAL, METRIC, PRUNER = "SWEEP_STORAGE", "SWEEP_STUDY", "SWEEP_TRIAL_ID", "SWEEP_METRIC", "SWEEP_PRUNER"


PRUNER_KEYS = ("pruner", "pruner_startup_trials", "pruner_warmup_steps")  # of SPACE.toml's [study]


def make_pruner(settings: dict[str, Any]) -> Any:
    """The pruner that SPACE.toml's [study] names (`settings`: its PRUNER_KEYS): "median" (optuna's MedianPruner)
    or "none"."""
    import optuna

    if settings["pruner"] == "none":
        return optuna.pruners.NopPruner()
    return optuna.pruners.MedianPruner(
        n_startup_trials=settings["pruner_startup_trials"], n_warmup_steps=settings["pruner_warmup_steps"]
    )


def engine_options(url: str) -> dict[str, Any]:
    """SQLite: wait up to a minute for a lock that another worker of the study holds, instead of failing at once."""
    return {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else {}


class TrialReport(Tracker):
    """Rank 0's link to the study: every logged record that holds the metric is reported at its step; once the
    pruner says so, `pruned` holds that step, and the run stops (StopRequest asks `asks_to_stop`)."""

    def __init__(self, env: DistEnv):
        self.env = env
        self.metric = os.environ[METRIC]
        self.pruned: int | None = None
        self.trial: Any = None
        if env.is_main:
            import optuna

            optuna.logging.set_verbosity(optuna.logging.WARNING)
            pruner = make_pruner(json.loads(os.environ[PRUNER]))
            storage = optuna.storages.RDBStorage(os.environ[STORAGE], engine_kwargs=engine_options(os.environ[STORAGE]))
            study = optuna.load_study(study_name=os.environ[STUDY], storage=storage, pruner=pruner)
            self.trial = optuna.trial.Trial(study, int(os.environ[TRIAL]))

    def log(self, metrics: dict, step: int) -> None:
        value = metrics.get(self.metric)
        if self.trial is None or self.pruned is not None or not isinstance(value, (int, float)):
            return
        if not math.isfinite(value):
            return
        self.trial.report(float(value), step)
        if self.trial.should_prune():
            self.pruned = step
            log.info("the sweep's pruner stops this trial at step %d (%s %.4f)", step, self.metric, value)

    def asks_to_stop(self) -> bool:
        return self.pruned is not None


def for_run(env: DistEnv) -> TrialReport | None:
    """The trial this run is, when a sweep started it; None otherwise."""
    if not os.environ.get(TRIAL):
        return None
    return TrialReport(env)
