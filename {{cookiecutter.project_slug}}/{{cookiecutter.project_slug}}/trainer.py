"""The training loop. `train()` reads top to bottom: train step -> log -> evaluate -> snapshot -> stop check.

What a resume takes from the snapshot, and what from the command line (or --config) of the new launch:
- From the snapshot: the weights, the optimizer's moments, the step, the data position (epoch and samples seen),
  every rank's random streams, the run id, and the run's length in samples (see `RunLength`).
- From the command line: everything else, applied from the first resumed step. A new --lr, --warmup-steps,
  --max-steps or --epochs rescales the learning-rate schedule (it is a function of the samples seen, not a stored
  state); a new --weight-decay replaces the snapshot's; --batch-size and --grad-accum change the step size while
  the data position stays exact in samples. The changed settings are logged once.
- A snapshot of another model (other layer names or shapes) stops the run with one line: use --resume never.

--strategy ddp (the default) wraps the model in DistributedDataParallel; --strategy fsdp shards it with FSDP2
(`_shard`), and snapshots then hold the model and optimizer as DCP shards (see snapshot.py).
"""

import contextlib
import dataclasses
import json
import logging
import math
import os
import random
import signal
import sys
import time
from collections.abc import Iterator, Sized
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler, default_collate

from . import distributed, joblock, tracking, watchdog
from . import model as user_model
from .config import Config, RunError, flag
from .data import build_datasets
from .distributed import DistEnv
from .snapshot import SnapshotError, Snapshots, capture_rng, restore_rng, step_name, write_atomic, write_json_atomic

if TYPE_CHECKING:
    from tqdm import tqdm

log = logging.getLogger(__name__)

SAMPLES = " samples"  # evaluation's sample count, kept beside the sums under a name no val_metrics key can take
AMP_DTYPES = {"off": None, "bf16": torch.bfloat16, "fp16": torch.float16}


STOP_RECORD = "stopped.json"  # in the snapshot folder: which torchrun job a signal stopped, at which step


def stopped_by_signal(cfg: Config) -> int:
    """The signal that stopped this torchrun job, when this process is one of torchrun's restarts of it; else 0.

    A SIGTERM or Ctrl-C that reaches only the workers (Kubernetes and srun signal every process) stops them at a
    step with a snapshot, and they exit with 128 + signal. torchrun takes that for a failure and restarts them;
    each restart reads the job's stop record and exits at once with the same code, so the job stays stopped
    (and its exit code says so) instead of training on. A new launch, even with the same --rdzv-id (a requeued
    SLURM job), is no restart: it clears the record and resumes.
    """
    if not int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0):
        return 0
    try:
        with open(os.path.join(cfg.snapshot_dir, STOP_RECORD), encoding="utf-8") as handle:
            record = json.load(handle)
    except (OSError, ValueError):
        return 0
    stopped_job = record.get("job") if isinstance(record, dict) else None
    signum = record.get("signal") if isinstance(record, dict) else None
    return signum if stopped_job == joblock.current_job() and isinstance(signum, int) and signum > 0 else 0


@dataclass
class Progress:
    """Where the run is. Saved in every snapshot; a resume continues from it."""

    step: int = 0  # optimizer steps done
    epoch: int = 0
    samples_in_epoch: int = 0  # samples of the current epoch consumed by all ranks together
    samples_seen: int = 0
    step_samples: int = 0  # samples per optimizer step when the run started: the unit of the run's length
    first_loss: float = math.nan  # loss of the first logged step, kept across restarts for the summary
    last_loss: float = math.nan
    val_loss: float = math.nan
    best_val_loss: float = math.inf
    best_step: int = -1


@dataclass
class Summary:
    world_size: int
    steps: int
    total_steps: int
    resumed_from: int  # step the run resumed from; -1 for a fresh start
    samples_seen: int
    first_loss: float
    last_loss: float
    val_loss: float  # the last evaluation's; NaN without validation data
    best_val_loss: float
    best_step: int
    snapshot_dir: str
    newest_snapshot: str
    export_dir: str
    log_file: str
    metrics_file: str
    already_complete: bool = False  # the snapshot was already at the end: nothing was trained
    stop_signal: int = 0  # the signal that stopped the run early, 0 if it finished


