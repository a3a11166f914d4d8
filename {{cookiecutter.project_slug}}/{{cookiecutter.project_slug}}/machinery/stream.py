"""Streams: training data that is an IterableDataset without len(), one optimizer step at a time, resumable.

Each rank trains on its own share: rank r of N takes items r, r+N, r+2N, ... of the stream. A dataset that already
gives each rank its own items (e.g. Hugging Face's `split_dataset_by_node`) says so with a true attribute
`shards_itself`; then every item it yields on a rank is that rank's. DataLoader workers split a rank's share by
batches: with the loader's round-robin over workers, the batches come in the same order whatever --num-workers.

Resume: each rank's place is saved in its own part of the snapshot ("data"): the batches it has consumed, and the
dataset's own state_dict() when it has one, gives the rank all it yields (it shards itself, or one rank) and is
read in this process (--num-workers 0). A resume
loads that state into the dataset, or else skips, item by item, what the rank consumed. A stream has no epochs
(--max-steps sets the run's length), and a snapshot of a stream resumes with as many ranks only: each rank's place
is its own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from .batches import Progress
from .distributed import DistEnv
from .settings import RunError, flag


class StreamEnded(RuntimeError):
    """This rank's share of the stream ended before the run did (other ranks may still have items: it is this
    rank's error, logged with its rank)."""


class RankShare(IterableDataset):
    """This rank's items of a stream, as whole batches from `skip_batches` on; a worker takes every W-th batch."""

    def __init__(self, dataset: IterableDataset, env: DistEnv, batch_size: int, skip_batches: int, skip_items: bool):
        self.dataset, self.batch_size, self.skip_batches = dataset, batch_size, skip_batches
        self.shards_itself = bool(getattr(dataset, "shards_itself", False))
        self.rank, self.world_size = (0, 1) if self.shards_itself else (env.rank, env.world_size)
        self.skip_items = skip_items  # False when the dataset's own state already starts after what was consumed

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        first = self.skip_batches if self.skip_items else 0  # the rank's first batch still to train on
        for index, item in enumerate(self.dataset):
            if (index - self.rank) % self.world_size:
                continue  # another rank's
            position = (index - self.rank) // self.world_size  # among this rank's items
            batch = position // self.batch_size
            if batch >= first and (batch - first) % workers == worker:
                yield item


class StreamBatches:
    """`next(batches)` is the step's list of micro-batches from this rank's share of the stream."""

    def __init__(self, dataset: IterableDataset, cfg: Any, env: DistEnv, progress: Progress, collate: Callable | None):
        self.dataset, self.cfg, self.env, self.progress, self.collate = dataset, cfg, env, progress, collate
        self.global_batch = env.world_size * cfg.batch_size * cfg.grad_accum
        self.consumed = 0  # batches this rank has trained on
        # The dataset's own state marks this rank's place only if it gives this rank all it yields (it shards itself,
        # or there is one rank) and is read in this process.
        shards_itself = bool(getattr(dataset, "shards_itself", False)) or env.world_size == 1
        self.own_state = callable(getattr(dataset, "state_dict", None)) and cfg.num_workers == 0 and shards_itself
        self._iterator: Iterator[Any] | None = None

    def __iter__(self) -> StreamBatches:
        return self

    def __next__(self) -> list:
        if self._iterator is None:
            share = RankShare(self.dataset, self.env, self.cfg.batch_size, self.consumed, not self.own_state)
            loader = DataLoader(
                share,
                batch_size=self.cfg.batch_size,
                drop_last=True,
                num_workers=self.cfg.num_workers,
                pin_memory=self.env.device.type == "cuda",
                collate_fn=self.collate,
            )
            self._iterator = iter(loader)
        micro_batches = []
        for _ in range(self.cfg.grad_accum):
            try:
                micro_batches.append(next(self._iterator))
            except StopIteration:
                raise StreamEnded(
                    f"the training stream ended on rank {self.env.rank} after {self.consumed} batches, before "
                    f"{flag('max_steps')} was reached: lower it, or make the stream longer (or endless)"
                ) from None
            self.consumed += 1
        self.progress.samples_in_epoch += self.global_batch
        self.progress.samples_seen += self.global_batch
        return micro_batches

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"consumed_batches": self.consumed}
        if self.own_state:
            state["dataset"] = self.dataset.state_dict()  # type: ignore[attr-defined]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.consumed = int(state["consumed_batches"])
        if self.own_state:
            if "dataset" not in state:
                raise RunError(
                    "the snapshot holds no state of the stream itself (it was written with another --num-workers): "
                    "resume with the same --num-workers"
                )
            self.dataset.load_state_dict(state["dataset"])  # type: ignore[attr-defined]
        self._iterator = None
