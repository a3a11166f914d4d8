"""Your settings: the model's and the data's, in one dataclass that extends the engine's.

Each field of `Config` becomes a command-line flag (`batch_size` -> `--batch-size`, a bool a `--x/--no-x` pair) and
a key of `--config FILE` (TOML); `option(default, help, min=..., choices=...)` declares the values it accepts, checked
before the run starts. Add your model's and data's settings here; `cfg.<name>` reaches build_model, build_datasets
and the other hooks. The engine's settings (training length, batch size, learning rate, snapshots, logging, the
process group, debugging flags) come from `RunSettings` (machinery/runsettings.py); to change one's default, declare
it again here, e.g. `lr: float = option(1e-3, "peak learning rate")`. `train.py --help` lists them all, in groups.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .machinery import runsettings, settings
from .machinery.runsettings import RunSettings
from .machinery.settings import RunError, flag, option, to_toml

__all__ = ["Config", "RunError", "build_parser", "flag", "option", "parse_args", "to_toml"]


@dataclass
class Config(RunSettings):
    """settings of this project's model and data (config.py)"""

    # --- demo settings: delete them with the demo model and data ---
    width: int = option(256, "hidden width of the demo model", min=1)
    depth: int = option(3, "hidden layers of the demo model", min=1)
    dropout: float = option(0.1, "dropout probability of the demo model", min=0, below=1)
    dataset_size: int = option(8192, "training samples of the demo dataset", min=1)
    val_size: int = option(2048, "validation samples of the demo dataset; 0 = no evaluation", min=0)
    # --- end of demo settings ---


def build_parser(config_cls: type = Config) -> argparse.ArgumentParser:
    return settings.build_parser(config_cls)


def parse_args(argv: Sequence[str] | None = None, config_cls: type[Any] = Config) -> Any:
    """Settings from --config FILE, then the command line on top; exit 2 with one line on the first bad value."""
    return runsettings.parse_args(argv, config_cls)
