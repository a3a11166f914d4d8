"""The training loop: DDP, sharded data that can resume mid-epoch, snapshots, graceful stop on SIGTERM."""

import contextlib
import copy
import dataclasses
import math
import os
import random
import signal
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

from . import distributed, logs, tracking
from .data import build_dataset
from .model import build_model
from .snapshot import Snapshots, capture_rng, restore_rng, step_name

log = logs.get_logger(__name__)

AMP_DTYPES = {"off": None, "bf16": torch.bfloat16, "fp16": torch.float16}
# Settings whose change on resume is worth a warning (the others, like log files, are free to change).
RESUME_SENSITIVE = ("seed", "batch_size", "grad_accum", "lr", "warmup_steps", "weight_decay", "amp", "width", "depth",
                    "dropout", "dataset_size", "max_steps", "epochs")


@dataclass
class Progress:
    step: int = 0  # optimizer steps done
    epoch: int = 0
    samples_in_epoch: int = 0  # samples of the current epoch consumed by all ranks together
    samples_seen: int = 0
    first_loss: float = math.nan  # loss of the first logged step, kept across restarts for the summary


@dataclass
class Summary:
    world_size: int
    steps: int
    resumed_from: int  # step the run resumed from; -1 for a fresh start
    first_loss: float
    last_loss: float
    snapshot_dir: str
    newest_snapshot: str
    log_file: str
    stop_signal: int = 0  # the signal that stopped the run early, 0 if it finished


class ResumableSampler(DistributedSampler):
    """A DistributedSampler that can start mid-epoch and yields whole optimizer steps only.

    An epoch's order is one permutation of the dataset (seeded with seed + epoch, as DistributedSampler does),
    and rank r takes every world_size-th index of it. After k optimizer steps the job has consumed exactly the
    first k * global_batch indices of that permutation, whatever the number of ranks, so a resumed job skips
    them at the index level, without loading them, and continues with the rest.
    """

    def __init__(self, dataset, env, seed, samples_per_rank_step):
        super().__init__(dataset, num_replicas=env.world_size, rank=env.rank, shuffle=True, seed=seed, drop_last=True)
        self.samples_per_rank_step = samples_per_rank_step
        self.start = 0

    def set_position(self, epoch, start):
        self.set_epoch(epoch)
        self.start = start

    def steps(self):
        """Whole optimizer steps left in this epoch."""
        return (len(self.dataset) - self.start) // (self.num_replicas * self.samples_per_rank_step)

    def __len__(self):
        return self.steps() * self.samples_per_rank_step

    def __iter__(self):
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(len(self.dataset), generator=generator)
        order = order[self.start:self.start + self.steps() * self.num_replicas * self.samples_per_rank_step]
        return iter(order[self.rank::self.num_replicas].tolist())


class StopRequest:
    """SIGTERM (what torchrun, SLURM and Kubernetes send before a kill) asks the job to stop at a step boundary.

    The handler only sets a flag. The ranks agree on when to stop with a one-number all_reduce started after
    each step and read after the next one, so its latency hides behind the step and all ranks stop together.
    """

    def __init__(self, env):
        self.env = env
        self.signal = 0  # the signal this rank received
        self.stopped = False  # set on every rank at the same step once the ranks agree to stop
        self._pending = None
        self._flag = torch.zeros(1, dtype=torch.int64)
        self._previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame):
        self.signal = signum

    def agreed(self):
        """True on every rank at the same step, once any rank got the signal."""
        if not self.env.is_distributed:
            self.stopped = bool(self.signal)
            return self.stopped
        if self._pending is not None:
            self._pending.wait()
            self.stopped = bool(self._flag.item())
            self.signal = self.signal or int(self._flag.item())
        self._flag.fill_(self.signal)
        self._pending = dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=distributed.control_group(),
                                        async_op=True)
        return self.stopped

    def close(self):
        if self._pending is not None:
            self._pending.wait()  # every rank started the same number of these: finish the last one everywhere
            self._pending = None
        signal.signal(signal.SIGTERM, self._previous)


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def warmup_cosine(warmup_steps, total_steps):
    """Learning-rate factor: linear warmup, then cosine decay to 10% of the peak."""

    def factor(step):
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def snapshot_bytes(model):
    """Rough size of one snapshot: weights plus AdamW's two moments."""
    return 3 * sum(p.numel() * p.element_size() for p in model.parameters()) + 2**20


def progress_bar(env, total, initial):
    """tqdm on rank 0 when the console is a terminal; a do-nothing stand-in otherwise."""
    if env.is_main and sys.stderr.isatty():
        from tqdm import tqdm

        return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, leave=False)
    return contextlib.nullcontext(_NoBar())


