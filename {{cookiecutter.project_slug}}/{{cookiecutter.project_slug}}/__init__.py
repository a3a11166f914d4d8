"""Distributed (DDP) training with torchrun.

Where things live:
    config.py       every command-line flag, its default and what it means
    distributed.py  the torchrun environment, process group, device and teardown
    logs.py         rank-aware logging (one clean console, every rank's warnings)
    tracking.py     experiment tracking (wandb on rank 0, a no-op elsewhere)
    snapshot.py     snapshots: atomic, checked, written in the background, pruned
    debug.py        attach a debugger to chosen ranks (DEBUG_RANK)
    model.py        the model            <- replace with yours
    data.py         the dataset          <- replace with yours
    trainer.py      the training loop
"""
