"""The torchdata variant of streaming training data measured in STREAMS.md (the trainer uses machinery/stream.py).

Requirement: torchdata==0.11.0 (only its pure-Python StatefulDataLoader is used; it imports nothing but torch).

- RankShare gives rank r the items r, r+N, r+2N, ... of a stream that does not shard itself, and hands each
  DataLoader worker whole batches of that share in turn (batch b to worker b % W), so that the in-order
  round robin of the loader yields the share's batches in stream order whatever the number of workers.
- A dataset that sets `shards_itself = True` (e.g. a Hugging Face `split_dataset_by_node` stream, which also
  splits its shards between DataLoader workers) is passed through untouched.
- The position lives in each worker's copy of RankShare: the number of stream items it has read, plus the
  dataset's own state_dict() when it has one. StatefulDataLoader snapshots it in the worker after every batch
  and keeps, in the main process, the snapshot that matches the batches it has *yielded*, not the prefetched
  ones; so a snapshot taken between optimizer steps resumes at the next unseen batch.
- Without a dataset state_dict the resume re-reads and drops the items before the position (inside the
  workers, before collate), which costs one pass over the consumed part of the stream.
"""

import itertools
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.utils.data import IterableDataset, get_worker_info
from torchdata.stateful_dataloader import StatefulDataLoader