class RunLength:
    """How long the run is, in samples, so that it means the same amount of data at any world size.

    `--max-steps N` (or `--epochs E`) counts optimizer steps of the size they had when the run started
    (`step_samples`): a job resumed on more or fewer ranks trains the samples left, in steps of its own size.
    The learning-rate schedule is a function of the samples seen, so it is the same curve at any world size.
    """

    def __init__(self, cfg: Config, step_samples: int, train_size: int):
        steps_per_epoch = train_size // step_samples
        self.samples = (cfg.max_steps or cfg.epochs * steps_per_epoch) * step_samples
        self.warmup_samples = cfg.warmup_steps * step_samples
        self.step_samples = step_samples
        self.peak_lr = cfg.lr

    def steps(self, progress: Progress, global_batch: int) -> int:
        """The step at which this attempt ends: the steps done plus the steps left at this attempt's size."""
        left = max(0, self.samples - progress.samples_seen)
        return progress.step + -(-left // global_batch)

    def lr(self, samples_seen: int) -> float:
        """Linear warmup, then cosine decay to 10% of the peak; in samples (= steps at the starting size)."""
        position = samples_seen / self.step_samples
        if samples_seen < self.warmup_samples:
            return self.peak_lr * (position + 1) / (self.warmup_samples / self.step_samples)
        decay = max(1.0, (self.samples - self.warmup_samples) / self.step_samples)
        done = min(1.0, (samples_seen - self.warmup_samples) / self.step_samples / decay)
        return self.peak_lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * done)))


class ResumableSampler(DistributedSampler):
    """A DistributedSampler that can start mid-epoch and yields whole optimizer steps only.

    An epoch's order is one permutation of the dataset (seeded with seed + epoch, as DistributedSampler does),
    and rank r takes every world_size-th index of it. After k optimizer steps the job has consumed exactly the
    first k * global_batch indices of that permutation, whatever the number of ranks, so a resumed job skips
    them at the index level, without loading them, and continues with the rest.
    """

    def __init__(self, dataset: Dataset, env: DistEnv, seed: int, samples_per_rank_step: int):
        super().__init__(dataset, num_replicas=env.world_size, rank=env.rank, shuffle=True, seed=seed, drop_last=True)
        self.samples_per_rank_step = samples_per_rank_step
        self.start = 0

    def set_position(self, epoch: int, start: int) -> None:
        self.set_epoch(epoch)
        self.start = start

    def steps(self) -> int:
        """Whole optimizer steps left in this epoch."""
        return (_size(self.dataset) - self.start) // (self.num_replicas * self.samples_per_rank_step)

    def __len__(self) -> int:
        return self.steps() * self.samples_per_rank_step

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(_size(self.dataset), generator=generator)
        order = order[self.start : self.start + self.steps() * self.num_replicas * self.samples_per_rank_step]
        return iter(order[self.rank :: self.num_replicas].tolist())


class Batches:
    """The training data one optimizer step at a time: `next(batches)` is the step's list of micro-batches.

    It owns the data position in `progress` (epoch, samples consumed): it skips what a resumed run has already
    seen, re-seeds the sampler and the loader at each epoch, and rolls over to the next epoch when fewer
    samples than one step are left.
    """

    def __init__(self, dataset: Dataset, cfg: Config, env: DistEnv, progress: Progress):
        self.cfg, self.env, self.progress = cfg, env, progress
        self.global_batch = env.world_size * cfg.batch_size * cfg.grad_accum
        self.sampler = ResumableSampler(dataset, env, cfg.seed, cfg.batch_size * cfg.grad_accum)
        self.generator = torch.Generator()  # explicit, so starting an epoch never draws from the global RNG
        self.loader = DataLoader(
            dataset,
            batch_size=cfg.batch_size,
            sampler=self.sampler,
            drop_last=True,
            num_workers=cfg.num_workers,
            pin_memory=env.device.type == "cuda",
            persistent_workers=cfg.num_workers > 0,
            generator=self.generator,
        )
        self._iterator: Iterator[Any] = iter(())  # replaced by the first step's epoch start
        self._steps_left = 0

    def __iter__(self) -> "Batches":
        return self

    def __next__(self) -> list:
        while self._steps_left == 0:
            self._start_epoch()
        self._steps_left -= 1
        self.progress.samples_in_epoch += self.global_batch
        self.progress.samples_seen += self.global_batch
        return [next(self._iterator) for _ in range(self.cfg.grad_accum)]

    def _start_epoch(self) -> None:
        progress = self.progress
        if progress.samples_in_epoch + self.global_batch > _size(self.sampler.dataset):  # no whole step left
            progress.epoch += 1
            progress.samples_in_epoch = 0
        self.sampler.set_position(progress.epoch, progress.samples_in_epoch)
        self.generator.manual_seed(self.cfg.seed * 1_000_003 + progress.epoch * 7_919 + self.env.rank)
        self._iterator, self._steps_left = iter(self.loader), self.sampler.steps()


