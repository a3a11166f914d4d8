"""The model and its loss. Replace them with yours: nothing here knows about ranks, devices or snapshots.

- `build_model(cfg, train_dataset)` returns the `nn.Module` to train (the trainer moves it to the device and
  wraps it in DDP; snapshots and exports hold its own `state_dict`, without a `module.` prefix).
- `loss_fn(outputs, targets)` returns the mean loss of a batch of `(inputs, target)` items.
- `val_metrics(outputs, targets)` (optional) returns per-batch SUMS, e.g. `{"correct": ...}`: the trainer adds
  them up over every validation sample on every rank and logs each divided by the number of samples, as
  `val_<name>`. Delete it if you only want `val_loss`.
- `shard_units(model)` (optional, used with `--strategy fsdp`) returns the submodules to shard one by one: each
  gathers its full parameters only while it runs, so the fewer parameters one unit holds, the less memory a rank
  needs (typically: each transformer block). Without it, each direct child that has parameters is one unit, and
  a container without forward (`nn.ModuleList`) gives its children. `--activation-checkpointing` recomputes the
  same units in backward (under ddp too).

To fine-tune, `pretrained_weights(cfg)` (optional) returns where the starting weights are (a `.safetensors` file,
a Hugging Face model folder, a `.pt` state dict; None: none): a run with no snapshot starts from them.

Other shapes of training need no other file: `compute_loss(model, batch)` for dict batches and losses the model
computes (token-weighted with `{"loss": SUM, "count": N}`), `build_optimizer(cfg, model)` and
`build_scheduler(cfg, optimizer, total_steps)` for your own. machinery/hooks.py lists every hook and its default;
docs/recipes.md has recipes (a GPT on token windows, a Hugging Face-style LM, a stream, optimizer groups).
"""

import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    """A small classifier for the demo data: `depth` blocks (a hidden layer of `width` units, GELU, dropout), then
    the output layer."""

    def __init__(self, in_features: int, classes: int, width: int = 256, depth: int = 3, dropout: float = 0.1):
        super().__init__()
        blocks, features = [], in_features
        for _ in range(depth):
            blocks.append(nn.Sequential(nn.Linear(features, width), nn.GELU(), nn.Dropout(dropout)))
            features = width
        self.net = nn.Sequential(*blocks, nn.Linear(features, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def build_model(cfg, train_dataset) -> nn.Module:
    return MLP(train_dataset.features, train_dataset.classes, width=cfg.width, depth=cfg.depth, dropout=cfg.dropout)


def shard_units(model: MLP) -> list[nn.Module]:
    """Each block and the output layer (also what --activation-checkpointing recomputes)."""
    return list(model.net)


def loss_fn(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(outputs, targets)


def val_metrics(outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"accuracy": (outputs.argmax(dim=1) == targets).sum()}
