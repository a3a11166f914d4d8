"""A stand-in debugger for the tests: PYTHONBREAKPOINT=breakpoint_probe.record makes breakpoint() call `record`,
which writes what the frame that called breakpoint() holds into BREAK_RECORD_DIR, holds the rank for BREAK_HOLD_S
seconds (a user looking around), and returns (a `continue`); PYTHONBREAKPOINT=breakpoint_probe.rebind rebinds the
frame's batch instead."""

import ctypes
import json
import os
import sys
import time

import torch
from torch.utils._pytree import tree_leaves, tree_map


def record():
    local = sys._getframe(1).f_locals  # the frame that called breakpoint(): sys.breakpointhook adds no Python frame
    rank = os.environ.get("RANK", "0")
    folder = os.environ["BREAK_RECORD_DIR"]
    tensors = [leaf for leaf in tree_leaves(local.get("batch")) if isinstance(leaf, torch.Tensor)]
    # The parameters: buffers such as BatchNorm's statistics are each rank's own until the next forward
    weights = {name: value.detach().cpu().clone() for name, value in local["model"].named_parameters()}
    torch.save(weights, f"{folder}/model-rank{rank}.pt")
    seen = {
        "step": local["step"],
        "batch_tensors": len(tensors),
        "batch_devices": sorted({str(tensor.device) for tensor in tensors}),
    }
    with open(f"{folder}/rank{rank}.json", "w") as handle:
        json.dump(seen, handle)
    time.sleep(float(os.environ.get("BREAK_HOLD_S", 0)))


def nan_filled(value):
    """`value` with each floating-point tensor in it filled with NaN (tuples, lists and dicts kept)."""
    return tree_map(lambda leaf: torch.full_like(leaf, float("nan")) if is_float(leaf) else leaf, value)


def is_float(leaf):
    return isinstance(leaf, torch.Tensor) and leaf.is_floating_point()


def rebind():
    """What a user does at the prompt: rebind BREAK_REBIND (`batch`, the default, or `micro_batches`) in the frame
    that called breakpoint() to a copy whose floating-point tensors are NaN, then continue."""
    frame = sys._getframe(1)
    name = os.environ.get("BREAK_REBIND", "batch")
    frame.f_locals[name] = nan_filled(frame.f_locals[name])
    if sys.version_info < (3, 13):  # f_locals is a copy there: write it back to the frame, as pdb and debugpy do
        ctypes.pythonapi.PyFrame_LocalsToFast(ctypes.py_object(frame), ctypes.c_int(0))
