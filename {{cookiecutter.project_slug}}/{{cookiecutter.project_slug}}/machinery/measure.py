"""What a run's steps cost: throughput, peak memory and MFU for each logged step; where each rank's step time goes,
and which rank holds the others up, for the summary.

The loop marks the end of each part of a step (`done("data")`, `done("compute")`, ...): the time since the last
mark is that part's. The parts:
- data: waiting for the step's batches;
- compute: forward and backward, less `wait`;
- optimizer: clip, step, schedule;
- wait: for the other ranks. Under ddp on CPU, the time backward spends after this rank's last gradient was
  accumulated (the gradient all-reduce finishing, mostly waiting for a slower rank); on GPUs and under fsdp that
  time stays in `compute`. On every device, the time the logged step's all-gather takes to return;
- snapshot: the loop's stalls for snapshots (waiting for a copy in flight, starting a save).
Logging and evaluation are in no part. On GPUs the parts are timed with CUDA events, the device's own timeline, so
kernels launched in one part and run later are not counted where they were launched.

Cost: a clock read per mark (and a CUDA event on GPUs), one hook call per parameter at backward (ddp on CPU), and
one all-gather of two numbers per LOGGED step; the per-rank totals are gathered once, at the end.
"""

from __future__ import annotations

import contextlib
import logging
import re
import statistics
import time
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from . import distributed
from .distributed import DistEnv
from .optim import optimizers_of
from .step import Stepper

log = logging.getLogger(__name__)

PARTS = ("data", "compute", "optimizer", "wait", "snapshot")
STRAGGLER_MARGIN = 0.10  # a rank this much slower than the median rank (wait left out) is named
MIB = 2**20
# Dense peak TFLOP/s by device name (vendors' figures, no sparsity), for --amp bf16, fp16 and off (fp32, no TF32).
# The first name found in torch.cuda.get_device_name() wins: the specific names come first.
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H100 PCIe": {"bf16": 756.0, "fp16": 756.0, "fp32": 51.2},
    "H100 NVL": {"bf16": 835.0, "fp16": 835.0, "fp32": 60.0},
    "H100": {"bf16": 989.4, "fp16": 989.4, "fp32": 66.9},
    "H200": {"bf16": 989.4, "fp16": 989.4, "fp32": 66.9},
    "A100": {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5},
    "A10G": {"bf16": 70.0, "fp16": 70.0, "fp32": 31.2},
    "L4": {"bf16": 121.0, "fp16": 121.0, "fp32": 30.3},
    "V100": {"fp16": 125.0, "fp32": 15.7},
    "RTX 4090": {"bf16": 165.2, "fp16": 165.2, "fp32": 82.6},
}


def peak_flops(device_name: str, amp: str) -> float | None:
    """The device's dense peak FLOP/s at the run's precision (`--amp`), or None where it is not in the table."""
    precision = "fp32" if amp == "off" else amp
    for name, peaks in PEAK_TFLOPS.items():
        if name in device_name:
            tflops = peaks.get(precision)
            return tflops * 1e12 if tflops is not None else None
    return None


def batch_tokens(batch: Any) -> torch.Tensor | int | None:
    """The tokens a batch tells: a dict's `attention_mask` summed (padding left out), else its `input_ids`' count;
    None for other batches. A tensor stays where it is, unread: adding it up costs no device sync."""
    if isinstance(batch, Mapping):
        mask, ids = batch.get("attention_mask"), batch.get("input_ids")
        if isinstance(mask, torch.Tensor):
            return mask.sum()
        if isinstance(ids, torch.Tensor):
            return ids.numel()
    return None


def straggler(step_times: list[dict[str, float]], margin: float = STRAGGLER_MARGIN) -> dict | None:
    """The rank whose step time without `wait` is at least `margin` above the median rank's (the lower middle one
    for an even count, so two ranks compare with the faster), with the part it spends most over that part's median;
    None when no rank is that slow."""
    busy_parts = [part for part in PARTS if part != "wait"]
    busy = [sum(times[part] for part in busy_parts) for times in step_times]
    if len(busy) < 2:
        return None
    median = statistics.median_low(busy)
    rank = max(range(len(busy)), key=busy.__getitem__)
    if median <= 0 or busy[rank] < (1 + margin) * median:
        return None
    medians = {part: statistics.median_low(times[part] for times in step_times) for part in busy_parts}
    part = max(busy_parts, key=lambda name: step_times[rank][name] - medians[name])
    return {"rank": rank, "part": part, "seconds": round(busy[rank], 4), "median_seconds": round(median, 4)}


def size_text(size: int) -> str:
    """A number of bytes for people: 1.5 KiB, 12.3 MiB, 2.0 GiB."""
    if size < 1024:
        return f"{size} B"
    value = size / 1024
    for unit in ("KiB", "MiB"):
        if value < 1024:
            return f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"


def state_bytes(tensors: Iterator[torch.Tensor]) -> int:
    """Bytes of tensors as this rank holds them: a DTensor's local shard."""
    total = 0
    for tensor in tensors:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        total += local.numel() * local.element_size()
    return total


