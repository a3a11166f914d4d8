"""The model. Replace it with yours: nothing here knows about ranks, devices or snapshots."""

from torch import nn


class MLP(nn.Module):
    """A small classifier for the demo data: `depth` hidden layers of `width` units, with dropout."""

    def __init__(self, in_features, classes, width=256, depth=3, dropout=0.1):
        super().__init__()
        layers, features = [], in_features
        for _ in range(depth):
            layers += [nn.Linear(features, width), nn.GELU(), nn.Dropout(dropout)]
            features = width
        layers.append(nn.Linear(features, classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x)


def build_model(cfg, dataset):
    return MLP(dataset.features, dataset.classes, width=cfg.width, depth=cfg.depth, dropout=cfg.dropout)
