"""Train from a notebook or a script, without torchrun: `launch(nproc_per_node=N, args=[...train.py flags...])`.

The machinery's (machinery/launcher.py says how it works); this module is where the project's users import it from.
"""

from .machinery.launcher import TrainingFailed, launch
from .machinery.settings import RunError

__all__ = ["RunError", "TrainingFailed", "launch"]
