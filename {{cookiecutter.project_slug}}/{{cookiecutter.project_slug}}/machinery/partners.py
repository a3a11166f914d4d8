"""The jobs this one trains a model with, as the training loop sees them: a few hooks, called at fixed points.

`Partners` itself is a job that trains alone (every hook does nothing), so the loop reads the same either way; an
optional part chosen at generation may subclass it to let several jobs train one model together (`for_run`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from torch import nn

from .distributed import DistEnv


class Partners:
    """This job among the jobs that train the model together: here, a job alone."""

    # False: other jobs train the same model, and this one may take their state at any step, past its own snapshots
    # (a failed step is then not replayed from a snapshot, and the metrics file keeps what was trained after it).
    alone = True

    def data_env(self, cfg: Any, env: DistEnv, stream: bool) -> DistEnv:
        """This rank's place among every rank that shares each step's data (refusing data or settings that the
        jobs cannot share)."""
        return env

    def join(self, trainer: Any) -> None:
        """Meet the other jobs, once the model is wrapped (trainer.py) and before the first step."""

    def start_step(self, stopping: Callable[[], bool]) -> bool:
        """Before each step. False: a rank was asked to stop (`stopping`) while the job waited for the others."""
        return True

    def skip_averaging(self) -> contextlib.AbstractContextManager:
        """Around a backward whose gradients are thrown away: no rank averages them with any other."""
        return contextlib.nullcontext()

    def before_backward(self, token_weighted: bool) -> None:
        """Before each micro-batch's backward; `token_weighted`: the gradients are sums, scaled after backward."""

    def average_and_commit(self, model: nn.Module) -> bool:
        """After backward: average the gradients (and floating-point buffers) with the other jobs. False: the step
        is dropped, and taken again with the same data."""
        return True

    def close(self, error: BaseException | None = None) -> None:
        """At the end of the run; `error`: the exception that ends it early, if one does."""

    def end_process(self, code: int) -> None:
        """After a run that ended without an error, its files written and the process group left: the process is
        about to exit with `code`. Here it returns, and the interpreter exits as usual."""


def for_run(cfg: Any) -> Partners:
    """The job group the settings ask for. Called before the log file is opened: a group may give each of its jobs
    files of its own (in `cfg`)."""
{%- if cookiecutter.replica_groups == "yes" %}
    from . import replicas

    if replicas.requested(cfg):
        return replicas.ReplicaGroup(cfg)
{%- endif %}
    return Partners()
