"""The data. Replace `build_datasets` with yours: nothing here knows about ranks; the trainer shards the data.

`build_datasets(cfg)` returns `(train, val)`; `val` may be None (no evaluation). Items can be `(inputs, target)`
pairs, as here, or dicts and other nested structures (then write `compute_loss` in model.py); an optional
`collate(items)` here makes a batch of them (e.g. padding). `train` may be map-style (`len()` and `dataset[i]`:
exact position by index at any world size) or a stream (an `IterableDataset`: each rank takes its share).
An optional `prepare_data(cfg)` runs before it, once per machine (the machine's other ranks wait for it, however
long it takes): downloads, tokenizing into a cache. It runs at every start, resumes too: let it skip what is there
(`write_once(folder, build)` of machinery/writeonce.py does, and is safe for jobs that prepare one cache at once).

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