class _NoBar:
    def update(self, n=1):
        pass

    def set_postfix_str(self, text):
        pass


def train(cfg, env):
    """Train until --max-steps or --epochs; resume from the newest good snapshot if there is one."""
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank
    dataset = build_dataset(cfg)
    model = build_model(cfg, dataset).to(env.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)

    samples_per_rank_step = cfg.batch_size * cfg.grad_accum
    global_batch = env.world_size * samples_per_rank_step
    steps_per_epoch = len(dataset) // global_batch
    if steps_per_epoch == 0:
        raise ValueError(
            f"the dataset has {len(dataset)} samples, fewer than one optimizer step takes ({env.world_size} ranks x "
            f"--batch-size {cfg.batch_size} x --grad-accum {cfg.grad_accum} = {global_batch})"
        )
    total_steps = cfg.max_steps or cfg.epochs * steps_per_epoch
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(cfg.warmup_steps, total_steps))
    amp_dtype = AMP_DTYPES[cfg.amp]
    scaler = torch.amp.GradScaler(env.device.type, enabled=cfg.amp == "fp16" and env.device.type == "cuda")

    snapshots = Snapshots(cfg.snapshot_dir, env, keep=cfg.keep_snapshots,
                          commit_timeout=distributed.collective_timeout(cfg).total_seconds())
    run_id = snapshots.prepare(snapshot_bytes(model))
    progress, rng_state = Progress(), None
    resumed = snapshots.resume()
    if resumed is not None:
        rng_state = _restore(resumed, cfg, env, model, optimizer, scheduler, scaler)
        progress = Progress(**resumed["progress"])
    resumed_from = progress.step if resumed is not None else -1

    if env.is_distributed:
        device_ids = [env.device.index] if env.device.type == "cuda" else None
        ddp_model = DistributedDataParallel(model, device_ids=device_ids, gradient_as_bucket_view=True)
    else:
        ddp_model = model
    tracker = tracking.make_tracker(env, cfg.wandb, cfg.wandb_project, run_id, cfg.to_dict())

    sampler = ResumableSampler(dataset, env, cfg.seed, samples_per_rank_step)
    loader_generator = torch.Generator()  # explicit, so building an iterator never draws from the global RNG
    loader = DataLoader(
        dataset, batch_size=cfg.batch_size, sampler=sampler, drop_last=True, num_workers=cfg.num_workers,
        pin_memory=env.device.type == "cuda", persistent_workers=cfg.num_workers > 0, generator=loader_generator,
    )

    def snapshot_state():
        model_state = model.state_dict()
        for name, buffer in model.named_buffers():
            if name in model_state:  # buffers change during forward (BatchNorm statistics): copy them now
                model_state[name] = buffer.detach().clone()
        return {
            "model": model_state, "optimizer": optimizer.state_dict(), "scheduler": copy.deepcopy(scheduler.state_dict()),
            "scaler": scaler.state_dict(), "step": progress.step, "progress": dataclasses.asdict(progress),
            "config": cfg.to_dict(), "run_id": run_id, "torch_version": str(torch.__version__),
        }

    def save(blocking=False):
        snapshots.save(progress.step, snapshot_state(), {"rng": capture_rng()}, blocking=blocking)

    log.info(
        "%s from step %d of %d: %d rank(s) x batch %d x accum %d = %d samples/step, %d steps/epoch, %d parameters",
        "resuming" if resumed is not None else "training", progress.step, total_steps, env.world_size,
        cfg.batch_size, cfg.grad_accum, global_batch, steps_per_epoch, sum(p.numel() for p in model.parameters()),
    )
    stop = StopRequest(env)
    last_saved = progress.step if resumed is not None else None
    loss_sum, loss_steps, last_loss = torch.zeros((), device=env.device), 0, math.nan
    timer = time.perf_counter()
    # Restore the random streams last, right before the first step, so nothing in between can draw from them.
    if rng_state is not None:
        restore_rng(rng_state)
    else:  # a fresh start, or a resume with another number of ranks: new streams, distinct per rank and step
        seed_everything(cfg.seed + env.rank + 1_000_003 * progress.step)
    try:
        with progress_bar(env, total_steps, progress.step) as bar:
            while progress.step < total_steps and not stop.stopped:
                sampler.set_position(progress.epoch, progress.samples_in_epoch)
                loader_generator.manual_seed(cfg.seed * 1_000_003 + progress.epoch * 7_919 + env.rank)
                batches = iter(loader)
                for _ in range(sampler.steps()):
                    loss_sum += _train_step(ddp_model, batches, optimizer, scaler, snapshots, cfg, env, amp_dtype)
                    scheduler.step()
                    progress.step += 1
                    progress.samples_in_epoch += global_batch
                    progress.samples_seen += global_batch
                    loss_steps += 1
                    bar.update()
                    if progress.step in (1, total_steps) or progress.step % cfg.log_every == 0:
                        last_loss = distributed.all_mean(env, loss_sum / loss_steps).item()
                        if math.isnan(progress.first_loss):
                            progress.first_loss = last_loss
                        rate = loss_steps / (time.perf_counter() - timer)
                        lr = scheduler.get_last_lr()[0]
                        log.info("step %d/%d  epoch %d  loss %.4f  lr %.2e  %.1f steps/s",
                                 progress.step, total_steps, progress.epoch, last_loss, lr, rate)
                        tracker.log({"loss": last_loss, "lr": lr, "epoch": progress.epoch, "steps_per_s": rate},
                                    progress.step)
                        bar.set_postfix_str(f"loss {last_loss:.4f}")
                        loss_sum.zero_()
                        loss_steps, timer = 0, time.perf_counter()
                    if progress.step % cfg.snapshot_every == 0:
                        save()
                        last_saved = progress.step
                    if stop.agreed() or progress.step >= total_steps:
                        break
                else:
                    progress.epoch += 1
                    progress.samples_in_epoch = 0
        stop.close()
        if stop.stopped:
            log.warning("stopping at step %d of %d on signal %d: saving a snapshot; run the same command again to "
                        "resume", progress.step, total_steps, stop.signal)
        if last_saved != progress.step:
            save(blocking=True)
        snapshots.wait()
    finally:
        tracker.finish()

    summary = Summary(
        world_size=env.world_size, steps=progress.step, resumed_from=resumed_from, first_loss=progress.first_loss,
        last_loss=last_loss, snapshot_dir=snapshots.directory, newest_snapshot=step_name(progress.step),
        log_file=os.path.abspath(cfg.log_file.replace("{rank}", "0")) if cfg.log_file else "",
        stop_signal=stop.signal if stop.stopped else 0,
    )
    if not stop.stopped:
        log.info("done: %d rank(s), %d steps%s, loss %.4f -> %.4f", summary.world_size, summary.steps,
                 f" (resumed at step {resumed_from})" if resumed_from >= 0 else "", summary.first_loss, summary.last_loss)
    log.info("snapshots: %s (newest %s)%s", summary.snapshot_dir, summary.newest_snapshot,
             f"; log file: {summary.log_file}" if summary.log_file else "")
    return summary


