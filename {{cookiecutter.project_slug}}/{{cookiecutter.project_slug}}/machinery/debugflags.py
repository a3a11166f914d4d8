"""The debugging flags of train.py (docs/debugging.md): --break-at-step, --profile-steps, --check-replicas and
--resume-from. `train()` calls `before_forward` once a step's batch is drawn and `after_step` once its optimizer step
is done; with every flag off both return at once, so the loop costs what it did without them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import sys
import tempfile
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from . import debug, distributed, logs
from .batches import Progress, to_device
from .distributed import DistEnv
from .settings import RunError, flag, step_range
from .snapshot import RUN_FILE, SnapshotError, list_steps, read_manifest, step_name

log = logging.getLogger(__name__)
INTEGER_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # a tensor's bits, per element
TOP_OPERATORS = 10  # rows of rank 0's table


def log_dir(log_file: str, rank: int) -> str:
    """The folder of --log-file (this rank's, when the name holds {rank}); `logs` when --log-file is ''."""
    return os.path.dirname(logs.rank_file(log_file, rank)) if log_file else "logs"


def replay_settings(cfg: Any, env: DistEnv) -> Any:
    """--resume-from STEP: the settings of a replay from the kept snapshot of STEP (`cfg` itself without it).

    Rank 0 copies that snapshot and the run id into `<snapshot-dir>.replay-<step>` (made anew each time; from a
    store, it downloads them, checked, into a folder under the system's temp dir), which becomes the run's snapshot
    folder, with `export/` in it; the run then resumes from it as from any snapshot, with the command line's
    settings. The metrics file is kept only when it is not the original run's, and wandb is off: the replay must
    not add to the original run's records."""
    step = cfg.resume_from
    if not step:
        return cfg
    if "://" in cfg.snapshot_dir:
        from .snapshot.store import Store

        store = Store(cfg.snapshot_dir, env.rank)
        original = store.url
        scratch = config_dir = os.path.join(
            tempfile.gettempdir(), f"{os.path.basename(store.local).rsplit('-rank', 1)[0]}.replay-{step}"
        )

        def pull() -> None:
            kept = store.steps()[0]
            shutil.rmtree(scratch, ignore_errors=True)
            problem = store.pull(step, scratch) if step in kept else f"{store.url} keeps no snapshot of step {step}"
            if problem:
                listed = ", ".join(map(str, sorted(kept))) or "none"
                raise RunError(
                    f"{flag('resume_from')} {step}: {problem}" + ("" if step in kept else f" (it keeps {listed})")
                )
            for name in (RUN_FILE, "config.toml"):
                with contextlib.suppress(FileNotFoundError):
                    store.download(name, os.path.join(scratch, name))

        distributed.decided_on_rank_0(env, pull, RunError)
    else:
        original = config_dir = os.path.abspath(cfg.snapshot_dir)
        scratch = f"{original}.replay-{step}"
        kept = list_steps(original)[0] if os.path.isdir(original) else []
        if step not in kept:
            raise RunError(
                f"{flag('resume_from')} {step}: {original} keeps no snapshot of step {step} "
                f"(it keeps {', '.join(map(str, sorted(kept))) or 'none'})"
            )
        if env.is_main:
            shutil.rmtree(scratch, ignore_errors=True)
            for copied in _snapshot_and_its_frozen(original, step):
                shutil.copytree(os.path.join(original, step_name(copied)), os.path.join(scratch, step_name(copied)))
            if os.path.exists(os.path.join(original, RUN_FILE)):
                shutil.copy2(os.path.join(original, RUN_FILE), scratch)
        distributed.barrier(env)  # the copy is complete before any rank looks for a snapshot in it
    metrics_file = cfg.metrics_file
    if metrics_file and os.path.abspath(metrics_file) == _original_metrics_file(config_dir):
        metrics_file = ""
    log.log(
        logging.INFO if env.is_main else logging.DEBUG,
        "replaying from the snapshot of step %d in %s: snapshots and export go to %s%s",
        step,
        original,
        scratch,
        f", metrics to {metrics_file}" if metrics_file else " (no metrics file: pass --metrics-file for one)",
    )
    export = os.path.join(scratch, "export")
    return dataclasses.replace(
        cfg, snapshot_dir=scratch, export_dir=export, metrics_file=metrics_file, wandb="disabled", resume="auto"
    )


def replay_log(cfg: Any) -> Any:
    """--resume-from STEP: the settings with a log file of the replay's own, `<name>.replay-<STEP><ext>` beside the
    run's, so the replay adds nothing to the run's log (`cfg` itself without it, or with --log-file '')."""
    if not cfg.resume_from or not cfg.log_file:
        return cfg
    stem, extension = os.path.splitext(cfg.log_file)
    return dataclasses.replace(cfg, log_file=f"{stem}.replay-{cfg.resume_from}{extension}")


def _snapshot_and_its_frozen(folder: str, step: int) -> list[int]:
    """The step, and the older one whose snapshot holds its frozen parameters, if another does (frozen.py)."""
    try:
        held_in = read_manifest(os.path.join(folder, step_name(step))).get("frozen_in", step)
    except SnapshotError:
        return [step]  # the replay's resume says what is wrong with it
    return sorted({step, held_in})


def _original_metrics_file(folder: str) -> str | None:
    """The metrics file of the run whose config.toml (report.write_config) is in `folder`."""
    try:
        with open(os.path.join(folder, "config.toml"), "rb") as handle:
            written = tomllib.load(handle).get("metrics_file")
    except (OSError, tomllib.TOMLDecodeError):
        return None
    return os.path.abspath(written) if written else None


def check_debugger(break_at: int, env: DistEnv) -> None:
    """--break-at-step with pdb to answer breakpoint() on a rank whose stdin is no terminal (a batch job, nohup, CI):
    refused at start-up, on every rank alike, instead of each rank's pdb reading an end of file at step N. Asked
    only where the run gets to step N: a relaunch that resumes past it needs no debugger."""
    hook = os.environ.get("PYTHONBREAKPOINT", "")
    debugpy_answers = os.environ.get("DEBUGPY_RUNNING") or (os.environ.get("DEBUG_RANK") and not hook)
    pdb_answers = hook in ("", "pdb.set_trace") and sys.breakpointhook is sys.__breakpointhook__
    chosen = debug.is_chosen(env, unset=True)  # every rank breaks, or those DEBUG_RANK names
    without_terminal = chosen and pdb_answers and not debugpy_answers and not (sys.stdin and sys.stdin.isatty())
    if not distributed.all_true(env, not without_terminal):
        raise RunError(
            f"{flag('break_at_step')} {break_at}: pdb would answer breakpoint() and needs a terminal, but "
            f"stdin is not one (a batch job, nohup, CI). Set DEBUG_RANK (a rank, or all) to attach a debugger at that "
            f"step instead, run from a terminal, or set PYTHONBREAKPOINT to another debugger"
        )


class DebugFlags:
    """--break-at-step, --profile-steps and --check-replicas for one run; use it as a context manager.
    `total_steps`: the step the run ends at; `progress.step`, the step it starts after (resumed, or 0)."""

    def __init__(self, cfg: Any, env: DistEnv, model: nn.Module, progress: Progress, total_steps: int):
        self.env, self.model, self.progress, self.total_steps = env, model, progress, total_steps
        self.break_at = cfg.break_at_step
        self.resume_from = cfg.resume_from
        self.check_every = cfg.check_replicas
        self.profile_range = step_range(cfg.profile_steps)
        self.profile_dir = os.path.join(log_dir(cfg.log_file, env.rank), "profile")
        self._profiler: torch.profiler.profile | None = None
        self._profiled = False  # once per run: a step taken again (one the job group dropped) is not traced twice
        self._buffers = BufferWatch(model) if self.check_every else None
        self._traced_from = 0  # the first step the profiler saw
        if self.break_at and not self._reachable("break_at_step", self.break_at, self.break_at):
            self.break_at = 0
        if self.break_at:
            check_debugger(self.break_at, env)
        if self.profile_range is not None and not self._reachable("profile_steps", *self.profile_range):
            self.profile_range = None

    def _reachable(self, name: str, low: int, high: int) -> bool:
        """Whether this run trains any of the steps low..high that the flag `name` asks for. Said at start-up when it
        does not: a RunError where no run of this command could (past the last step, or at or before --resume-from's
        step), else a warning."""
        asked = f"{flag(name)} {low if low == high else f'{low}:{high}'}"
        resumed_at, last = self.progress.step, self.total_steps
        if low > last:
            raise RunError(
                f"{asked}: the run ends at step {last}, so it never gets there: pick a step up to {last}, or raise "
                f"{flag('max_steps')}"
            )
        if high > resumed_at:
            return True
        if self.resume_from:
            raise RunError(
                f"{asked}: {flag('resume_from')} {self.resume_from} trains the steps after {self.resume_from} only: "
                f"pick a later step, or replay from an earlier kept snapshot"
            )
        logs.warn_from_rank_0(
            log,
            self.env.is_main,
            "%s: this run resumes after step %d, so it does not get there (replay an earlier step with %s)",
            asked,
            resumed_at,
            flag("resume_from"),
        )
        return False

    def before_forward(self, micro_batches: list) -> list:
        """The step's micro-batches, once drawn: start the profiler at step A, stop in the debugger at step N."""
        step = self.progress.step + 1  # the step about to run
        if self._buffers is not None and step % self.check_every == 0:
            self._buffers.start()
        if self.profile_range is not None and not self._profiled and self._profiler is None:
            start, end = self.profile_range
            if start <= step <= end:  # a run resumed inside A..B traces the steps left
                self._start_profiler()
        if step == self.break_at:
            micro_batches = [to_device(batch, self.env.device) for batch in micro_batches]
            if debug.is_chosen(self.env, unset=True):
                debug.listen_at_break(self.env, step)  # DEBUG_RANK without PYTHONBREAKPOINT: debugpy answers
                drawn = micro_batches[0]
                batch, held = _break_here(step, drawn, micro_batches, self.model)
                # What the frame holds is what the step trains on: a rebound `batch` replaces the first micro-batch
                # (of a rebound `micro_batches` too), on the device whatever the debugger put there.
                held = list(held) if batch is drawn else [batch, *list(held)[1:]]
                micro_batches = [to_device(batch, self.env.device) for batch in held]
            distributed.barrier(self.env)  # the ranks that did not stop wait here for those in the debugger
        return micro_batches

    def after_step(self) -> None:
        """After an optimizer step: compare the replicas every N steps; end the trace at step B."""
        step = self.progress.step
        if self._buffers is not None and step % self.check_every == 0:
            check_replicas(self.env, self.model, step, self._buffers.moved())
        if self._profiler is not None:
            self._profiler.step()
            if self.profile_range is not None and step >= self.profile_range[1]:
                self._stop_profiler(save=True)

    def __enter__(self) -> DebugFlags:
        return self

    def __exit__(self, kind, error, traceback) -> None:
        """A trace still running (the run ended or stopped inside A..B) is written as it is; a failed run's is not."""
        if self._profiler is not None:
            self._stop_profiler(save=kind is None)

    # -- the profiler ----------------------------------------------------------------------------------------

    def _start_profiler(self) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.env.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            torch.cuda.memory._record_memory_history(max_entries=100_000)
        self._profiler = torch.profiler.profile(activities=activities, record_shapes=True, profile_memory=True)
        self._profiler.start()
        self._traced_from = self.progress.step + 1

    def _stop_profiler(self, save: bool) -> None:
        profiler, self._profiler = self._profiler, None
        assert profiler is not None
        self._profiled = True
        profiler.stop()
        cuda = self.env.device.type == "cuda"
        if save:
            os.makedirs(self.profile_dir, exist_ok=True)
            trace = os.path.join(self.profile_dir, f"trace-rank{self.env.rank}.json")
            profiler.export_chrome_trace(trace)
            if cuda:
                torch.cuda.memory._dump_snapshot(os.path.join(self.profile_dir, f"memory-rank{self.env.rank}.pickle"))
            if self.env.is_main:
                sort_by = "self_device_time_total" if cuda else "self_cpu_time_total"
                table = profiler.key_averages().table(sort_by=sort_by, row_limit=TOP_OPERATORS)
                traced = f"{self._traced_from}-{self.progress.step}"  # a run that stopped early: the steps it took
                log.info("profile of steps %s (rank 0), top operators:\n%s", traced, table)
                log.info("traces (open in ui.perfetto.dev or chrome://tracing): %s", self.profile_dir)
        if cuda:
            torch.cuda.memory._record_memory_history(enabled=None)


def _break_here(step: int, batch: Any, micro_batches: list, model: nn.Module) -> tuple[Any, list]:
    """--break-at-step: `step` is about to run its forward on `batch` (the first of `micro_batches`, all on the
    device) through `model`. Look around, change what you like (rebind `batch` or `micro_batches` to train the step
    on something else), then continue: every rank trains on from here."""
    print(f"rank {os.environ.get('RANK', '0')}: breakpoint() before the forward of step {step}", file=sys.stderr)
    breakpoint()  # PYTHONBREAKPOINT picks the debugger: F5's debugpy, pdb, ... (0 skips it)
    # pdb and debugpy stop at the next line of this frame: there must be one, or they stop in the caller
    return batch, micro_batches


# -- --check-replicas ----------------------------------------------------------------------------------------


def checksums(model: nn.Module, buffers_only: bool = False) -> tuple[list[str], torch.Tensor]:
    """The tensors compared (parameters, then buffers, by name), and for each three int64 checksums of its bits
    (wrapping sums, exact whatever the order of the additions): of the bits, of their squares, and of each times its
    position, which tells replicas whose elements are the same but in another order (rows permuted) apart. Sharded
    DTensors (fsdp) are left out: each rank holds another shard."""
    names, sums = [], []
    named = list(model.named_buffers()) if buffers_only else [*model.named_parameters(), *model.named_buffers()]
    for name, each in named:
        tensor: torch.Tensor = each
        if isinstance(tensor, DTensor):
            if not all(placement.is_replicate() for placement in tensor.placements):
                continue
            tensor = tensor.to_local()
        flat = tensor.detach().contiguous().view(-1)
        if flat.dtype == torch.bool:
            flat = flat.view(torch.uint8)
        if flat.is_complex():
            flat = torch.view_as_real(flat).view(-1)
        bits = flat.view(INTEGER_OF_SIZE[flat.element_size()]).to(torch.int64)
        position = torch.arange(1, bits.numel() + 1, dtype=torch.int64, device=bits.device)
        names.append(name)
        sums.append(torch.stack([bits.sum(), (bits * bits).sum(), (bits * position).sum()]))
    if not sums:
        return names, torch.zeros(0, 3, dtype=torch.int64)
    return names, torch.stack(sums).cpu()


class BufferWatch:
    """Which buffers a check step's forward changes on this rank: their checksums before the step, and after each
    forward of it (a forward hook, there only for that step)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self._before: dict[str, torch.Tensor] = {}
        self._after: dict[str, torch.Tensor] = {}
        self._hook: Any = None

    def _sums(self) -> dict[str, torch.Tensor]:
        names, sums = checksums(self.model, buffers_only=True)
        return dict(zip(names, sums, strict=True))

    def start(self) -> None:
        self._before, self._after = self._sums(), {}
        if self._hook is None:
            self._hook = self.model.register_forward_hook(lambda *_: self._after.update(self._sums()))

    def moved(self) -> set[str]:
        """The buffers whose bits the step's forward changed on this rank (every buffer, if no forward was seen)."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        return {
            name
            for name, before in self._before.items()
            if name not in self._after or not torch.equal(before, self._after[name])
        }