class _HostMemory:
    """The process's peak resident memory (VmHWM), reset per interval by writing 5 to /proc/self/clear_refs where
    the kernel allows it; elsewhere the peak since the process started (getrusage where there is no /proc)."""

    def __init__(self) -> None:
        self.resets = self._reset()
        if not self.resets:
            log.debug("peak memory on CPU: the peak since the process started (VmHWM cannot be reset here)")

    def peak_mib(self) -> float:
        try:
            with open("/proc/self/status", encoding="ascii") as status:
                found = re.search(r"^VmHWM:\s+(\d+) kB", status.read(), re.M)
        except OSError:
            found = None
        if found:
            return int(found.group(1)) / 1024
        import resource  # no /proc: the peak since start, in KiB on Linux, bytes on macOS

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak / MIB if peak > 2**32 else peak / 1024

    def reset(self) -> None:
        if self.resets:
            self.resets = self._reset()

    @staticmethod
    def _reset() -> bool:
        try:
            with open("/proc/self/clear_refs", "w", encoding="ascii") as clear:
                clear.write("5")
        except OSError:
            return False
        return True


class _GradientClock:
    """When this rank's last gradient was accumulated. The parameters' hooks hold it, and nothing of the run: a
    hook that held the run's parts would make a cycle that keeps the model, and so its process group, alive after
    the run (processes exit without a last garbage collection)."""

    def __init__(self) -> None:
        self.last = 0.0

    def accumulated(self, parameter: torch.Tensor) -> None:
        self.last = time.perf_counter()


