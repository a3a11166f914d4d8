"""A user's own model, swapped in by the template tests: a small CNN with BatchNorm, nothing from the demo, trained by
two optimizers (AdamW for the convolutions, SGD with momentum for the head): every baked test runs with a list of
optimizers."""

import torch
import torch.nn.functional as F
from torch import nn


class SmallCNN(nn.Module):
    def __init__(self, channels: int, classes: int):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(channels, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
        )
        self.head = nn.Linear(16, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(images).flatten(1))


def build_model(cfg, train_dataset) -> nn.Module:
    images, _ = train_dataset[0]
    return SmallCNN(images.shape[0], train_dataset.classes)


def loss_fn(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(outputs, targets)


def val_metrics(outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
    return {
        "accuracy": (outputs.argmax(dim=1) == targets).sum(),
        "top2": (outputs.topk(2).indices == targets[:, None]).any(1).sum(),
    }


def build_optimizer(cfg, model: SmallCNN) -> list[torch.optim.Optimizer]:
    return [
        torch.optim.AdamW(model.features.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay),
        torch.optim.SGD(model.head.parameters(), lr=cfg.lr, momentum=0.9),
    ]
