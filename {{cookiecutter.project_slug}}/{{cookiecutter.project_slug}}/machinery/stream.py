"""Streams: training data that is an IterableDataset without len(), one optimizer step at a time, resumable.

Each rank trains on its own share: rank r of N takes items r, r+N, r+2N, ... of the stream. A dataset that already
gives each rank its own items says so, and then every item it yields on a rank is that rank's:
- a Hugging Face `datasets` stream split with `datasets.distributed.split_dataset_by_node(ds, rank, world_size)` is
  recognised as it is, also after `.map()`, `.shuffle()` or `.with_format()` (its split travels with it);
- any other dataset sets a true attribute `shards_itself` (on the object the trainer gets: set it last, since
  methods that return a new dataset may not carry it over).
DataLoader workers split a rank's share by batches: with the loader's round-robin over workers, the batches come in
the same order whatever --num-workers.

Resume: each rank's place is saved in its own part of the snapshot ("data"): the items it has consumed, and the
dataset's own state_dict() when that marks the place exactly: the dataset gives the rank all it yields (it shards
itself, or one rank), is read in this process (--num-workers 0), and is not a Hugging Face stream with a shuffle
buffer (whose state_dict() drops the buffer: its resume is not exact). A resume loads that state into the dataset,
or else skips, item by item, what the rank consumed (exact, at the cost of reading them again). The place is
counted in items, so a resume with another --batch-size or --grad-accum continues at the exact next item.

Random numbers the stream draws as it is read (a random crop in `__iter__`, a shuffle of its own) come from random
streams of its own (Python's, NumPy's, torch's CPU one), never from the process's, which the model draws from
(dropout) and a resume restores: the items a resume skips would draw from those, and every number after would
differ. Read in this process (--num-workers 0), the stream's streams are seeded from --seed and the rank, saved with
its place, and put back when a resume loads the dataset's own state; a resume that skips draws them again, item by
item, as the first reading did. DataLoader workers have theirs already, seeded the same way at every start. A stream
has no epochs (--max-steps sets the run's length), and a snapshot of a stream resumes with as many ranks only: each
rank's place is its own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import nullcontext
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from .batches import Progress
from .distributed import DistEnv
from .settings import RunError, flag
from .snapshot import OwnStreams


class StreamEnded(RuntimeError):
    """This rank's share of the stream ended before the run did (other ranks may still have items: it is this
    rank's error, logged with its rank)."""


def shards_itself(dataset: Any, env: DistEnv) -> bool:
    """True when `dataset` gives this rank its own items already (see the module docstring); a Hugging Face stream
    split for another rank or number of ranks than this job's is an error."""
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
    batch."""

    def __init__(self, dataset: IterableDataset, env: DistEnv, batch_size: int, skip: int, own_split: bool = False):
        self.dataset, self.batch_size, self.skip = dataset, batch_size, skip
        self.rank, self.world_size = (0, 1) if own_split else (env.rank, env.world_size)

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        for index, item in enumerate(self.dataset):
            if (index - self.rank) % self.world_size:
                continue  # another rank's
            position = (index - self.rank) // self.world_size - self.skip  # among this rank's items still to train
            if position >= 0 and (position // self.batch_size) % workers == worker:
                yield item


class StreamBatches:
    """`next(batches)` is the step's list of micro-batches from this rank's share of the stream."""

    def __init__(self, dataset: IterableDataset, cfg: Any, env: DistEnv, progress: Progress, collate: Callable | None):
        self.dataset, self.cfg, self.env, self.progress, self.collate = dataset, cfg, env, progress, collate
        self.global_batch = env.world_size * cfg.batch_size * cfg.grad_accum
        self.consumed = 0  # items this rank has trained on
        self.own_split = shards_itself(dataset, env)
        # The dataset's own state marks this rank's place only if it gives this rank all it yields (it shards itself,
        # or there is one rank), is read in this process, and marks it exactly.
        self.own_state = exact_own_state(dataset) and cfg.num_workers == 0 and (self.own_split or env.world_size == 1)
        # The loader's own generator: creating its iterator would otherwise draw a seed from the global one, right
        # after a resume restored it, and shift every random number the model draws (dropout) from then on.
        self.generator = torch.Generator()
        self.streams = OwnStreams(cfg.seed * 1_000_003 + env.rank + 1) if cfg.num_workers == 0 else nullcontext()
        self._iterator: Iterator[Any] | None = None

    def __iter__(self) -> StreamBatches:
        return self

    def __next__(self) -> list:
        with self.streams:
            micro_batches = self._read()
        self.progress.samples_in_epoch += self.global_batch
        self.progress.samples_seen += self.global_batch
        return micro_batches

    def _read(self) -> list:
        if self._iterator is None:
            skip = 0 if self.own_state else self.consumed  # the dataset's own state starts after what was consumed
            share = RankShare(self.dataset, self.env, self.cfg.batch_size, skip, self.own_split)
            self.generator.manual_seed(self.cfg.seed * 1_000_003 + self.env.rank)
            loader = DataLoader(
                share,
                batch_size=self.cfg.batch_size,
                drop_last=True,
                num_workers=self.cfg.num_workers,
                pin_memory=self.env.device.type == "cuda",
                collate_fn=self.collate,
                generator=self.generator,
            )
            self._iterator = iter(loader)
        micro_batches = []
        for _ in range(self.cfg.grad_accum):
            try:
                micro_batches.append(next(self._iterator))
            except StopIteration:
                raise StreamEnded(
                    f"the training stream ended on rank {self.env.rank} after {self.consumed} items, before "
                    f"{flag('max_steps')} was reached: lower it, or make the stream longer (or endless)"
                ) from None
            self.consumed += self.cfg.batch_size
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
