"""Experiment tracking: wandb on rank 0, a tracker that does nothing everywhere else.

The training loop calls `tracker.log(...)` on every rank and never asks which rank it is on. wandb is
imported only when it is used. The run id lives in the snapshot folder, so restarts and re-launches that
resume from it continue the same wandb run.
"""

from . import logs

log = logs.get_logger(__name__)


class Tracker:
    """Does nothing: what every rank but 0 gets, and rank 0 too when tracking is disabled."""

    def log(self, metrics, step):
        pass

    def finish(self):
        pass


class WandbTracker(Tracker):
    def __init__(self, project, run_id, mode, config):
        try:
            import wandb
        except ImportError as exc:
            raise RuntimeError(f"--wandb {mode} needs wandb: pip install wandb, or pass --wandb disabled") from exc

        self._wandb = wandb
        self.run = wandb.init(project=project, id=run_id, resume="allow", mode=mode, config=config)
        # Resumed runs log steps the failed attempt may have logged already; a metric of our own as the x axis
        # keeps wandb from dropping them as out of order.
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")
        log.info("wandb run %s (%s mode, project %s)", run_id, mode, project)

    def log(self, metrics, step):
        self.run.log({"step": step, **metrics})

    def finish(self):
        self.run.finish()


def make_tracker(env, mode, project, run_id, config):
    if env.is_main and mode != "disabled":
        return WandbTracker(project, run_id, mode, config)
    return Tracker()
