"""Run a training script with a clock on every optimizer step; the benchmark's only hook into a run.

    python probe.py SCRIPT [ARGS...]          (under torchrun in the benchmark)

A global optimizer step hook (torch.optim.optimizer.register_optimizer_step_post_hook) notes the time after
every optimizer step, so the baked train.py and the bare loop are timed by the same code without changing
either. With PROBE_DIR set, each worker writes to it:
    first-rank{R}-attempt{A}.json   as soon as its first optimizer step is done: wall-clock time of that step
    steps-rank{R}-attempt{A}.json   at a normal exit: time.perf_counter() after every optimizer step
A is torchrun's TORCHELASTIC_RESTART_COUNT, so a restarted worker writes new files.
"""

import importlib.util
import time

PROCESS_START = time.time()

import atexit  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import runpy  # noqa: E402
import sys  # noqa: E402

# A warm restart (the baked machinery/warmstart.py) runs this file again in a fork of the job's zygote: the worker
# torchrun started passes its start time on in the environment, and the zygote's copies of the hook and the exit
# function (registered by the first attempt before the fork) are removed or stay silent.
if "WARM_RESTART_WORKER_PID" not in os.environ:
    os.environ["PROBE_PROCESS_START"] = repr(PROCESS_START)
PROCESS_START = float(os.environ.get("PROBE_PROCESS_START", PROCESS_START))
SCRIPT = os.path.abspath(sys.argv[1]) if __name__ == "__main__" else ""
if SCRIPT:
    sys.path.insert(0, os.path.dirname(SCRIPT))  # what `python script.py` does
    # The script's first lines run before torch loads, as in `python script.py`: a baked train.py hands a
    # restarted rank to the zygote there. Its main part stays for run_path below (__name__ is not "__main__").
    spec = importlib.util.spec_from_file_location("_probed_script", SCRIPT)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))

import torch  # noqa: E402
from torch.optim.optimizer import register_optimizer_step_post_hook  # noqa: E402

OUT = os.environ.get("PROBE_DIR")
TAG = f"rank{os.environ.get('RANK', '0')}-attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
PID = os.getpid()
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
    if OUT and os.getpid() == PID:  # not in a fork that inherited this registration
        _write("steps", {"process_start": PROCESS_START, "steps": steps})


if getattr(torch, "_probe_hook", None) is not None:
    torch._probe_hook.remove()
torch._probe_hook = register_optimizer_step_post_hook(_after_step)
atexit.register(_at_exit)

if SCRIPT:
    sys.argv = [SCRIPT] + sys.argv[2:]
    runpy.run_path(SCRIPT, run_name="__main__")