class StopRequest:
    """SIGTERM (what torchrun, SLURM and Kubernetes send before a kill) or Ctrl-C asks the job to stop at a step.

    The handler only sets a flag; a second Ctrl-C interrupts at once. The ranks agree on when to stop with a
    one-number all_reduce started after each step and read after the next one, so its latency hides behind the
    step and all ranks stop together.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, env: DistEnv):
        self.env = env
        self.signal = 0  # the signal this rank received
        self.stopped = False  # set on every rank at the same step once the ranks agree to stop
        self._pending = None
        self._flag = torch.zeros(1, dtype=torch.int64)
        self._signalled_at = 0.0
        self._previous = {signum: signal.signal(signum, self._handle) for signum in self.SIGNALS}

    def _handle(self, signum, frame):
        # A second Ctrl-C stops at once, without a snapshot; not the copy torchrun forwards right after the first.
        if signum == signal.SIGINT and self.signal and time.monotonic() - self._signalled_at > 1.0:
            raise KeyboardInterrupt
        self.signal, self._signalled_at = self.signal or signum, time.monotonic()

    def agreed(self) -> bool:
        """True on every rank at the same step, once any rank got the signal."""
        if not self.env.is_distributed:
            self.stopped = bool(self.signal)
            return self.stopped
        if self._pending is not None:
            self._pending.wait()
            self.stopped = bool(self._flag.item())
            self.signal = self.signal or int(self._flag.item())
        self._flag.fill_(self.signal)
        self._pending = dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, async_op=True)
        return self.stopped

    def close(self) -> None:
        if self._pending is not None:
            self._pending.wait()  # every rank started the same number of these: finish the last one everywhere
            self._pending = None
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous = {}

    def __enter__(self) -> "StopRequest":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


class Trainer:
    """Everything one run holds: model, data, optimizer, snapshots, trackers; resumed if a snapshot is there."""

    def __init__(self, cfg: Config, env: DistEnv):
        self.cfg, self.env = cfg, env
        torch.manual_seed(cfg.seed)  # the same initial weights on every rank
        self.train_data, self.val_data = build_datasets(cfg)
        self.global_batch = env.world_size * cfg.batch_size * cfg.grad_accum
        if len(self.train_data) < self.global_batch:
            raise RunError(
                f"the training data has {len(self.train_data)} samples, fewer than one optimizer step takes "
                f"({env.world_size} rank(s) x {flag('batch_size')} {cfg.batch_size} x {flag('grad_accum')} "
                f"{cfg.grad_accum} = {self.global_batch}): lower them"
            )
        self.model = user_model.build_model(cfg, self.train_data).to(env.device)
        self.sharded = cfg.strategy == "fsdp"
        if self.sharded:
            self._shard(self.model)  # before the optimizer: it holds the sharded parameters
        self.val_metrics = getattr(user_model, "val_metrics", None)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.amp_dtype = AMP_DTYPES[cfg.amp]
        self.scaler = torch.amp.GradScaler(env.device.type, enabled=cfg.amp == "fp16" and env.device.type == "cuda")

        timeout = distributed.collective_timeout(cfg).total_seconds()  # how long one rank may wait for the others
        self.snapshots = Snapshots(
            cfg.snapshot_dir, env, keep=cfg.keep_snapshots, commit_timeout=timeout, sharded=self.sharded
        )
        try:  # each decided on rank 0 or agreed by every rank: the same error everywhere
            self.snapshots.prepare(snapshot_bytes(self.model), fresh_start=cfg.resume == "never")
        except SnapshotError as exc:  # prepare has let the folder go
            raise RunError(str(exc)) from None
        try:  # the folder's job lock is this run's now: a start-up that fails lets it go
            try:
                self.run_id = tracking.run_id(env, self.snapshots.directory)
                resumed = self.snapshots.resume()
            except SnapshotError as exc:
                raise RunError(str(exc)) from None
            stop_record = os.path.join(self.snapshots.directory, STOP_RECORD)
            if env.is_main and os.path.exists(stop_record):
                os.remove(stop_record)  # a new launch, not a restart of a stopped job: it is no longer stopped
            self.progress, rng_state, self.resumed_from = Progress(step_samples=self.global_batch), None, -1
            rng_state = self._restore(resumed) if resumed is not None else None
        except BaseException:
            self.snapshots.close()
            raise
        self.length = RunLength(cfg, self.progress.step_samples, len(self.train_data))
        self.total_steps = self.length.steps(self.progress, self.global_batch)
        self._write_config()
        self._warn_about_settings()

        self.ddp_model = self._wrap(self.model)
        self.batches = Batches(self.train_data, cfg, env, self.progress)
        self.tracker = tracking.make_tracker(
            env, cfg.wandb, cfg.wandb_project, self.run_id, cfg.to_dict(), cfg.metrics_file, self.resumed_from
        )
        self.last_saved = self.resumed_from if self.resumed_from >= 0 else None
        self._loss_sum, self._loss_steps = torch.zeros((), device=env.device), 0
        self._grad_norm = torch.zeros((), device=env.device)
        self.hang_watch = watchdog.HangWatch(env.rank, timeout * 0.8, cfg.log_file)  # stacks, before the timeout
        self._timer = time.perf_counter()
        # Restore the random streams last, right before the first step, so nothing in between can draw from them.
        if rng_state is not None:
            restore_rng(rng_state)
        else:  # a fresh start, or a resume with another number of ranks: new streams, distinct per rank and step
            seed_everything(cfg.seed + env.rank + 1_000_003 * self.progress.step)

    # -- one optimizer step ------------------------------------------------------------------------------------

    def forward_backward(self, micro_batches: list) -> None:
        """Forward and backward over the micro-batches of one optimizer step; gradients sync on the last one."""
        self.ddp_model.train()
        if self.sharded:  # as DDP does at each forward: every rank trains with rank 0's buffers
            distributed.broadcast_buffers(self.env, self.model)
        for index, (inputs, targets) in enumerate(micro_batches):
            inputs = inputs.to(self.env.device, non_blocking=True)
            targets = targets.to(self.env.device, non_blocking=True)
            last = index == len(micro_batches) - 1
            if self.sharded:  # FSDP reduce-scatters gradients on the last micro-step only
                cast(FSDPModule, self.model).set_requires_gradient_sync(last)
            sync = (
                contextlib.nullcontext()
                if last or not self.env.is_distributed or self.sharded
                else cast(DistributedDataParallel, self.ddp_model).no_sync()
            )
            with sync:
                with torch.autocast(self.env.device.type, dtype=self.amp_dtype, enabled=self.amp_dtype is not None):
                    loss = user_model.loss_fn(self.train_model(inputs), targets) / len(micro_batches)
                self.scaler.scale(loss).backward()
            self._loss_sum += loss.detach()

    def optimizer_step(self) -> None:
        """Clip, step at the scheduled learning rate, and move the position on by one step."""
        lr = self.length.lr(self.progress.samples_seen - self.global_batch)  # the step's samples are counted already
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if self.cfg.clip_grad:
            self.scaler.unscale_(self.optimizer)
            norm = nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.clip_grad)
            self._grad_norm = norm.full_tensor() if isinstance(norm, DTensor) else norm  # fsdp: over every shard
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.progress.step += 1
        self._loss_steps += 1
        self.hang_watch.beat()

    def due(self, every: int) -> bool:
        """True at every `every`-th step and at the last one (`every` = 0: only at the last one)."""
        step = self.progress.step
        return step >= self.total_steps or (every > 0 and step % every == 0)

    # -- logging, evaluation, snapshots ------------------------------------------------------------------------

    def log_metrics(self) -> None:
        """Mean loss since the last log over every rank, learning rate, speed; stops a run whose loss diverged."""
        progress, elapsed = self.progress, time.perf_counter() - self._timer
        loss = self._synced_loss()
        progress.last_loss = loss
        if math.isnan(progress.first_loss):
            progress.first_loss = loss
        metrics = {
            "loss": loss,
            "lr": self.optimizer.param_groups[0]["lr"],
            "epoch": progress.epoch,
            "samples_per_s": self._loss_steps * self.global_batch / elapsed,
        }
        if self.cfg.clip_grad:
            metrics["grad_norm"] = float(self._grad_norm)
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
        self._loss_sum.zero_()
        self._loss_steps, self._timer = 0, time.perf_counter()

    def evaluate(self) -> dict[str, float]:
        """val_loss and val_<name> over every validation sample, each counted once across the ranks.

        Each rank takes every world_size-th sample (no padding, no sampler), sums the loss and the metrics, and
        one all_reduce adds up sums and counts: the result equals one process evaluating the whole set. The model
        runs in eval mode (BatchNorm uses its running statistics, dropout is off) with rank 0's buffers on every
        rank, and the random streams are put back afterwards, so evaluating changes nothing a bitwise resume
        depends on.
        """
        if self.val_data is None or len(self.val_data) == 0:
            return {}
        started, rng_state = time.perf_counter(), capture_rng()
        distributed.broadcast_buffers(self.env, self.model)
        self.model.eval()
        shard = range(self.env.rank, len(self.val_data), self.env.world_size)
        loader = DataLoader(
            self.val_data,
            batch_size=self.cfg.batch_size,
            sampler=shard,
            num_workers=self.cfg.num_workers,
            generator=torch.Generator(),
        )
        sums: dict[str, torch.Tensor] = {}
        with (
            torch.no_grad(),
            torch.autocast(self.env.device.type, dtype=self.amp_dtype, enabled=self.amp_dtype is not None),
        ):
            for inputs, targets in loader:
                inputs, targets = inputs.to(self.env.device), targets.to(self.env.device)
                _add_batch_sums(sums, self.model(inputs), targets, self.val_metrics)
                self.hang_watch.beat()
            if self.sharded:  # each forward gathers parameters from every rank, so every rank runs as many
                most = math.ceil(len(range(0, len(self.val_data), self.env.world_size)) / self.cfg.batch_size)
                spare = default_collate([self.val_data[0]])[0].to(self.env.device)
                for _ in range(most - len(loader)):
                    self.model(spare)  # its output is not counted
        self.model.train()
        restore_rng(rng_state)
        names = distributed.broadcast_object(self.env, sorted(sums))  # rank 0 always has samples: it names them
        local = torch.stack(
            [sums.get(name, torch.zeros((), dtype=torch.float64, device=self.env.device)) for name in names]
        )
        totals = distributed.all_sum(self.env, local).tolist()
        count = totals[names.index(SAMPLES)]
        results = {
            f"val_{name}": total / count
            for name, total in sorted(zip(names, totals, strict=True), key=_loss_first)
            if name != SAMPLES
        }
        self._record_evaluation(results, int(count), time.perf_counter() - started)
        return results

    def save_snapshot(self, blocking: bool = False) -> None:
        """Start writing a snapshot of this step in the background (see snapshot.py); refuse a diverged state."""
        if self._loss_steps:
            self._synced_loss()  # stops the run if the loss since the last log diverged: no NaN snapshot
        if self.sharded:
            # DCP keeps one copy of each buffer (BatchNorm statistics): make it rank 0's, as under ddp. The next
            # step starts from rank 0's anyway.
            distributed.broadcast_buffers(self.env, self.model)
            model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        else:
            model_state, optimizer_state = self.model.state_dict(), self.optimizer.state_dict()
        for name, buffer in self.model.named_buffers():
            if name in model_state:  # buffers change during forward (BatchNorm statistics): copy them now
                model_state[name] = buffer.detach().clone()
        sharded_state = None
        if self.sharded:  # model and optimizer: each rank writes its shards (torch.distributed.checkpoint)
            sharded_state = {"model": model_state, "optimizer": optimizer_state}
            model_state, optimizer_state = {}, {}
        shared = {
            "model": model_state,
            "optimizer": optimizer_state,
            "scaler": self.scaler.state_dict(),
            "step": self.progress.step,
            "progress": dataclasses.asdict(self.progress),
            "config": self.cfg.to_dict(),
            "run_id": self.run_id,
            "torch_version": str(torch.__version__),
        }
        self.snapshots.save(
            self.progress.step, shared, {"rng": capture_rng()}, blocking=blocking, sharded_state=sharded_state
        )
        self.last_saved = self.progress.step

    def export(self, name: str) -> None:
        """Rank 0 writes the model's weights as a plain state dict to <export-dir>/<name>, atomically (under fsdp
        every rank takes part in gathering them: the same file, loadable into a plain build_model(...))."""
        state: dict[str, Any] = {}
        if self.sharded:
            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            state = cast(dict[str, Any], get_model_state_dict(self.model, options=options))
        elif self.env.is_main:
            state = self.model.state_dict()
        if not self.env.is_main:
            return
        os.makedirs(self.cfg.export_dir, exist_ok=True)
        weights = {key: value.detach().to("cpu", copy=True) for key, value in state.items()}
        write_atomic(os.path.join(self.cfg.export_dir, name), lambda handle: torch.save(weights, handle))

    def finish(self, stop: StopRequest) -> Summary:
        """Final snapshot, export and summary (also for a run that was already complete when it started)."""
        stop.close()
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
                {"job": joblock.current_job(), "step": self.progress.step, "signal": stop.signal},
            )
        already_complete = self.resumed_from >= self.total_steps
        summary = self._summary(already_complete=already_complete, stop_signal=stop.signal if stopped else 0)
        if not stopped:
            self.export("model.pt")  # final weights only from a run that finished
        self._write_summary(summary)  # a stopped run's too, with its stop_signal
        if summary.already_complete:
            log.info(
                "already complete: %d of %d steps, last loss %.4f%s; nothing to train (raise --max-steps or "
                "--epochs to train on, or pass --resume never to start over)",
                summary.steps,
                summary.total_steps,
                summary.last_loss,
                _val_text(summary),
            )
        elif not stopped:
            log.info(
                "done: %d rank(s), %d steps%s, loss %.4f -> %.4f%s",
                summary.world_size,
                summary.steps,
                f" (resumed at step {self.resumed_from})" if self.resumed_from >= 0 else "",
                summary.first_loss,
                summary.last_loss,
                _val_text(summary),
            )
        log.info(
            "snapshots: %s (newest %s); exported weights: %s",
            summary.snapshot_dir,
            summary.newest_snapshot,
            os.path.abspath(self.cfg.export_dir),
        )
        return summary

    def close(self) -> None:
        self.hang_watch.close()
        self.tracker.finish()
        self.snapshots.close()

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, kind, error, traceback) -> None:
        try:
            if kind is None or issubclass(kind, RunError):
                self.snapshots.wait()  # a save in flight holds a good state: let it commit (not after a failure,
                # where a lost rank's part may never come)
        finally:
            self.close()

    # -- helpers -----------------------------------------------------------------------------------------------

    def _wrap(self, model: nn.Module) -> nn.Module:
        """DDP (under torchrun), then torch.compile if asked; snapshots keep using the unwrapped `self.model`."""
        ddp_model = model
        if self.env.is_distributed and not self.sharded:
            device_ids = [self.env.device.index] if self.env.device.type == "cuda" else None
            ddp_model = DistributedDataParallel(model, device_ids=device_ids, gradient_as_bucket_view=True)
            if self.resumed_from >= 0:
                _settle_bucket_order(ddp_model, self.train_data, self.cfg.batch_size, self.env, self.optimizer)
        self.train_model = torch.compile(ddp_model) if self.cfg.compile else ddp_model
        return ddp_model

    def _shard(self, model: nn.Module) -> None:
        """FSDP2: fully_shard each unit model.py's shard_units(model) names (default: each direct child that has
        parameters), then the root. Mixed precision (--amp bf16) is FSDP's: bf16 compute, fp32 gradient reduction."""
        if not self.env.is_distributed:
            raise RunError(
                f"{flag('strategy')} fsdp shards the model across the ranks of a torchrun job: start it with torchrun "
                f"(one rank works: --nproc_per_node=1), or use {flag('strategy')} ddp"
            )
        if self.cfg.amp == "fp16":
            raise RunError(f"{flag('amp')} fp16 is not available with {flag('strategy')} fsdp: use {flag('amp')} bf16")
        dtype = AMP_DTYPES[self.cfg.amp]
        policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None)
        shard_units = getattr(user_model, "shard_units", None)
        if shard_units is not None:
            units = list(shard_units(model))
        else:
            units = [child for child in model.children() if any(True for _ in child.parameters())]
        for unit in units:
            fully_shard(unit, mp_policy=policy)
        fully_shard(model, mp_policy=policy)

    def _load_shards(self, folder: str) -> str:
        """Load a sharded snapshot's model and optimizer (resharded by torch.distributed.checkpoint when the
        number of ranks changed); return why it does not fit this model, or ''."""
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        state: dict[str, Any] = {"model": model_state, "optimizer": optimizer_state}
        try:
            dcp.load(state, checkpoint_id=folder)
            set_state_dict(
                self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
            )
        except (RuntimeError, ValueError, KeyError, dcp.api.CheckpointException) as exc:
            reason = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
            return f"{type(exc).__name__} loading it" + (f": {reason}" if reason else "")
        return ""

    def _restore(self, resumed: dict) -> dict | None:
        """Load a snapshot into the training objects; return this rank's random streams, or None to re-seed them."""
        folder = os.path.join(self.snapshots.directory, step_name(resumed["step"]))
        written_with = "fsdp" if resumed["sharded_dir"] else "ddp"
        if written_with != self.cfg.strategy:
            raise RunError(
                f"the snapshot {folder} was written with {flag('strategy')} {written_with}: resume with that "
                f"strategy, or start from scratch with {flag('resume')} never (what the folder holds is moved aside)"
            )
        if self.sharded:
            misfit = self._load_shards(resumed["sharded_dir"])
        else:
            misfit = _misfit(self.model.state_dict(), resumed["model"])
            try:
                if not misfit:
                    self.model.load_state_dict(resumed["model"])
                    self.optimizer.load_state_dict(resumed["optimizer"])
            except (RuntimeError, ValueError, KeyError) as exc:
                misfit = f"{type(exc).__name__} loading it"
        if misfit:
            raise RunError(
                f"the snapshot {folder} does not fit this model ({misfit}): it was written for another model. Start "
                f"from scratch with {flag('resume')} never (what the folder holds is moved aside), or pass another "
                f"{flag('snapshot_dir')}"
            )
        for group in self.optimizer.param_groups:  # from the command line, not the snapshot (see the docstring)
            group["weight_decay"] = self.cfg.weight_decay
        if self.scaler.is_enabled() and resumed["scaler"]:
            self.scaler.load_state_dict(resumed["scaler"])
        known = {spec.name for spec in dataclasses.fields(Progress)}
        self.progress = Progress(**{k: v for k, v in resumed["progress"].items() if k in known})
        self.resumed_from = self.progress.step
        changed = [
            f"{key} {value!r} -> {getattr(self.cfg, key)!r}"
            for key, value in resumed["config"].items()
            if hasattr(self.cfg, key) and value != getattr(self.cfg, key)
        ]
        if changed:
            log.info("settings changed since %s was written (applied from now on): %s", folder, ", ".join(changed))
        if resumed["world_size"] != self.env.world_size:
            self._warn_once(
                "the snapshot was written by %d rank(s) and this job has %d: model, optimizer and data position (by "
                "samples seen) are restored and every rank's random streams are re-seeded, so this run will not "
                "match an uninterrupted one bit for bit",
                resumed["world_size"],
                self.env.world_size,
            )
            return None
        return resumed["rank_state"]["rng"]

    def _warn_about_settings(self) -> None:
        cfg, steps = self.cfg, self.total_steps
        log.info(
            "%s from step %d of %d: %d rank(s) x batch %d x accum %d = %d samples/step, %d parameters",
            "resuming" if self.resumed_from >= 0 else "training",
            self.progress.step,
            steps,
            self.env.world_size,
            cfg.batch_size,
            cfg.grad_accum,
            self.global_batch,
            sum(p.numel() for p in self.model.parameters()),
        )
        if cfg.warmup_steps >= self.length.samples // self.length.step_samples:
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

    def _write_config(self) -> None:
        """The resolved settings, logged once and kept beside the snapshots (`--config` reads the file back)."""
        from .config import to_toml

        if self.env.is_main:
            text = to_toml(self.cfg)
            write_atomic(os.path.join(self.snapshots.directory, "config.toml"), lambda f: f.write(text.encode()))
            log.info("settings: %s", " ".join(f"{flag(k)}={v!r}" for k, v in self.cfg.to_dict().items()))

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

    def _synced_loss(self) -> float:
        """The mean training loss since the last log, over every rank; a NaN or infinite one stops the run."""
        loss = distributed.all_mean(self.env, self._loss_sum / max(1, self._loss_steps)).item()
        if not math.isfinite(loss):
            raise RunError(
                f"the training loss is not finite at step {self.progress.step}: the run diverged, so no snapshot is "
                f"saved over the good ones (newest: step {self.last_saved}). Lower {flag('lr')}, set "
                f"{flag('clip_grad')}, or check the data; then run the same command again to resume from that snapshot"
            )
        return loss

    def _summary(self, already_complete: bool, stop_signal: int) -> Summary:
        cfg, progress = self.cfg, self.progress
        return Summary(
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
            export_dir=os.path.abspath(cfg.export_dir),
            log_file=os.path.abspath(cfg.log_file.replace("{rank}", "0")) if cfg.log_file else "",
            metrics_file=os.path.abspath(cfg.metrics_file) if cfg.metrics_file else "",
            already_complete=already_complete,
            stop_signal=stop_signal,
        )

    def _write_summary(self, summary: Summary) -> None:
        if self.env.is_main:
            fields = {
                k: (v if not isinstance(v, float) or math.isfinite(v) else None)
                for k, v in dataclasses.asdict(summary).items()
            }
            text = json.dumps(fields, indent=1)
            os.makedirs(self.cfg.export_dir, exist_ok=True)
            write_atomic(os.path.join(self.cfg.export_dir, "summary.json"), lambda f: f.write(text.encode()))


