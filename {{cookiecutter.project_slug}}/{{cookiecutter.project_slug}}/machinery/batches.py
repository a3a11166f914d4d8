"""Where the run is and how long it is (Progress, RunLength), and map-style training data one optimizer step at a
time, from any point (streams: stream.py). `to_device` moves every tensor inside a batch of any structure."""

import copy
import dataclasses
import hashlib
import math
from collections.abc import Callable, Iterator, Mapping, MutableMapping, Sized
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, get_worker_info

from .distributed import DistEnv
from .settings import RunError, flag
from .snapshot.rng import seed_rng


def map_tensors(function: Callable[[torch.Tensor], Any], batch: Any) -> Any:
    """`batch` with `function` applied to every tensor inside it, its containers rebuilt as they were: lists,
    tuples, named tuples, mappings (dicts and their subclasses, e.g. BatchEncoding) and dataclass instances; other
    values are left as they are. (torch's tree_map does not enter dataclasses or most dict subclasses.)"""
    if isinstance(batch, torch.Tensor):
        return function(batch)
    if isinstance(batch, Mapping):  # a copy keeps a mutable mapping's type and attributes; its values are replaced
        moved = copy.copy(batch) if isinstance(batch, MutableMapping) else {}
        for key in batch:
            moved[key] = map_tensors(function, batch[key])
        return moved
    if isinstance(batch, (list, tuple)):
        values = [map_tensors(function, value) for value in batch]
        return type(batch)(*values) if hasattr(batch, "_fields") else type(batch)(values)  # a named tuple: by position
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        moved = copy.copy(cast(Any, batch))
        for spec in dataclasses.fields(batch):
            object.__setattr__(moved, spec.name, map_tensors(function, getattr(batch, spec.name)))  # frozen too
        return moved
    return batch


def tensors_in(batch: Any) -> list[torch.Tensor]:
    """Every tensor inside `batch`, in the order map_tensors visits them."""
    found: list[torch.Tensor] = []
    map_tensors(found.append, batch)
    return found


def to_device(batch: Any, device: torch.device) -> Any:
    """The batch with every tensor in it on `device` (non-blocking from pinned memory); other values as they are."""
    return map_tensors(lambda value: value.to(device, non_blocking=True), batch)


@dataclass
class Progress:
    """Where the run is. Saved in every snapshot; a resume continues from it."""

    step: int = 0  # optimizer steps done
    epoch: int = 0
    samples_in_epoch: int = 0  # samples of the current epoch consumed by all ranks together
    samples_seen: int = 0
    step_samples: int = 0  # samples per optimizer step when the run started: the unit of the run's length
    first_loss: float = math.nan  # loss of the first logged step, kept across restarts for the summary
    last_loss: float = math.nan
    val_loss: float = math.nan
    best_val_loss: float = math.inf
    best_step: int = -1


class RunLength:
    """How long the run is, in samples: --max-steps (or --epochs) counts steps of the size they had when the run
    started, so a job resumed on more or fewer ranks trains the samples left, in steps of its own size, and the
    learning-rate schedule, a function of the samples seen, is the same curve at any world size."""

    def __init__(self, cfg: Any, step_samples: int, train_size: int | None):
        if train_size is None and not cfg.max_steps:  # a stream: no epochs to count in
            raise RunError(
                f"the training data is a stream (an IterableDataset without len()), which has no epochs: set "
                f"{flag('max_steps')} for the run's length instead of {flag('epochs')}"
            )
        steps_per_epoch = (train_size or 0) // step_samples
        self.samples = (cfg.max_steps or cfg.epochs * steps_per_epoch) * step_samples
        self.warmup_samples = cfg.warmup_steps * step_samples
        self.step_samples = step_samples
        self.peak_lr = cfg.lr
        self.total_steps = 0  # the step at which this attempt ends (`steps`), once its progress is known

    def steps(self, progress: Progress, global_batch: int) -> int:
        """The step at which this attempt ends: the steps done plus the steps left at this attempt's size."""
        left = max(0, self.samples - progress.samples_seen)
        return progress.step + -(-left // global_batch)

    def due(self, step: int, every: int) -> bool:
        """True at every `every`-th step and at the attempt's last one (`every` = 0: only at the last one)."""
        return step >= self.total_steps or (every > 0 and step % every == 0)

    def lr(self, samples_seen: int) -> float:
        """Linear warmup, then cosine decay to 10% of the peak; in samples (= steps at the starting size)."""
        position = samples_seen / self.step_samples
        if samples_seen < self.warmup_samples:
            return self.peak_lr * (position + 1) / (self.warmup_samples / self.step_samples)
        decay = max(1.0, (self.samples - self.warmup_samples) / self.step_samples)
        done = min(1.0, (samples_seen - self.warmup_samples) / self.step_samples / decay)
        return self.peak_lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * done)))


