"""Run a training script with a clock on each phase of a worker's start; the recovery benchmark's hook into a run.

    python recovery_probe.py SCRIPT [ARGS...]          (under torchrun)

With PROBE_DIR set, each worker writes `phases-rank{R}-attempt{A}.json` once its first optimizer step is done, with
the wall-clock time (time.time()) of:
    process_start       the probe's first line in the process torchrun started (the interpreter's own start-up
                        before it, ~0.03 s, is not counted)
    torch_imported      `import torch` done (the probe imports it first, as train.py would; after a warm restart's
                        hand-off, in the zygote's fork, where torch is imported already)
    warm                whether this rank runs in a fork of the zygote (a warm restart)
    process_group       torch.distributed.init_process_group returned (package imports, settings, rendezvous)
    snapshot_loaded     the last torch.load before the first step returned (the snapshot read; absent on a fresh
                        start)
    first_step          the first optimizer step done (building and wrapping the model, DDP's import of dynamo,
                        the first forward/backward)
    step_count          the optimizer's step counter after that step (the resumed step + 1)
A is torchrun's TORCHELASTIC_RESTART_COUNT. Nothing in the script changes.
"""

import time

_STARTED = time.time()

import json  # noqa: E402
import os  # noqa: E402
import runpy  # noqa: E402
import sys  # noqa: E402

# A warm restart (machinery/warmstart.py) runs this file again in a fork of the job's zygote: the stand-in that
# torchrun started hands its start time on in the environment, and the patches below replace the zygote's copies.
if "WARM_RESTART_WORKER_PID" not in os.environ:
    os.environ["PROBE_PROCESS_START"] = repr(_STARTED)
PHASES = {"process_start": float(os.environ.get("PROBE_PROCESS_START", _STARTED))}
SCRIPT = os.path.abspath(sys.argv[1]) if __name__ == "__main__" else ""
if SCRIPT:
    sys.path.insert(0, os.path.dirname(SCRIPT))  # what `python script.py` does
    import train  # noqa: E402, F401  # its first lines hand a restarted rank to the zygote, before torch loads

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.optim.optimizer import register_optimizer_step_post_hook  # noqa: E402

PHASES["torch_imported"] = time.time()
PHASES["warm"] = "WARM_RESTART_WORKER_PID" in os.environ
OUT = os.environ.get("PROBE_DIR")
TAG = f"rank{os.environ.get('RANK', '0')}-attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def _timed(module, name, phase):
    original = getattr(module, f"_probe_original_{name}", None) or getattr(module, name)
    setattr(module, f"_probe_original_{name}", original)

    def wrapper(*args, **kwargs):
        result = original(*args, **kwargs)
        if "first_step" not in PHASES:
            PHASES[phase] = time.time()
        return result

    setattr(module, name, wrapper)


_timed(dist, "init_process_group", "process_group")
_timed(torch, "load", "snapshot_loaded")


def _after_step(optimizer, args, kwargs):
    if "first_step" in PHASES:
        return
    PHASES["first_step"] = time.time()
    counts = [int(state["step"]) for state in optimizer.state.values() if "step" in state]
    PHASES["step_count"] = max(counts) if counts else None
    if OUT:
        path = os.path.join(OUT, f"phases-{TAG}.json")
        with open(path + ".tmp", "w") as handle:
            json.dump(PHASES, handle)
        os.replace(path + ".tmp", path)


if getattr(torch, "_probe_hook", None) is not None:
    torch._probe_hook.remove()
torch._probe_hook = register_optimizer_step_post_hook(_after_step)

if SCRIPT:
    sys.argv = [SCRIPT] + sys.argv[2:]
    runpy.run_path(SCRIPT, run_name="__main__")