def check_replicas(env: DistEnv, model: nn.Module, step: int, moved: set[str]) -> None:
    """Every rank's checksums in one all_gather; a RunError on every rank alike when any differs from rank 0's: every
    rank applies the same averaged gradients, so the replicas' bits must be equal. `moved`: the buffers this step's
    forward changed on this rank (a running statistic, BatchNorm's or one of your own): one that any rank's changed
    is not compared, since each rank updates it from its own batch and every rank trains with rank 0's, broadcast
    before each forward (DDP's broadcast_buffers, step.py under fsdp)."""
    if not env.is_distributed:
        return
    names, sums = checksums(model)
    local = torch.cat([sums, torch.tensor([[int(name in moved)] for name in names], dtype=torch.int64)], dim=1)
    gathered = [torch.empty_like(local) for _ in range(env.world_size)]
    dist.all_gather(gathered, local)
    table = torch.stack(gathered)  # (rank, tensor, three checksums and "moved")
    compared = table[:, :, 3].amax(dim=0) == 0  # (tensor): no rank's forward changed it
    differs = (table[:, :, :3] != table[0, :, :3]).any(dim=2) & compared  # (rank, tensor): unlike rank 0's
    if not bool(differs.any()):
        return
    first = int(differs.any(dim=0).nonzero()[0])
    others = [rank for rank in range(env.world_size) if bool(differs[rank, first])]
    raise RunError(
        f"{flag('check_replicas')}: after step {step}, {names[first]} on {distributed.ranks_text(others)} differs "
        f"from rank 0's: the replicas drifted apart (code that depends on the rank, or a tensor changed outside "
        f"forward and backward); find where with {flag('break_at_step')} or a smaller {flag('check_replicas')}"
    )
