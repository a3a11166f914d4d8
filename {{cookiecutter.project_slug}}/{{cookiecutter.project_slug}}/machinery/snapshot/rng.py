"""Every rank's random streams (Python, NumPy, torch, CUDA), as plain containers torch.load(weights_only=True) reads."""

import random
from typing import cast

import numpy as np
import torch

NUMPY_FIELDS = ("kind", "keys", "pos", "has_gauss", "cached_gaussian")  # np.random.get_state()'s, in its order


def capture_rng(cuda: bool = True) -> dict:
    """The process's random streams; `cuda=False` leaves CUDA's out (an empty list)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    numpy_state = (kind, torch.from_numpy(np.asarray(keys, dtype=np.int64)), int(pos), int(has_gauss), float(cached))
    return {
        "python": random.getstate(),
        "numpy": dict(zip(NUMPY_FIELDS, numpy_state, strict=True)),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if cuda and torch.cuda.is_available() else [],
    }


def restore_rng(state: dict) -> None:
    random.setstate(state["python"])
    numpy_state = {**state["numpy"], "keys": state["numpy"]["keys"].numpy().astype(np.uint32)}
    np.random.set_state(tuple(numpy_state[name] for name in NUMPY_FIELDS))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def seed_rng(seed: int, every_device: bool = False) -> None:
    """Seed Python's, NumPy's and torch's CPU streams; with every_device, CUDA's (and any other device's) too."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    if every_device:
        torch.manual_seed(seed)
    else:
        torch.default_generator.manual_seed(seed)


class OwnStreams:
    """Random streams of their own (Python's, NumPy's, torch's CPU one): code run `with` them draws from them, and
    the process's streams are as they were before and after. `state` is theirs, None until first used (then seeded
    from `seed`); put a saved one back to go on from it."""

    def __init__(self, seed: int):
        self.seed = seed
        self.state: dict | None = None
        self._outer: dict | None = None

    def __enter__(self) -> "OwnStreams":
        self._outer = capture_rng(cuda=False)
        if self.state is None:
            seed_rng(self.seed)
        else:
            restore_rng(self.state)
        return self

    def __exit__(self, *exc_info) -> None:
        self.state = capture_rng(cuda=False)
        restore_rng(cast(dict, self._outer))
        self._outer = None
