"""Frozen parameters (requires_grad=False: a peft LoRA model's base) are written once per run, not in every snapshot:
later snapshots name the step whose snapshot holds them ("frozen_in" in their manifest). Before each save a checksum
finds one that changed anyway; that snapshot then holds the whole model again (docs/fault-tolerance.md)."""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from . import distributed
from .distributed import DistEnv
from .settings import cut_short

log = logging.getLogger(__name__)

PRIME = 2**31 - 1  # the checksum is a sum modulo this prime of each word of a tensor times a weight of its place
CHUNK = 1 << 22  # words per pass: bounds the int64 temporaries, and keeps each pass's sum below 2**63
WORD = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int32}  # element size -> the word it is read in
MASK = {torch.uint8: 0xFF, torch.int16: 0xFFFF, torch.int32: 0xFFFFFFFF}


def checksum(tensor: torch.Tensor) -> torch.Tensor:
    """A 0-dim int64 tensor on the tensor's device (no wait for it): a checksum of its bits, this rank's shard for a
    DTensor. Any change to one element changes it; so does moving values to other places (each place has its own
    weight). Computed on the device, far faster than copying to the host for a sha256."""
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    flat = local.detach().contiguous().reshape(-1)
    total = torch.zeros((), dtype=torch.int64, device=flat.device)
    if flat.numel() == 0:
        return total
    words = flat.view(WORD[flat.element_size()])
    for start in range(0, words.numel(), CHUNK):
        part = words[start : start + CHUNK]
        values = (part.to(torch.int64) & MASK[part.dtype]) % PRIME
        places = torch.arange(start, start + part.numel(), dtype=torch.int64, device=part.device) % PRIME
        weights = (places * 48271 + 11) % PRIME + 1  # never 0: every place counts
        total = (total + ((values + 1) * weights % PRIME).sum()) % PRIME
    return total


class FrozenWeights:
    """The model's frozen parameters: their names (state_dict keys), the step whose snapshot holds them as they are,
    and their checksums then. Every rank holds one; under fsdp each checks its own shards."""

    def __init__(self, model: nn.Module, env: DistEnv, sharded: bool):
        self.model, self.env, self.sharded = model, env, sharded
        self.names = {name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
        self._ordered = sorted(self.names)  # the order of the checksums
        self.held_in: int | None = None  # the step whose snapshot holds them as they are now
        self._checksums: torch.Tensor | None = None

    def held_by(self, step: int) -> int | None:
        """Before the save of `step`: the step whose snapshot holds the frozen parameters as they are now, `step`
        itself when this snapshot must hold them (the first save, or they changed: said in one line); None when the
        model has none. Every rank calls it (under fsdp it is a collective)."""
        if not self.names or not (self.sharded or self.env.is_main):  # under ddp only rank 0 writes the model
            return None
        current = self._checksum_all()
        if self.held_in is not None and self._checksums is not None:
            changed = (current != self._checksums).nonzero().flatten().tolist()
            if distributed.all_true(self.env, not changed) if self.sharded else not changed:
                return self.held_in
            self._say_changed(changed, step)
        self.held_in, self._checksums = step, current
        return step

    def loaded(self, held_in: int | None) -> None:
        """After a resume: the frozen parameters as loaded are held by the snapshot of step `held_in` (None: by no
        single snapshot, so the next save writes them)."""
        if self.names and (self.sharded or self.env.is_main):
            self.held_in, self._checksums = held_in, self._checksum_all()

    def _checksum_all(self) -> torch.Tensor:
        state = dict(self.model.named_parameters(remove_duplicate=False))
        return torch.stack([checksum(state[name]) for name in self._ordered])

    def _say_changed(self, changed: list[int], step: int) -> None:
        names = [self._ordered[index] for index in changed]
        if self.sharded:  # each rank sees its own shards change
            names = sorted({name for found in distributed.all_gather_object(self.env, names) for name in found})
        if self.env.is_main:
            log.warning(
                "%d frozen parameter(s) changed since the snapshot of step %s saved them, although they do not train "
                "(requires_grad=False): %s. The snapshot of step %d holds the whole model again",
                len(names),
                self.held_in,
                cut_short(names, 3),
                step,
            )