class ResumableSampler(DistributedSampler):
    """A DistributedSampler that starts mid-epoch (at `start`) and yields whole optimizer steps only. An epoch is one
    permutation (seeded with seed + epoch) of which rank r takes every world_size-th index: after k steps the job has
    consumed its first k * global_batch indices at any world size, so a resume skips them without loading them."""

    def __init__(self, dataset: Dataset, env: DistEnv, seed: int, samples_per_rank_step: int, keyed: bool = False):
        super().__init__(dataset, num_replicas=env.world_size, rank=env.rank, shuffle=True, seed=seed, drop_last=True)
        self.samples_per_rank_step = samples_per_rank_step
        self.start = 0
        self.keyed = keyed  # yield epoch * len(dataset) + index, the keys of `SeededItems`

    def steps(self) -> int:
        """Whole optimizer steps left in this epoch."""
        return (_size(self.dataset) - self.start) // (self.num_replicas * self.samples_per_rank_step)

    def __len__(self) -> int:
        return self.steps() * self.samples_per_rank_step

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(_size(self.dataset), generator=generator)
        order = order[self.start : self.start + self.steps() * self.num_replicas * self.samples_per_rank_step]
        if self.keyed:
            order = order + self.epoch * _size(self.dataset)
        return iter(order[self.rank :: self.num_replicas].tolist())


class SeededItems(Dataset):
    """A map-style dataset as DataLoader workers read it, by keys epoch * len(dataset) + index: each item is read
    with random streams seeded from the run's seed, the epoch and its index, so a random augmentation draws the same
    whichever worker reads it, also after a resume that skipped the items before it (a worker's own streams would
    move on with every item). A dataset with `__getitems__` (Hugging Face's) is seeded once per batch."""

    def __init__(self, dataset: Dataset, seed: int):
        self.dataset, self.seed, self.size = dataset, seed, _size(dataset)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, key: int) -> Any:
        self._seed(key)
        return self.dataset[key % self.size]

    def __getitems__(self, keys: list[int]) -> list:
        read_batch = getattr(self.dataset, "__getitems__", None)
        if not read_batch:
            return [self[key] for key in keys]
        self._seed(keys[0])
        return read_batch([key % self.size for key in keys])

    def _seed(self, key: int) -> None:
        if get_worker_info() is None:  # not in a worker: the process's own streams, saved in every snapshot
            return
        epoch, index = divmod(key, self.size)
        digest = hashlib.blake2b(f"{self.seed}/{epoch}/{index}".encode(), digest_size=8).digest()
        seed_rng(int.from_bytes(digest, "little") >> 1)


def loader(
    dataset: Dataset, cfg: Any, env: DistEnv, collate: Callable | None, generator: torch.Generator, **more: Any
) -> DataLoader:
    """A loader of whole --batch-size batches (`collate` None: torch's default_collate). With a generator of its own:
    creating its iterator would otherwise draw a seed from the global one, right after a resume restored it, and
    shift every random number the model draws (dropout) from then on."""
    return DataLoader(
        dataset,
        batch_size=cfg.batch_size,
        drop_last=True,
        num_workers=cfg.num_workers,
        pin_memory=env.device.type == "cuda",
        collate_fn=collate,
        generator=generator,
        **more,
    )


class Batches:
    """The training data one optimizer step at a time: `next(batches)` is the step's list of micro-batches. It owns
    the data position in `progress`, and starts the next epoch when fewer samples than one step are left."""

    def __init__(self, dataset: Dataset, cfg: Any, env: DistEnv, progress: Progress, collate: Callable | None):
        self.cfg, self.env, self.progress = cfg, env, progress
        self.global_batch = env.world_size * cfg.batch_size * cfg.grad_accum
        workers = cfg.num_workers > 0  # their items are seeded one by one: see SeededItems
        self.sampler = ResumableSampler(dataset, env, cfg.seed, cfg.batch_size * cfg.grad_accum, keyed=workers)
        self.generator = torch.Generator()
        items = SeededItems(dataset, cfg.seed) if workers else dataset
        self.loader = loader(items, cfg, env, collate, self.generator, sampler=self.sampler, persistent_workers=workers)
        self._iterator: Iterator[Any] = iter(())  # replaced by the first step's epoch start
        self._steps_left = 0
        self._last: list = []
        self._repeat: list | None = None  # the micro-batches the next step takes once more

    def __iter__(self) -> "Batches":
        return self

    def __next__(self) -> list:
        if self._repeat is not None:
            step, self._repeat = self._repeat, None
            return step
        while self._steps_left == 0:
            self._start_epoch()
        self._steps_left -= 1
        self.progress.samples_in_epoch += self.global_batch
        self.progress.samples_seen += self.global_batch
        self._last = [next(self._iterator) for _ in range(self.cfg.grad_accum)]
        return self._last

    def repeat_last_step(self) -> None:
        """The next step takes the last step's micro-batches once more: that step was dropped (by the jobs this one
        trains with, when one failed during it), so the data position stays a function of the steps taken."""
        self._repeat = self._last

    def restart(self) -> None:
        """Go on from the position in `progress` as it is now (it was loaded from elsewhere): the next step starts
        a new pass of the loader there."""
        self._iterator, self._steps_left, self._repeat = iter(()), 0, None

    def _start_epoch(self) -> None:
        progress = self.progress
        if progress.samples_in_epoch + self.global_batch > _size(self.sampler.dataset):  # no whole step left
            progress.epoch += 1
            progress.samples_in_epoch = 0
        self.sampler.set_epoch(progress.epoch)
        self.sampler.start = progress.samples_in_epoch
        self.generator.manual_seed(self.cfg.seed * 1_000_003 + progress.epoch * 7_919 + self.env.rank)
        self._iterator, self._steps_left = iter(self.loader), self.sampler.steps()


def _size(dataset: Dataset) -> int:
    """The length of a map-style dataset (torch's Dataset type does not declare __len__, though every one has it)."""
    return len(cast(Sized, dataset))
