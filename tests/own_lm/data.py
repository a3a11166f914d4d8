"""A user's own data, swapped in by the template tests: a stream of token sequences of a tiny synthetic language.

Each sequence counts through the tokens 1..15 in steps of 1, 2 or 3 from a random start (token 0 pads), 6 to 16
tokens long: the first two tokens of a sequence fix the rest, so a small language model can learn it. Item `i` is
made from a generator seeded with `i`, so it is the same whichever process or worker makes it. The training stream
has no `len()` and does not shard itself: the trainer gives each rank its share. As it is read, it cuts 0 to 3
tokens off the end of each item, drawn from torch's, Python's and NumPy's global random streams (a random
augmentation, as pipelines write it): a resume that skips the items already trained must not draw these from the
streams it restored. Validation is 53 map-style items.
"""

import random

import numpy
import torch
from torch.utils.data import Dataset, IterableDataset

PAD = 0
VOCAB_SIZE = 16  # PAD and the tokens 1..15
MAX_LENGTH = 16
TRAIN_SEED, VAL_SEED = 1, 2


def make_item(seed: int, index: int) -> dict:
    generator = torch.Generator().manual_seed(seed * 1_000_003 + index)

    def draw(low: int, high: int) -> int:  # high excluded
        return int(torch.randint(low, high, (1,), generator=generator))

    length, start, stride = draw(6, MAX_LENGTH + 1), draw(1, VOCAB_SIZE), draw(1, 4)
    tokens = 1 + (start - 1 + stride * torch.arange(length)) % (VOCAB_SIZE - 1)
    return {"id": index, "input_ids": tokens, "labels": tokens.clone()}


class CountingStream(IterableDataset):
    """`size` items, in order; a stream, so no `len()` (the trainer must not need one)."""

    vocab_size, max_length = VOCAB_SIZE, MAX_LENGTH

    def __init__(self, seed: int, size: int):
        self.seed, self.size = seed, size

    def __iter__(self):
        for index in range(self.size):
            item = make_item(self.seed, index)
            cut = int(torch.randint(0, 2, ())) + random.randrange(2) + int(numpy.random.randint(2))
            length = len(item["input_ids"]) - cut
            yield {**item, "input_ids": item["input_ids"][:length], "labels": item["labels"][:length]}


class CountingSet(Dataset):
    def __init__(self, seed: int, size: int):
        self.seed, self.size = seed, size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict:
        if not 0 <= index < self.size:
            raise IndexError(index)
        return make_item(self.seed, index)


def build_datasets(cfg) -> tuple[CountingStream, CountingSet]:
    return CountingStream(TRAIN_SEED, size=20_000), CountingSet(VAL_SEED, size=53)


def collate(items: list[dict]) -> dict[str, torch.Tensor]:
    """Pad every sequence to the batch's longest: PAD in input_ids, 0 in attention_mask, -100 (ignored) in labels."""
    longest = max(len(item["input_ids"]) for item in items)
    input_ids = torch.full((len(items), longest), PAD, dtype=torch.long)
    labels = torch.full((len(items), longest), -100, dtype=torch.long)
    attention_mask = torch.zeros((len(items), longest), dtype=torch.long)
    for row, item in enumerate(items):
        length = len(item["input_ids"])
        input_ids[row, :length] = item["input_ids"]
        labels[row, :length] = item["labels"]
        attention_mask[row, :length] = 1
    ids = torch.tensor([item["id"] for item in items], dtype=torch.long)
    return {"id": ids, "input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