def _has_state(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


class RankShare(IterableDataset):
    """This rank's share of `dataset`, split between DataLoader workers by whole batches."""

    def __init__(self, dataset: Iterable, rank: int, world_size: int, batch_size: int):
        self.dataset, self.rank, self.world_size, self.batch_size = dataset, rank, world_size, batch_size
        self.shards_itself = bool(getattr(dataset, "shards_itself", False))
        self.read = 0  # stream items this copy has read (or, for a self-sharding stream, yielded)
        self._inner_state: dict | None = None

    def __iter__(self) -> Iterator[Any]:
        if self._inner_state is not None:
            self.dataset.load_state_dict(self._inner_state)  # the dataset continues by itself: no skipping
            self._inner_state = None
            stream = iter(self.dataset)
        else:
            stream = itertools.islice(iter(self.dataset), self.read, None)  # re-read and drop what was consumed
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        for index in itertools.count(self.read):
            try:
                item = next(stream)
            except StopIteration:
                return
            self.read = index + 1  # updated before the yield: a snapshot taken at the yield counts this item
            if self.shards_itself:
                yield item
                continue
            if index % self.world_size != self.rank:
                continue
            if (index // self.world_size // self.batch_size) % workers == worker:
                yield item

    def state_dict(self) -> dict:
        state = {"read": self.read}
        if _has_state(self.dataset):
            state["dataset"] = self.dataset.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.read = int(state["read"])
        self._inner_state = state.get("dataset")


class StreamLoader:
    """One optimizer step of a stream at a time, with state_dict()/load_state_dict() for the snapshot.

    `next_step(grad_accum)` returns grad_accum micro-batches of batch_size items. The state refuses a
    different world size or worker count (the position is per rank and per worker). A stream that ends
    raises StreamEnded: a silent second pass would change the data the run was planned with, and a dataset
    that should repeat can loop by itself (then the position stays exact, as the stream never ends).
    """

    def __init__(
        self,
        dataset,
        rank,
        world_size,
        batch_size,
        num_workers,
        collate_fn,
        seed,
        generator,
        pin_memory=False,
        persistent_workers=False,
    ):
        self.share = RankShare(dataset, rank, world_size, batch_size)
        self.world_size, self.num_workers = world_size, num_workers
        generator = generator if generator is not None else torch.Generator()
        generator.manual_seed(seed * 1_000_003 + rank)  # worker seeds come from it; the state restores them
        self.loader = StatefulDataLoader(
            self.share,
            batch_size=batch_size,
            drop_last=True,
            collate_fn=collate_fn,
            num_workers=num_workers,
            pin_memory=pin_memory,
            persistent_workers=persistent_workers and num_workers > 0,
            generator=generator,
        )
        self._iterator: Iterator | None = None

    def next_step(self, grad_accum: int) -> list:
        if self._iterator is None:
            self._iterator = iter(self.loader)  # after load_state_dict, this starts where the snapshot was
        try:
            return [next(self._iterator) for _ in range(grad_accum)]
        except StopIteration:
            raise StreamEnded(
                "the training stream ended before --max-steps; pass a longer stream, "
                "one that repeats itself, or fewer --max-steps"
            ) from None

    def state_dict(self) -> dict:
        return {"world_size": self.world_size, "num_workers": self.num_workers, "loader": self.loader.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if state["world_size"] != self.world_size or state["num_workers"] != self.num_workers:
            raise ValueError(
                f"a streaming dataset resumes only with the same ranks and workers: the snapshot has "
                f"{state['world_size']} ranks x {state['num_workers']} workers, "
                f"this job {self.world_size} x {self.num_workers}"
            )
        self.loader.load_state_dict(state["loader"])
        self._iterator = None


class StreamEnded(RuntimeError):
    pass


# ---------------------------------------------------------------------------------------------------- test


class GeneratorStream(IterableDataset):
    """A stream with no state: dict items of tensors, variable length."""

    def __init__(self, n: int):
        self.n = n

    def __iter__(self):
        for i in range(self.n):
            yield {"x": torch.arange(i % 5 + 1, dtype=torch.float32) + i, "y": torch.tensor(i)}


class StatefulStream(GeneratorStream):
    """The same stream with its own position (as a stream reader with an offset would have)."""

    def __init__(self, n: int):
        super().__init__(n)
        self.pos = 0
        self.loads = 0

    def __iter__(self):
        start = self.pos
        for i in range(start, self.n):
            self.pos = i + 1
            yield {"x": torch.arange(i % 5 + 1, dtype=torch.float32) + i, "y": torch.tensor(i)}

    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, state):
        self.pos = state["pos"]
        self.loads += 1


def pad_collate(items: list) -> dict:
    x = torch.nn.utils.rnn.pad_sequence([it["x"] for it in items], batch_first=True)
    return {"x": x, "y": torch.stack([it["y"] for it in items])}


def _flat(step: list) -> list:
    return [(b["x"].clone(), b["y"].clone()) for b in step]


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        len(s) == len(t)
        and all(torch.equal(x1, x2) and torch.equal(y1, y2) for (x1, y1), (x2, y2) in zip(s, t, strict=True))
        for s, t in zip(a, b, strict=True)
    )


def _check(make, num_workers, world_size=2, batch=3, accum=2, steps=12, cut=5):
    import io

    for rank in range(world_size):
        args = dict(
            rank=rank,
            world_size=world_size,
            batch_size=batch,
            num_workers=num_workers,
            collate_fn=pad_collate,
            seed=7,
            generator=torch.Generator(),
        )
        full = StreamLoader(make(), **args)
        reference = [_flat(full.next_step(accum)) for _ in range(steps)]
        # items rank r gets are r, r+N, ...: check against the stream itself
        ys = torch.cat([y for step in reference for _, y in step]).tolist()
        assert ys == list(range(rank, world_size * len(ys), world_size))[: len(ys)], ys

        first = StreamLoader(make(), **args)
        head = [_flat(first.next_step(accum)) for _ in range(cut)]
        buffer = io.BytesIO()
        torch.save(first.state_dict(), buffer)  # what a snapshot does, then SIGKILL
        del first
        buffer.seek(0)
        resumed = StreamLoader(make(), **args)
        resumed.load_state_dict(torch.load(buffer, weights_only=True))
        tail = [_flat(resumed.next_step(accum)) for _ in range(steps - cut)]
        assert _same(reference, head + tail), (make.__name__, num_workers, rank)


if __name__ == "__main__":
    import sys

    for num_workers in (0, 2):
        for make in (lambda: GeneratorStream(1000), lambda: StatefulStream(1000)):
            _check(make, num_workers)
    # the end of a stream: an error by default
    short = StreamLoader(GeneratorStream(20), 0, 2, 3, 0, pad_collate, 7, None)
    try:
        for _ in range(10):
            short.next_step(1)
        sys.exit("the stream's end was not noticed")
    except StreamEnded as error:
        print("end of stream:", error)
    # a world-size change is refused
    state = StreamLoader(GeneratorStream(20), 0, 2, 3, 0, pad_collate, 7, None).state_dict()
    try:
        StreamLoader(GeneratorStream(20), 0, 4, 3, 0, pad_collate, 7, None).load_state_dict(state)
        sys.exit("a world-size change was accepted")
    except ValueError as error:
        print("world size change:", error)
    print("ok: exact resume with 0 and 2 workers, with and without a dataset state_dict")
