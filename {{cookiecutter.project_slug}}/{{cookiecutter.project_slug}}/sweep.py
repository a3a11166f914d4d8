"""Sweeps: an Optuna study of multi-rank runs of train.py, each trial in a folder of its own.

    python -m {{cookiecutter.project_slug}}.sweep space.toml          # run the study (again: it goes on where it was)
    python -m {{cookiecutter.project_slug}}.sweep space.toml --show   # the trials table and sweeps/<study>/trials.png

From Python or a notebook: `sweep("space.toml")`. docs/recipes.md ("Sweeps") shows a space; docs/scaling.md runs one
study from several machines. The machinery's (machinery/sweeps.py says how it works); this module is where the
project's users start it from.
"""

from __future__ import annotations

import sys
from typing import Any

from .machinery.settings import RunError
from .machinery.sweeps import main, read_space, rows, run_study, show

__all__ = ["RunError", "sweep"]


def sweep(space: str, *, show_only: bool = False, storage: str = "", directory: str = "sweeps") -> list[dict[str, Any]]:
    """Run the study of `space` (SPACE.toml) until it has its trials, or only show it (`show_only`); return one row
    per trial (number, state, the metric, steps, wall time, parameters). A bad space raises RunError naming it."""
    found = read_space(space, directory)
    if storage:
        found.storage = storage
    study = show(found) if show_only else run_study(found)
    return rows(study, found)


if __name__ == "__main__":
    sys.exit(main())