def train(cfg: Config, env: DistEnv) -> Summary:
    """Train until --max-steps or --epochs; resume from the newest good snapshot in --snapshot-dir if there is one."""
    with (
        Trainer(cfg, env) as trainer,  # model, data, optimizer, snapshots: restored from the newest good snapshot
        StopRequest(env) as stop,
        progress_bar(env, trainer.total_steps, trainer.progress.step) as bar,
    ):
        progress, snapshots = trainer.progress, trainer.snapshots
        while progress.step < trainer.total_steps and not stop.stopped:
            trainer.forward_backward(next(trainer.batches))
            snapshots.wait_until_copied()  # the save in flight must copy the weights before the optimizer changes them
            trainer.optimizer_step()
            bar.update()

            if trainer.due(cfg.log_every):
                trainer.log_metrics()
            if trainer.due(cfg.eval_every):
                trainer.evaluate()
            if trainer.due(cfg.snapshot_every):
                trainer.save_snapshot()
            stop.agreed()  # every rank learns of a SIGTERM or Ctrl-C at the same step
        return trainer.finish(stop)


# ---------------------------------------------------------------------------------------------------------------


def _add_batch_sums(sums: dict, outputs: torch.Tensor, targets: torch.Tensor, val_metrics) -> None:
    """Add one validation batch's sample count, summed loss and summed metrics to `sums` (float64)."""
    count = len(targets)
    batch = {SAMPLES: count, "loss": user_model.loss_fn(outputs, targets).double() * count}
    if val_metrics is not None:
        metrics = val_metrics(outputs, targets)
        if "loss" in metrics:
            raise RunError("val_metrics in model.py returns 'loss': that name is val_loss's (from loss_fn); rename it")
        batch.update(metrics)
    for name, value in batch.items():
        value = torch.as_tensor(value, dtype=torch.float64, device=outputs.device).detach()
        sums[name] = sums[name] + value if name in sums else value


