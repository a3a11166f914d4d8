"""A user's own data, swapped in by the template tests: synthetic 1x12x12 "images" of 4 classes, split 80/20.

Each class is a bright blob in its own quadrant, plus noise. 1003 samples: not a multiple of any global batch.
"""

import torch
from torch.utils.data import Dataset


class Blobs(Dataset):
    classes = 4

    def __init__(self, images: torch.Tensor, labels: torch.Tensor):
        self.images, self.labels = images, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[index], self.labels[index]


def build_datasets(cfg) -> tuple[Blobs, Blobs]:
    generator = torch.Generator().manual_seed(42)
    count = 1003
    labels = torch.randint(0, Blobs.classes, (count,), generator=generator)
    images = 0.5 * torch.randn(count, 1, 12, 12, generator=generator)
    for index, label in enumerate(labels.tolist()):
        row, col = divmod(label, 2)
        images[index, 0, row * 6 + 1 : row * 6 + 5, col * 6 + 1 : col * 6 + 5] += 1.0
    split = int(0.8 * count)
    return Blobs(images[:split], labels[:split]), Blobs(images[split:], labels[split:])
