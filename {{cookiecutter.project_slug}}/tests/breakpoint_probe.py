"""A stand-in debugger for the tests: PYTHONBREAKPOINT=breakpoint_probe.record makes breakpoint() call `record`,
which writes what the frame that called breakpoint() holds into BREAK_RECORD_DIR, holds the rank for BREAK_HOLD_S
seconds (a user looking around), and returns (a `continue`)."""

import json
import os
import sys
import time

import torch
from torch.utils._pytree import tree_leaves


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
