"""The dataset. Replace it with yours: nothing here knows about ranks; the trainer shards it.

The demo data is synthetic, made on the spot from a fixed seed (no download): points in 32 dimensions,
labelled by a random linear "teacher" plus noise. A model can learn it, so the loss visibly falls.
"""

import torch
from torch.utils.data import Dataset


class TeacherDataset(Dataset):
    features = 32
    classes = 10

    def __init__(self, size, seed=0):
        generator = torch.Generator().manual_seed(seed)
        self.inputs = torch.randn(size, self.features, generator=generator)
        teacher = torch.randn(self.features, self.classes, generator=generator)
        noise = 0.3 * torch.randn(size, self.classes, generator=generator)
        self.labels = (self.inputs @ teacher + noise).argmax(dim=1)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        return self.inputs[index], self.labels[index]


def build_dataset(cfg):
    return TeacherDataset(cfg.dataset_size)
