"""One optimizer step: forward and backward over the step's micro-batches, then clip, step, schedule.

The loss of a step is what the user's step returns (hooks.UserCode.step):
- a mean per batch (loss_fn, or compute_loss returning a scalar): each micro-batch's mean / number of micro-batches,
  and DDP/FSDP average the gradients over the ranks, as torch does;
- a sum with a count (compute_loss returning {"loss": SUM, "count": N, ...}): the step's loss is the total sum over
  the total count of every micro-batch on every rank (a token-weighted mean, whatever the split over ranks). The
  sums are backpropagated as they are; once the step's counts are added up over the ranks, the gradients are scaled
  by world_size / total count (DDP and FSDP already divided by world_size).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from . import distributed
from .batches import Progress, to_device
from .distributed import DistEnv
from .hooks import UserCode
from .parallel import DistributedModel
from .partners import Partners
from .settings import RunError
from .state import all_finite

NONE = 2**62  # "no step": the first non-finite step when there is none


class Stepper:
    """Trains one optimizer step at a time and keeps the loss since the last log."""

    def __init__(
        self,
        parallel: DistributedModel,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        scaler: torch.amp.GradScaler,
        user: UserCode,
        cfg: Any,
        env: DistEnv,
        progress: Progress,
        partners: Partners | None = None,
    ):
        self.parallel, self.optimizer, self.scheduler, self.scaler = parallel, optimizer, scheduler, scaler
        self.user, self.cfg, self.env, self.progress = user, cfg, env, progress
        self.loss_sum = torch.zeros((), device=env.device)  # the steps' losses since the last log
        self.loss_steps = 0
        self.grad_norm = torch.zeros((), device=env.device)
        self.lr = optimizer.param_groups[0]["lr"]  # the learning rate of the last step (the first group's)
        self.partners = partners or Partners()  # the jobs this one trains with: their gradients are averaged in
        # The loss of the last forward_backward: this rank's own (the mean over every rank when token-weighted)
        self.step_loss = torch.zeros((), device=env.device)
        self.step_count: torch.Tensor | None = None  # compute_loss's count of the last step on this rank, if a dict
        # The first step whose loss (this rank's own) or gradient (the step's, over every rank) was not finite:
        # marked on the device at every step, without waiting for it, and read where the loop syncs anyway (log,
        # snapshot), which stop the run before a snapshot can hold what such a step made of the weights.
        self.first_bad_loss = torch.full((), NONE, dtype=torch.int64, device=env.device)
        self.first_bad_grad = torch.full((), NONE, dtype=torch.int64, device=env.device)

    def forward_backward(self, micro_batches: list) -> None:
        """Forward and backward over the micro-batches of one optimizer step; gradients sync on the last one."""
        parallel = self.parallel
        parallel.for_steps.train()
        if parallel.sharded:  # as DDP does at each forward: every rank trains with rank 0's buffers
            distributed.broadcast_buffers(self.env, parallel.model)
        micro_batches = [to_device(batch, self.env.device) for batch in micro_batches]
        with self.partners.skip_averaging():
            parallel.settle_bucket_order(micro_batches[0])  # a resumed ddp job, or one that trains with others, once
        step_loss = torch.zeros((), device=self.env.device)
        sums = torch.zeros(2, dtype=torch.float64, device=self.env.device)  # token-weighted: loss sum, count
        token_weighted = None
        for index, batch in enumerate(micro_batches):
            with parallel.sync_gradients(last=index == len(micro_batches) - 1):
                with parallel.autocast():
                    result = self.user.step(parallel.for_steps, batch)
                if token_weighted is not None and result.is_sum != token_weighted:
                    raise RunError("compute_loss in model.py returned a dict for some batches and a scalar for others")
                token_weighted = result.is_sum
                loss = result.loss if result.is_sum else result.loss / len(micro_batches)
                self.partners.before_backward(token_weighted=result.is_sum)  # a sum is averaged once it is scaled
                self.scaler.scale(loss).backward()
            if result.is_sum:
                sums += torch.stack([result.loss.detach().double(), result.count])
            else:
                step_loss += loss.detach()
        self.step_count = sums[1].clone() if token_weighted else None
        if token_weighted:
            self._mark(self.first_bad_loss, torch.isfinite(sums[0]))  # this rank's own, before the others' are added
            step_loss = self._token_weighted(sums).to(step_loss.dtype)
        else:
            self._mark(self.first_bad_loss, torch.isfinite(step_loss))
        self.step_loss = step_loss
        self.loss_sum += step_loss

    def _token_weighted(self, sums: torch.Tensor) -> torch.Tensor:
        """Scale the summed gradients to the mean over every rank's count; return the step's mean loss."""
        total_loss, total_count = distributed.all_sum(self.env, sums).tolist()
        if total_count <= 0:
            raise RunError(
                f"compute_loss in model.py returned a count of {total_count:g} over every rank at step "
                f"{self.progress.step + 1}: nothing to average the loss over"
            )
        factor = self.env.world_size / total_count  # DDP and FSDP averaged the gradients over the ranks already
        for parameter in self.parallel.model.parameters():
            if parameter.grad is not None:
                parameter.grad.mul_(factor)
        return torch.tensor(total_loss / total_count, device=self.env.device)

    def optimizer_step(self) -> bool:
        """Average the gradients with the jobs this one trains with, if any (False: they dropped the step, one failed
        during it); then clip, step, move the learning-rate schedule on, and count the step."""
        if not self.partners.average_and_commit(self.parallel.model):
            self.optimizer.zero_grad(set_to_none=True)
            self.loss_sum -= self.step_loss
            return False
        if self.cfg.clip_grad:
            self.scaler.unscale_(self.optimizer)
            norm = nn.utils.clip_grad_norm_(self.parallel.model.parameters(), self.cfg.clip_grad)
            self.grad_norm = norm.full_tensor() if isinstance(norm, DTensor) else norm  # fsdp: over every shard
            if not self.scaler.is_enabled():  # fp16's scaler skips the steps of non-finite gradients itself
                self._mark(self.first_bad_grad, torch.isfinite(self.grad_norm))
        elif not self.scaler.is_enabled():
            grads = [p.grad for p in self.parallel.model.parameters() if p.grad is not None]
            self._mark(self.first_bad_grad, all_finite(grads))
        self.lr = self.optimizer.param_groups[0]["lr"]
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()  # once per optimizer step: the learning rate of the next one
        self.progress.step += 1
        self.loss_steps += 1
        return True

    def _mark(self, first: torch.Tensor, finite: torch.Tensor) -> None:
        """Mark the step being trained in `first` unless `finite` (a bool tensor) holds, or a step is marked."""
        bad = ~finite.to(first.device) & (first == NONE)
        first.copy_(torch.where(bad, self.progress.step + 1, first))

    def first_nonfinite(self) -> tuple[int, list[int]] | None:
        """(the first step whose loss or gradient was not finite on any rank, the ranks whose own loss was not
        finite then: none when only the averaged gradient was), or None. Every rank calls it at the same step."""
        local = min(int(self.first_bad_loss), int(self.first_bad_grad))
        first, _ = distributed.all_min_max(self.env, local)
        if first == NONE:
            return None
        losses = distributed.all_gather_int(self.env, int(self.first_bad_loss))
        return first, [rank for rank, step in enumerate(losses) if step == first]

    def mean_loss(self) -> float:
        """The mean training loss since the last log, over every rank; a NaN or infinite one is an error."""
        loss = distributed.all_mean(self.env, self.loss_sum / max(1, self.loss_steps)).item()
        if not math.isfinite(loss):
            raise FloatingPointError(loss)
        return loss

    def reset_loss(self) -> None:
        self.loss_sum.zero_()
        self.loss_steps = 0