def _train_step(model, batches, optimizer, scaler, snapshots, cfg, env, amp_dtype):
    """One optimizer step over --grad-accum micro-batches; returns the (unsynced) mean loss as a tensor."""
    total = torch.zeros((), device=env.device)
    for micro in range(cfg.grad_accum):
        inputs, labels = next(batches)
        inputs = inputs.to(env.device, non_blocking=True)
        labels = labels.to(env.device, non_blocking=True)
        last = micro == cfg.grad_accum - 1
        # Gradients are all-reduced on the last micro-step only.
        sync = contextlib.nullcontext() if last or not env.is_distributed else model.no_sync()
        with sync:
            with torch.autocast(env.device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                loss = F.cross_entropy(model(inputs), labels) / cfg.grad_accum
            scaler.scale(loss).backward()
        total += loss.detach()
    snapshots.fence()  # a snapshot in flight must have copied the weights before they change
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return total


def _restore(resumed, cfg, env, model, optimizer, scheduler, scaler):
    """Load a snapshot into the training objects; return this rank's random streams, or None to re-seed them."""
    model.load_state_dict(resumed["model"])
    optimizer.load_state_dict(resumed["optimizer"])
    scheduler.load_state_dict(resumed["scheduler"])
    if scaler.is_enabled() and resumed["scaler"]:
        scaler.load_state_dict(resumed["scaler"])
    changed = [f"{key} {resumed['config'].get(key)!r} -> {getattr(cfg, key)!r}" for key in RESUME_SENSITIVE
               if resumed["config"].get(key) != getattr(cfg, key)]
    if changed:
        log.warning("resuming with changed settings: %s", ", ".join(changed))
    if resumed["world_size"] != env.world_size:
        log.warning(
            "the snapshot was written by %d rank(s) and this job has %d: model, optimizer, schedule and data position "
            "(by samples seen) are restored and every rank's random streams are re-seeded, so this run will not "
            "match an uninterrupted one bit for bit",
            resumed["world_size"], env.world_size,
        )
        return None
    return resumed["rank_state"]["rng"]
