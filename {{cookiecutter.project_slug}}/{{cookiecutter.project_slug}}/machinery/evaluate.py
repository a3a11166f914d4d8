"""Evaluation: val_loss and val_<name> over every validation sample, each counted once across the ranks, the value
one process computes on the same weights. It runs in eval mode with rank 0's buffers on every rank, and puts the
random streams back afterwards, so evaluating changes nothing a bitwise resume depends on."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader

from . import distributed
from .batches import to_device
from .distributed import DistEnv
from .hooks import UserCode
from .outputs import ExportFolder
from .parallel import DistributedModel
from .settings import RunError
from .snapshot import capture_rng, restore_rng
from .tracking import MetricsLog

log = logging.getLogger(__name__)
COUNT = " count"  # the sums' count, kept beside them under a name no val_metrics key can take


@dataclass(eq=False)
class Validator:
    """Evaluation at every --eval-every step and the last: its results go to the metrics (and val_loss to the
    progress, for the summary); the best val_loss so far exports its weights as best.pt."""

    val_data: Any
    parallel: DistributedModel
    user: UserCode
    cfg: Any
    env: DistEnv
    metrics: MetricsLog
    exports: ExportFolder
    beat: Callable[[], None]  # marks progress (watchdog.py)

    def maybe_evaluate(self) -> None:
        """When due: evaluate, log, record; export best.pt at a new best val_loss. Nothing without validation data."""
        if not self.metrics.length.due(self.metrics.progress.step, self.cfg.eval_every):
            return
        started = time.perf_counter()
        results, count = evaluate(self.val_data, self.parallel, self.user, self.cfg, self.env, self.beat)
        if not results:
            return
        progress, seconds = self.metrics.progress, time.perf_counter() - started
        progress.val_loss = results["val_loss"]
        shown = "  ".join(f"{name} {value:.4f}" for name, value in results.items())
        log.info("eval at step %d: %s (%d samples, %.1f s)", progress.step, shown, count, seconds)
        self.metrics.add(results, seconds)
        if progress.val_loss < progress.best_val_loss:
            progress.best_val_loss, progress.best_step = progress.val_loss, progress.step
            self.exports.export(self.parallel, "best.pt")


def evaluate(
    val_data: Any, parallel: DistributedModel, user: UserCode, cfg: Any, env: DistEnv, beat: Callable[[], None]
) -> tuple[dict[str, float], int]:
    """val_loss and val_<name>, and the number of samples; ({}, 0) without validation data. Each rank takes every
    world_size-th sample and adds up the sums of the user's step; one all_reduce adds up sums and counts, and each
    result is a total sum over the total count (samples, or what compute_loss counts, e.g. tokens). `beat` marks
    progress after each batch (watchdog.py)."""
    size = len(val_data) if val_data is not None else 0
    if size == 0:
        return {}, 0
    rng_state = capture_rng()
    model = parallel.model
    distributed.broadcast_buffers(env, model)
    model.eval()
    loader = DataLoader(
        val_data,
        batch_size=cfg.batch_size,
        sampler=range(env.rank, size, env.world_size),
        num_workers=cfg.num_workers,
        generator=torch.Generator(),
        collate_fn=user.collate,
    )
    sums: dict[str, torch.Tensor] = {}
    with torch.no_grad(), parallel.autocast():
        for batch in loader:
            result = user.step(model, to_device(batch, env.device))
            for name, value in {COUNT: result.count, "loss": result.loss_sum(), **result.sums}.items():
                sums[name] = sums.get(name, 0) + torch.as_tensor(value, dtype=torch.float64, device=env.device).detach()
            beat()
        if parallel.sharded:  # each forward gathers parameters from every rank, so every rank runs as many
            most = math.ceil(math.ceil(size / env.world_size) / cfg.batch_size)
            spare = to_device(user.collate([val_data[0]]), env.device)
            for _ in range(most - len(loader)):
                user.step(model, spare)  # its result is not counted
    model.train()
    restore_rng(rng_state)
    # Every name any rank returned (a rank may meet a name the others never do), each summed over every rank
    names = sorted(set().union(*distributed.all_gather_object(env, sorted(sums))))
    local = torch.stack([sums.get(name, torch.zeros((), dtype=torch.float64, device=env.device)) for name in names])
    totals = dict(zip(names, distributed.all_sum(env, local).tolist(), strict=True))
    count = totals.pop(COUNT)
    if count <= 0:
        raise RunError(
            f"compute_loss in model.py returned a count of {count:g} over every validation batch of every rank: "
            "val_loss would divide by it; return what each batch's loss sums over (e.g. its tokens) as 'count'"
        )
    results = {"val_loss": totals.pop("loss") / count}
    results.update({f"val_{name}": total / count for name, total in sorted(totals.items())})
    return results, size
