"""The training loop. `train()` reads top to bottom: train step -> log -> evaluate -> snapshot -> stop check.

`Trainer` holds the run's parts (machinery/__init__.py lists the modules); how a run starts and resumes is
startup.py's, how it ends ending.py's.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch.utils.data import IterableDataset

from . import distributed, ending, logs, nonfinite, outputs, pretrained, startup, trialreport, watchdog
from .batches import Batches
from .checkpointer import Checkpointer
from .debugflags import DebugFlags, replay_settings
from .distributed import DistEnv
from .evaluate import Validator
from .hooks import UserCode
from .measure import Measure
from .parallel import DistributedModel
from .partners import Partners
from .report import Summary, progress_bar, write_config
from .settings import RunError, flag
from .snapshot import SnapshotError, Snapshots, restore_rng
from .snapshot.rng import seed_rng
from .state import estimated_bytes
from .stop import StopRequest
from .tracking import MetricsLog, Trackers

log = logging.getLogger(__name__)
PACKAGE = __name__.rsplit(".", 2)[0]  # the project's package, which holds model.py and data.py
# How long a failing rank waits for the snapshot in flight to be committed: well within torchrun's 30 s between
# its SIGTERM to the other workers and its SIGKILL.
SAVE_GRACE_S = 10.0


class Trainer:
    """Everything one run holds: model, data, optimizer, snapshots, trackers; resumed if a snapshot is there."""

    def __init__(self, cfg: Any, env: DistEnv, partners: Partners | None = None):
        self.cfg, self.env = cfg, env
        self.partners = partners or Partners()  # the jobs this one trains the model with (partners.py): none by default
        outputs.check_paths(cfg, env)  # before anything slow: a path that cannot be written is refused at once
        self.user = UserCode(PACKAGE, env)
        for line in self.user.misspelled() + self.user.unused():
            self.warn_from_rank_0("%s", line)
        if self.user.prepare_data is not None:  # downloads, a cache: once per machine, the others wait for it
            distributed.once_per_machine(env, "prepare_data", lambda: self.user.prepare_data(cfg))
        torch.manual_seed(cfg.seed)  # the same initial weights on every rank
        self.train_data, self.val_data = self.user.build_datasets(cfg)
        self.stream = isinstance(self.train_data, IterableDataset)
        # Whose share of each step's data this rank trains on: its own among the job's ranks, or among the ranks
        # of every job it trains with.
        self.data_env = self.partners.data_env(cfg, env, self.stream)
        self.global_batch = self.data_env.world_size * cfg.batch_size * cfg.grad_accum
        startup.check_same_data(env, None if self.stream else self.train_data, self.val_data)
        if not self.stream and len(self.train_data) < self.global_batch:
            raise RunError(
                f"the training data has {len(self.train_data)} samples, fewer than one optimizer step takes "
                f"({self.data_env.world_size} rank(s) x {flag('batch_size')} {cfg.batch_size} x "
                f"{flag('grad_accum')} {cfg.grad_accum} = {self.global_batch}): lower them"
            )
        # With starting weights under fsdp, the parameters take memory only once sharded (pretrained.py)
        self.starting_weights = pretrained.source(self.user, cfg)
        on_meta = self.starting_weights is not None and cfg.strategy == "fsdp"
        self.model = pretrained.build_model(self.user, cfg, self.train_data, env, on_meta, self.warn_from_rank_0)
        self.parallel = DistributedModel(self.model, cfg, env, self.user)  # fsdp shards here, before the optimizer
        pretrained.materialize(self.model, env.device)

        timeout = distributed.collective_timeout(cfg).total_seconds()  # how long one rank may wait for the others
        self.snapshots = Snapshots(
            cfg.snapshot_dir,
            env,
            keep=cfg.keep_snapshots,
            commit_timeout=timeout,
            sharded=self.parallel.sharded,
            copy=cfg.snapshot_copy,
        )
        try:  # each decided on rank 0 or agreed by every rank: the same error everywhere
            self.snapshots.prepare(estimated_bytes(self.model), fresh_start=cfg.resume == "never")
        except SnapshotError as exc:  # prepare has let the folder go
            raise RunError(str(exc)) from None
        logs.follow_moved_files()  # a log file in a folder that a fresh start moved aside: this run's lines come along
        try:  # the folder's job lock is this run's now: a start-up that fails lets it go
            start = startup.build_and_restore(self)
            # a job that trains with others may take their state and go on past its snapshot (partners.py)
            resumed_from = start.resumed_from if self.partners.alone else None
            self.exports, tracker, self.metrics_file = startup.claim_outputs(cfg, env, start.run_id, resumed_from)
        except BaseException:
            self.snapshots.close()
            raise
        self.trial = trialreport.for_run(env)  # a sweep's trial: its metric goes to the study, whose pruner may stop it
        if self.trial is not None:
            tracker = Trackers([tracker, self.trial])
        self.run_id, self.progress, self.length = start.run_id, start.progress, start.length
        self.resumed_from, self.batches = start.resumed_from, start.batches
        self.state, self.stepper = start.state, start.stepper
        if env.is_main:
            write_config(cfg, self.snapshots.directory)

        self.parallel.wrap(resumed=self.resumed_from >= 0, with_other_jobs=not self.partners.alone)
        self.hang_watch = watchdog.HangWatch(env.rank, timeout * 0.8, cfg.log_file)  # stacks, before the timeout
        self.partners.join(self)  # from here on, the jobs meet at every step
        self.nonfinite = nonfinite.NonfiniteGuard(self)  # NaN and infinity: the check at logs and snapshots
        self.measure = Measure(cfg, env, self.stepper)  # the parts of each step's time, tokens, peak memory
        # The parts that decide their own cadence in train(): metrics, evaluation, snapshots
        self.metrics = MetricsLog(
            cfg, tracker, self.stepper, self.nonfinite, self.progress, self.length, self.global_batch, self.measure
        )
        self.validator = Validator(
            self.val_data, self.parallel, self.user, cfg, env, self.metrics, self.exports, self.hang_watch.beat
        )
        self.checkpointer = Checkpointer(cfg, env, self.snapshots, self.nonfinite, start)
        # The random streams last, right before the first step, so nothing in between can draw from them.
        if start.rng_state is not None:
            restore_rng(start.rng_state)
        else:  # a fresh start, or a resume with another number of ranks: new streams, distinct per rank and step
            seed_rng(cfg.seed + self.data_env.rank + 1_000_003 * self.progress.step, every_device=True)

    # -- one optimizer step ------------------------------------------------------------------------------------

    def start_step(self, stop: StopRequest) -> bool:
        """The start of a step among the jobs this one trains with (a no-op for a job alone). False: the job was
        asked to stop while it waited for the others; every rank of the job knows it then (`stop.stopped`)."""
        if self.partners.start_step(lambda: bool(stop.signal)):
            return True
        stop.agree_now()
        return False

    def forward_backward(self, micro_batches: list) -> None:
        self.stepper.forward_backward(micro_batches)  # a method of its own: a fault injection wraps it

    def optimizer_step(self) -> bool:
        """Step the optimizer (step.py); False: the jobs this one trains with dropped the step (one failed in it)."""
        stepped = self.stepper.optimizer_step()
        self.hang_watch.beat()
        if not stepped and isinstance(self.batches, Batches):
            self.batches.repeat_last_step()  # the dropped step's data, once more
        return stepped

    def close(self, error: BaseException | None = None) -> None:
        """`error`: the exception that ends the run early, if one does."""
        self.partners.close(error)
        self.hang_watch.close()
        self.metrics.tracker.finish()
        self.exports.close()
        self.snapshots.close()

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, kind, error, traceback) -> None:
        try:
            if kind is None or issubclass(kind, RunError):
                self.snapshots.wait()  # a save in flight holds a good state: let it commit
            else:  # a rank's own error, or a lost peer: a part that may never come is waited for a while only
                self.snapshots.finish_after_failure(SAVE_GRACE_S)
        finally:
            self.close(error)

    def warn_from_rank_0(self, message: str, *args) -> None:
        """A warning that every rank reaches alike (settings, an agreed stop): rank 0 says it, the others at DEBUG."""
        logs.warn_from_rank_0(log, self.env.is_main, message, *args)


def train(cfg: Any, env: DistEnv, partners: Partners | None = None) -> Summary:
    """Train until --max-steps or --epochs; resume from the newest good snapshot in --snapshot-dir if there is one.
    `partners`: the jobs this one trains the model with (partners.py), if any."""
    cfg = replay_settings(cfg, env)  # --resume-from: a scratch copy of that snapshot is the run's snapshot folder
    with (
        Trainer(cfg, env, partners) as trainer,  # model, data, optimizer, snapshots: restored from the newest good one
        StopRequest(env, trainer.trial.asks_to_stop if trainer.trial else None) as stop,
        progress_bar(env, trainer.length.total_steps, trainer.progress.step) as bar,
        # --break-at-step, --profile-steps, --check-replicas: a step the run cannot reach is said here, at start-up,
        # and pdb without a terminal to stop in is refused
        DebugFlags(cfg, env, trainer.model, trainer.progress, trainer.length.total_steps) as flags,
    ):
        progress, snapshots, measure = trainer.progress, trainer.snapshots, trainer.measure
        while progress.step < trainer.length.total_steps and not stop.stopped:
            if not trainer.start_step(stop):  # the jobs this one trains with, if any, start the step together
                break
            measure.begin_step()  # each part of the step's time ends at a mark: done(part)
            micro_batches = flags.before_forward(next(trainer.batches))
            measure.done("data")
            with measure.counting_flops():
                trainer.forward_backward(micro_batches)
            measure.done("compute", micro_batches)
            # Between backward and the optimizer step, always: the save in flight must have copied the weights
            # before the optimizer changes them in place (a test fails when it moves).
            snapshots.wait_until_copied()
            measure.done("snapshot")
            if not trainer.optimizer_step():
                continue  # a job failed during this step: it is dropped, and taken again with the same data
            measure.done("optimizer")
            flags.after_step()  # before the snapshot: --check-replicas stops a run whose replicas drifted apart
            bar.update()

            trainer.metrics.maybe_log()  # each at its own cadence (--log-every, --eval-every, --snapshot-every)
            trainer.validator.maybe_evaluate()
            measure.done(None)  # the checks, logging and evaluation are no part of the step's time
            trainer.checkpointer.maybe_save()
            measure.done("snapshot")
            stop.agreed()  # every rank learns of a SIGTERM or Ctrl-C at the same step
        return ending.finish(trainer, stop)