def _size(dataset: Dataset) -> int:
    """The length of a map-style dataset (torch's Dataset type does not declare __len__, though every one has it)."""
    return len(cast(Sized, dataset))


def _settle_bucket_order(
    ddp_model: DistributedDataParallel,
    dataset: Dataset,
    batch_size: int,
    env: DistEnv,
    optimizer: torch.optim.Optimizer,
) -> None:
    """Give a resumed job's fresh DDP the gradient buckets an uninterrupted job has by now.

    DDP rebuilds its buckets in the order gradients arrive during the first backward; until then it uses an
    initial layout. With 3 or more ranks gloo's ring all-reduce then sums in another order, so the first resumed
    step would differ in the last bits from the uninterrupted run's. One forward and backward in eval mode on a
    fixed batch, with the gradients thrown away and the random streams put back, sets the order without
    changing the weights, the optimizer, the buffers or the data position.
    """
    rng_state = capture_rng()
    ddp_model.eval()
    inputs, targets = default_collate([dataset[i] for i in range(min(batch_size, _size(dataset)))])
    outputs = ddp_model(inputs.to(env.device))
    user_model.loss_fn(outputs, targets.to(env.device)).backward()
    optimizer.zero_grad(set_to_none=True)
    ddp_model.train()
    restore_rng(rng_state)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def snapshot_bytes(model: nn.Module) -> int:
    """Rough size of one snapshot: weights plus AdamW's two moments."""
    return 3 * sum(p.numel() * p.element_size() for p in model.parameters()) + 2**20


def progress_bar(env: DistEnv, total: int, initial: int) -> "tqdm":
    """tqdm on rank 0 when the console is a terminal; disabled (drawing nothing) elsewhere."""
    from tqdm import tqdm

    return tqdm(
        total=total,
        initial=initial,
        unit="step",
        dynamic_ncols=True,
        leave=False,
        disable=not (env.is_main and sys.stderr.isatty()),
    )


def _misfit(expected: dict, found: dict) -> str:
    """How a snapshot's weights differ from the model's, in a few words; '' when they fit."""
    missing = [k for k in expected if k not in found]
    unexpected = [k for k in found if k not in expected]
    reshaped = [k for k in expected if k in found and getattr(found[k], "shape", None) != expected[k].shape]
    parts = [
        f"{len(names)} {what}, e.g. {names[0]!r}"
        for names, what in ((missing, "missing"), (unexpected, "unexpected"), (reshaped, "of another shape"))
        if names
    ]
    return "; ".join(parts)


def _loss_first(item: tuple[str, float]) -> tuple[bool, str]:
    return item[0] != "loss", item[0]


def _val_text(summary: Summary) -> str:
    return f", val_loss {summary.val_loss:.4f}" if math.isfinite(summary.val_loss) else ""
