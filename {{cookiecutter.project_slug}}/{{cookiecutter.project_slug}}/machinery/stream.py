"""Streams: training data that is an IterableDataset without len(), one optimizer step at a time, resumable.
Rank r of N takes items r, r+N, r+2N, ... unless the dataset gives each rank its own items already (`shards_itself`).
Each rank's place is counted in items and saved in its own part of the snapshot, so a resume continues at the exact
next item with any --batch-size or --grad-accum, and with as many ranks only (docs/recipes.md, "Streams")."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from typing import Any

import torch
from torch.utils.data import IterableDataset, get_worker_info

from .batches import Progress, loader
from .distributed import DistEnv
from .settings import RunError, flag
from .snapshot import OwnStreams


class StreamEnded(RuntimeError):
    """This rank's share of the stream ended before the run did (other ranks may still have items: it is this
    rank's error, logged with its rank)."""


def shards_itself(dataset: Any, env: DistEnv) -> bool:
    """True when `dataset` gives this rank its own items already: a Hugging Face stream split with
    `split_dataset_by_node` (after .map(), .shuffle() too: the split travels with it), or a dataset with a true
    `shards_itself` attribute. A stream split for another rank or number of ranks than this job's is an error."""
    split = getattr(dataset, "_distributed", None)  # datasets.distributed.split_dataset_by_node's DistributedConfig
    if split is not None and hasattr(split, "rank") and hasattr(split, "world_size"):
        if (split.rank, split.world_size) != (env.rank, env.world_size):
            raise RunError(
                f"the training stream was split with split_dataset_by_node(rank={split.rank}, "
                f"world_size={split.world_size}) on rank {env.rank} of {env.world_size}: pass the job's own rank and "
                "world size (cfg has none: read them with torch.distributed.get_rank() and get_world_size())"
            )
        return True
    return bool(getattr(dataset, "shards_itself", False))


def exact_own_state(dataset: Any) -> bool:
    """Whether the dataset's state_dict() marks its place exactly (a Hugging Face stream with a shuffle buffer:
    not, the buffer is dropped)."""
    if not callable(getattr(dataset, "state_dict", None)):
        return False
    pending, seen = [getattr(dataset, "_ex_iterable", None)], 0  # Hugging Face's chain of iterables
    while pending and seen < 1000:
        node = pending.pop()
        seen += 1
        if node is None:
            continue
        if "Shuffled" in type(node).__name__:  # BufferShuffledExamplesIterable
            return False
        pending += [getattr(node, "ex_iterable", None), *getattr(node, "ex_iterables", ())]
    return True


class RankShare(IterableDataset):
    """This rank's items of a stream, from its `skip`-th item on, as whole batches; a worker takes every W-th
    batch, so with the loader's round-robin over workers the batches come in the same order whatever --num-workers."""

    def __init__(self, dataset: IterableDataset, env: DistEnv, batch_size: int, skip: int, own_split: bool = False):
        self.dataset, self.batch_size, self.skip = dataset, batch_size, skip
        self.rank, self.world_size = (0, 1) if own_split else (env.rank, env.world_size)

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        mine = itertools.islice(self.dataset, self.rank, None, self.world_size)
        for position, item in enumerate(itertools.islice(mine, self.skip, None)):  # among the items still to train
            if (position // self.batch_size) % workers == worker:
                yield item


class StreamBatches:
    """`next(batches)` is the step's list of micro-batches from this rank's share of the stream."""

    def __init__(self, dataset: IterableDataset, cfg: Any, env: DistEnv, progress: Progress, collate: Callable | None):
        self.dataset, self.cfg, self.env, self.progress, self.collate = dataset, cfg, env, progress, collate
        self.global_batch = env.world_size * cfg.batch_size * cfg.grad_accum
        self.consumed = 0  # items this rank has trained on
        self.own_split = shards_itself(dataset, env)
        # The dataset's own state marks this rank's place only if it gives this rank all it yields (it shards itself,
        # or there is one rank), is read in this process, and marks it exactly; else a resume skips, item by item, what
        # the rank consumed.
        self.own_state = exact_own_state(dataset) and cfg.num_workers == 0 and (self.own_split or env.world_size == 1)
        self.generator = torch.Generator()  # the loader's (see batches.loader)
        # Random numbers the stream draws as it is read (a random crop) come from streams of its own, not from the
        # process's, which the model draws from and a resume restores: skipping items would draw from those. Workers
        # have theirs already, seeded alike at every start.
        self.streams = OwnStreams(cfg.seed * 1_000_003 + env.rank + 1) if cfg.num_workers == 0 else nullcontext()
        self._iterator: Iterator[Any] | None = None

    def __iter__(self) -> StreamBatches:
        return self

    def __next__(self) -> list:
        with self.streams:
            if self._iterator is None:
                skip = 0 if self.own_state else self.consumed  # the dataset's own state starts after what was consumed
                share = RankShare(self.dataset, self.env, self.cfg.batch_size, skip, self.own_split)
                self.generator.manual_seed(self.cfg.seed * 1_000_003 + self.env.rank)
                self._iterator = iter(loader(share, self.cfg, self.env, self.collate, self.generator))
            micro_batches = list(itertools.islice(self._iterator, self.cfg.grad_accum))
        self.consumed += len(micro_batches) * self.cfg.batch_size
        if len(micro_batches) < self.cfg.grad_accum:
            raise StreamEnded(
                f"the training stream ended on rank {self.env.rank} after {self.consumed} items, before "
                f"{flag('max_steps')} was reached: lower it, or make the stream longer (or endless)"
            )
        self.progress.samples_in_epoch += self.global_batch
        self.progress.samples_seen += self.global_batch
        return micro_batches

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"consumed_items": self.consumed}
        if self.own_state:
            state["dataset"] = self.dataset.state_dict()  # type: ignore[attr-defined]
        if isinstance(self.streams, OwnStreams) and self.streams.state is not None:
            state["rng"] = self.streams.state
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "consumed_items" in state:
            self.consumed = int(state["consumed_items"])
        else:  # written before the place was counted in items: batches of the size the run had then
            self.consumed = int(state["consumed_batches"]) * int(state.get("batch_size", self.cfg.batch_size))
        if self.own_state:
            if "dataset" not in state:
                raise RunError(
                    "the snapshot holds no state of the stream itself (it was written with another --num-workers): "
                    "resume with the same --num-workers"
                )
            self.dataset.load_state_dict(state["dataset"])  # type: ignore[attr-defined]
        if isinstance(self.streams, OwnStreams):
            # Going on from the dataset's own state, the stream goes on with its streams as they were; skipping what
            # was consumed, it draws them anew from their seed, reaching that same state.
            self.streams.state = state.get("rng") if self.own_state else None
        self._iterator = None