class Measure:
    """Times the parts of each step on this rank, counts its tokens, and reads its peak memory; `interval()` at a
    logged step turns them into metrics over every rank, `summary()` at the end into each rank's split."""

    def __init__(self, cfg: Any, env: DistEnv, stepper: Stepper):
        self.env, self.stepper = env, stepper
        self.model: nn.Module = stepper.parallel.model
        model, sharded = self.model, stepper.parallel.sharded
        self.cuda = env.device.type == "cuda"
        self.totals = dict.fromkeys(PARTS, 0.0)  # this rank's seconds per part, over the steps of this process
        self.steps = 0
        self._last = time.perf_counter()
        self._tokens: torch.Tensor | int | None = None  # since the last log (None: the batches tell none)
        self._step_tokens: torch.Tensor | int | None = None
        self._host_memory = None if self.cuda else _HostMemory()
        self._first_step = True
        self._state_bytes_due = False  # the first step is done: the memory each rank holds is to be said
        self._grad_bytes = 0
        # GPUs: (part, start event, end event) since the last read, read once the device is synced
        self._events: list[tuple[str, Any, Any]] = []
        self._last_event = self._event()
        self._parameters = sum(p.numel() for p in model.parameters())
        self._peak = peak_flops(torch.cuda.get_device_name(env.device), cfg.amp) if self.cuda else None
        if self.cuda and self._peak is None and env.is_main:
            log.info("no mfu: the peak FLOP/s of %s is not known", torch.cuda.get_device_name(env.device))
        self._flops_per_step = 0.0  # FLOPs one rank's step takes, counted at the first step (batches without tokens)
        # (not through torch.compile's graphs: a compiled model's mfu needs batches that tell their tokens)
        self._count_flops = self._peak is not None and not getattr(cfg, "compile", False)
        # Under ddp on CPU, backward's time after this rank's last gradient is the wait for the gradient sync
        self._gradients = _GradientClock()
        if env.is_distributed and not sharded and not self.cuda:
            for parameter in model.parameters():
                if parameter.requires_grad:
                    parameter.register_post_accumulate_grad_hook(self._gradients.accumulated)

    def _event(self) -> Any:
        if not self.cuda:
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    # -- the loop's marks ----------------------------------------------------------------------------------------

    def done(self, part: str | None, micro_batches: list | None = None) -> None:
        """The time since the last mark was `part`'s (None: no part's, e.g. logging and evaluation). With
        "compute", `micro_batches` are the step's: their tokens are counted."""
        now = time.perf_counter()
        seconds, self._last = now - self._last, now
        if part == "compute":
            self._step_tokens = self._tokens_of(micro_batches or [])
            if self._gradients.last > now - seconds:  # the gradients of this step: the rest of backward was the sync
                waited = now - self._gradients.last
                self.totals["wait"] += waited
                seconds -= waited
            if self._first_step:
                self._grad_bytes = state_bytes(p.grad for p in self.model.parameters() if p.grad is not None)
        if part == "optimizer":
            self.steps += 1
            if self._step_tokens is not None:
                self._tokens = self._step_tokens if self._tokens is None else self._tokens + self._step_tokens
            if self._first_step:
                self._first_step = False
                self._state_bytes_due = True  # said at the next mark of no part's: after the progress bar moved
        elif part is None and self._state_bytes_due:
            self._state_bytes_due = False
            self._log_state_bytes()
        if self.cuda:
            event = self._event()
            if part is not None:
                self._events.append((part, self._last_event, event))
            self._last_event = event
        elif part is not None:
            self.totals[part] += seconds

    def begin_step(self) -> None:
        """The start of a step: what came since the last mark is no part's."""
        self.done(None)

    def _tokens_of(self, micro_batches: list) -> torch.Tensor | int | None:
        """The step's tokens on this rank: compute_loss's count (what its sum runs over) where it returns one, else
        what the batches tell (batch_tokens), else None."""
        if self.stepper.step_count is not None:
            return self.stepper.step_count
        total: torch.Tensor | int = 0
        for batch in micro_batches:
            tokens = batch_tokens(batch)
            if tokens is None:
                return None
            total = total + tokens
        return total if micro_batches else None

    @contextlib.contextmanager
    def counting_flops(self) -> Iterator[None]:
        """Around forward and backward: at the first step on a GPU with a known peak, the FLOPs they take (the mfu of
        batches without tokens)."""
        if not (self._first_step and self._count_flops):
            yield
            return
        from torch.utils.flop_counter import FlopCounterMode

        with FlopCounterMode(display=False) as counter:
            yield
        self._flops_per_step = float(counter.get_total_flops())

    # -- a logged step -------------------------------------------------------------------------------------------

    def interval(self, seconds: float, steps: int) -> dict[str, float | int]:
        """Metrics of the `steps` steps since the last log, which took `seconds`: tokens_per_s (over every rank,
        where the batches tell their tokens), peak_memory_mib and peak_memory_rank (the largest rank's), mfu (GPUs
        whose peak is known). Every rank calls it at the same step: one all-gather."""
        self._read_events()
        peak = self._peak_mib()
        tokens = -1.0 if self._tokens is None else float(self._tokens)
        started = time.perf_counter()
        gathered = self._all_gather(torch.tensor([peak, tokens], dtype=torch.float64))
        self.totals["wait"] += time.perf_counter() - started
        self._last += time.perf_counter() - started  # counted as wait: not the next part's too
        self._tokens = None
        self._reset_peak()
        peaks = gathered[:, 0]
        metrics: dict[str, float | int] = {
            "peak_memory_mib": round(float(peaks.max()), 1),
            "peak_memory_rank": int(peaks.argmax()),
        }
        per_rank_flops = self._flops_per_step * steps
        if bool((gathered[:, 1] >= 0).all()):
            total_tokens = float(gathered[:, 1].sum())
            metrics["tokens_per_s"] = total_tokens / seconds
            per_rank_flops = 6 * self._parameters * total_tokens / self.env.world_size
        if self._peak is not None and per_rank_flops > 0:
            metrics["mfu"] = per_rank_flops / seconds / self._peak
        return metrics

    def _all_gather(self, values: torch.Tensor) -> torch.Tensor:
        """Every rank's `values` (a CPU tensor, through gloo also under nccl), one row per rank."""
        if not self.env.is_distributed:
            return values.unsqueeze(0)
        rows = [torch.empty_like(values) for _ in range(self.env.world_size)]
        torch.distributed.all_gather(rows, values)
        return torch.stack(rows)

    def _peak_mib(self) -> float:
        if self._host_memory is not None:
            return self._host_memory.peak_mib()
        return torch.cuda.max_memory_allocated(self.env.device) / MIB

    def _reset_peak(self) -> None:
        if self._host_memory is not None:
            self._host_memory.reset()
        else:
            torch.cuda.reset_peak_memory_stats(self.env.device)

    def _read_events(self) -> None:
        """GPUs: the parts' times since the last read, from their events (the device synced first)."""
        if not self._events:
            return
        torch.cuda.synchronize(self.env.device)
        for part, start, end in self._events:
            self.totals[part] += start.elapsed_time(end) / 1000
        self._events.clear()

    def _log_state_bytes(self) -> None:
        """Once, after the first step (when the optimizer's state exists): each rank's bytes of parameters,
        gradients and optimizer state as it holds them (under fsdp, its shards)."""
        optimizers = optimizers_of(self.stepper.optimizer)
        optimizer_state = state_bytes(
            value
            for optimizer in optimizers
            for state in optimizer.state.values()
            for value in state.values()
            if isinstance(value, torch.Tensor)
        )
        mine = (state_bytes(iter(self.model.parameters())), self._grad_bytes, optimizer_state)
        every = distributed.all_gather_object(self.env, mine)
        if not self.env.is_main:
            return
        text = lambda sizes: " / ".join(size_text(size) for size in sizes)  # noqa: E731
        if len(set(every)) == 1:
            held = f"every rank {text(every[0])}"
        else:
            held = ", ".join(f"rank {rank} {text(sizes)}" for rank, sizes in enumerate(every))
        log.info("memory held (parameters / gradients / optimizer state, as sharded): %s", held)

    # -- the run's end -------------------------------------------------------------------------------------------

    def summary(self) -> tuple[list[dict[str, float]], dict | None]:
        """(each rank's seconds per part and its steps, in rank order; the straggler or None). Every rank calls it
        at the end: one all-gather."""
        self._read_events()
        mine = {**{part: round(seconds, 4) for part, seconds in self.totals.items()}, "steps": self.steps}
        every = distributed.all_gather_object(self.env, mine)
        return every, straggler(every)
