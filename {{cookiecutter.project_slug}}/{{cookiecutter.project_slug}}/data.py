"""The data. Replace `build_datasets` with yours: nothing here knows about ranks; the trainer shards the data.

`build_datasets(cfg)` returns `(train, val)`: map-style datasets (`len()` and `dataset[i]`) whose items are
`(inputs, target)` pairs the default collate can batch. `val` may be None: no evaluation then.

The demo data is synthetic, made on the spot from a fixed seed (no download): points in 32 dimensions,
labelled by a random linear "teacher" plus noise. A model can learn it, so the loss visibly falls.
"""

import torch
from torch.utils.data import TensorDataset


class TeacherDataset(TensorDataset):
    """Inputs and labels of the demo, with the sizes the demo model is built for."""

    features = 32
    classes = 10


def build_datasets(cfg) -> tuple[TeacherDataset, TeacherDataset | None]:
    generator = torch.Generator().manual_seed(0)  # the same data on every rank and every run
    total = cfg.dataset_size + cfg.val_size
    inputs = torch.randn(total, TeacherDataset.features, generator=generator)
    teacher = torch.randn(TeacherDataset.features, TeacherDataset.classes, generator=generator)
    noise = 0.3 * torch.randn(total, TeacherDataset.classes, generator=generator)
    labels = (inputs @ teacher + noise).argmax(dim=1)
    train = TeacherDataset(inputs[: cfg.dataset_size], labels[: cfg.dataset_size])
    val = TeacherDataset(inputs[cfg.dataset_size :], labels[cfg.dataset_size :]) if cfg.val_size else None
    return train, val
