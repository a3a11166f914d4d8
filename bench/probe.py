"""Run a training script with a clock on every optimizer step; the benchmark's only hook into a run.

    python probe.py SCRIPT [ARGS...]          (under torchrun in the benchmark)

A global optimizer step hook (torch.optim.optimizer.register_optimizer_step_post_hook) notes the time after
every optimizer step, so the baked train.py and the bare loop are timed by the same code without changing
either. With PROBE_DIR set, each worker writes to it:
    first-rank{R}-attempt{A}.json   as soon as its first optimizer step is done: wall-clock time of that step
    steps-rank{R}-attempt{A}.json   at a normal exit: time.perf_counter() after every optimizer step
A is torchrun's TORCHELASTIC_RESTART_COUNT, so a restarted worker writes new files.
"""

import atexit
import json
import os
import runpy
import sys
import time

PROCESS_START = time.time()

from torch.optim.optimizer import register_optimizer_step_post_hook  # noqa: E402  (the script imports torch too)

OUT = os.environ.get("PROBE_DIR")
TAG = f"rank{os.environ.get('RANK', '0')}-attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
steps = []


def _write(name, obj):
    path = os.path.join(OUT, f"{name}-{TAG}.json")
    with open(path + ".tmp", "w") as handle:
        json.dump(obj, handle)
    os.replace(path + ".tmp", path)


def _after_step(optimizer, args, kwargs):
    steps.append(time.perf_counter())
    if len(steps) == 1 and OUT:
        _write("first", {"process_start": PROCESS_START, "first_step": time.time()})


def _at_exit():
    if OUT:
        _write("steps", {"process_start": PROCESS_START, "steps": steps})


register_optimizer_step_post_hook(_after_step)
atexit.register(_at_exit)

if __name__ == "__main__":
    script = os.path.abspath(sys.argv[1])
    sys.argv = [script] + sys.argv[2:]
    sys.path.insert(0, os.path.dirname(script))  # what `python script.py` does
    runpy.run_path(script, run_name="__main__")
