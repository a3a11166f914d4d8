"""Distributed (DDP) training with torchrun.

Yours to edit (the seam: machinery/hooks.py lists every hook these may define):
    model.py        the model, its loss, optimizer and schedule     <- replace with yours
    data.py         the datasets and how items become a batch       <- replace with yours
    config.py       your model's and data's settings                <- add yours
                    (the engine's: machinery/runsettings.py)

The template's machinery, edited only if you mean to:
    machinery/      training loop, snapshots (machinery/snapshot: load_latest), logging, debugging, tracking
    launch.py       launch(): train from a notebook or a script without torchrun (the door to machinery/launcher.py)
"""
