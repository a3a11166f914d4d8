"""Run train.py with a fault injected, for the tests. Use it in place of train.py (same arguments).

The fault is chosen by environment variables:
    FAULT=raise_at_step       rank FAULT_RANK raises at its FAULT_STEP-th optimizer step
    FAULT=nan_grad_at_step    rank FAULT_RANK's gradient of the model's first parameter turns NaN in the backward of
                              step FAULT_STEP (before the ranks average it), its loss still finite
    FAULT=nan_output_at_step  rank FAULT_RANK's last module with parameters of its own outputs NaN in the forward of
                              step FAULT_STEP (these two fire whenever the process trains that step: a replay too)
    FAULT=crash_in_save       rank FAULT_RANK is SIGKILLed halfway through writing FAULT_FILE ("rank" or
                              "manifest") of the snapshot of step FAULT_STEP, leaving a temp file behind
    FAULT=kill_after_commit   rank 0 is SIGKILLed right after it commits the snapshot of step FAULT_STEP
    FAULT=kill_after_save     rank FAULT_RANK is SIGKILLed right after it starts the snapshot of step FAULT_STEP,
                              before its next step (the rest of that save still being written in the background)
{%- if cookiecutter.replica_groups == "yes" %}
    FAULT=raise_in_quorum     (--fault-tolerance torchft) rank FAULT_RANK raises right after it starts its first
                              step's quorum, while torchft forms the quorum in its own thread
{%- endif %}
    FAULT=desync_at_step      rank FAULT_RANK rolls the elements of the tensor FAULT_TENSOR (a state_dict key of the
                              model) by one right after its FAULT_STEP-th optimizer step: replicas that drift apart
                              (--check-replicas) with the same values, in another order
    FAULT_ONCE=<path>         fire only if <path> does not exist (it is created on firing), so a restart runs clean
    NO_RNG_RESTORE=1          resume without restoring the random streams (to prove the resume test can fail)
    RUNNING_MEAN=1            the model gets a buffer of its own, `input_running_mean`, that each rank updates from
                              its own batch in every training forward (a user's running statistic; DDP gives every
                              rank rank 0's at the next forward), and a buffer no forward changes, `input_scale`
    COUNT_ALLREDUCE=1         print "gradient all-reduces: N" on rank 0 at exit
    SLOW_STEP=<seconds>       every optimizer step starts this much later (a job that trains on while a test waits
                              for something else, without taking a core for it)
    SLOW_COPY=<seconds>       every snapshot's copy off the training thread starts this much later
    SLOW_WRITE=<seconds>      every snapshot's files are written this much later (after the copy)
    RECORD_STARTS=<folder>    each rank writes start-rank{R}-attempt{A} there: "warm" when torch was imported
                              before this script began (a warm restart: the rank runs in a fork of the job's zygote,
                              machinery/warmstart.py), else "cold"
"""

import sys

PRELOADED = "torch" in sys.modules  # noqa: E402 - before this script imports anything heavy

import atexit
import os
import signal
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import train  # a restarted rank is handed to the job's zygote here, and this script runs again in its fork
from {{ cookiecutter.project_slug }}.machinery import checkpointer, parallel, snapshot, trainer, warmstart
from {{ cookiecutter.project_slug }}.machinery.snapshot import format, writer

FAULT = os.environ.get("FAULT", "")
RANK = int(os.environ.get("RANK", 0))
FAULT_RANK = int(os.environ.get("FAULT_RANK", 0))
FAULT_STEP = int(os.environ.get("FAULT_STEP", 0))

if os.environ.get("RECORD_STARTS"):
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    record = Path(os.environ["RECORD_STARTS"]) / f"start-rank{RANK}-attempt{attempt}"
    record.parent.mkdir(parents=True, exist_ok=True)
    record.write_text("warm" if PRELOADED else "cold")


def should_fire():
    marker = os.environ.get("FAULT_ONCE")
    if marker:
        if os.path.exists(marker):
            return False
        Path(marker).touch()
    return True


def die_halfway(path):
    """What a crash in the middle of a write leaves behind: a partial temp file, and no process."""
    with open(f"{path}.tmp-{os.getpid()}", "wb") as handle:
        handle.write(b"\0" * 1000)
        handle.flush()
        os.fsync(handle.fileno())
    os.kill(os.getpid(), signal.SIGKILL)


def in_target_save(path):
    return os.path.basename(os.path.dirname(path)) == snapshot.step_name(FAULT_STEP)


if FAULT == "raise_at_step" and RANK == FAULT_RANK:
    original_step = trainer.Trainer.optimizer_step
    calls = [0]

    def failing_step(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] == FAULT_STEP and should_fire():
            raise RuntimeError(f"injected failure on rank {RANK} at step {FAULT_STEP}")
        return original_step(self, *args, **kwargs)

    trainer.Trainer.optimizer_step = failing_step

if FAULT in ("nan_grad_at_step", "nan_output_at_step") and RANK == FAULT_RANK:
    # Step FAULT_STEP each time this process trains it (a replay of it too); FAULT_ONCE: in one process only.
    original_forward_backward = trainer.Trainer.forward_backward
    fires = []  # [] undecided, [True] or [False] once step FAULT_STEP first comes

    def poisoned_forward_backward(self, *args, **kwargs):
        hooks = []
        if self.progress.step + 1 == FAULT_STEP and (fires or fires.append(should_fire()) or fires)[0]:
            if FAULT == "nan_grad_at_step":
                hooks.append(next(self.model.parameters()).register_hook(lambda grad: grad * float("nan")))
            else:
                hooks.append(last_module_with_parameters(self.model).register_forward_hook(poison_output, prepend=True))
        try:
            return original_forward_backward(self, *args, **kwargs)
        finally:
            for hook in hooks:
                hook.remove()

    trainer.Trainer.forward_backward = poisoned_forward_backward


def last_module_with_parameters(model):
    """The last module, in named_modules() order, that holds parameters of its own (nan_output_at_step's)."""
    return [m for _, m in model.named_modules() if any(True for _ in m.parameters(recurse=False))][-1]


def poison_output(module, inputs, output):
    return output * float("nan")


if FAULT == "desync_at_step" and RANK == FAULT_RANK:
    import torch

    original_step = trainer.Trainer.optimizer_step
    calls = [0]

    def desyncing_step(self, *args, **kwargs):
        stepped = original_step(self, *args, **kwargs)
        calls[0] += 1
        if calls[0] == FAULT_STEP and should_fire():
            with torch.no_grad():
                tensor = self.model.state_dict()[os.environ["FAULT_TENSOR"]]
                tensor.copy_(tensor.flatten().roll(1).view_as(tensor))
        return stepped

    trainer.Trainer.optimizer_step = desyncing_step

if os.environ.get("RUNNING_MEAN"):
    import torch

    original_parallel = parallel.DistributedModel.__init__

    def update_running_mean(module, inputs):
        if module.training:
            with torch.no_grad():
                module.input_running_mean.mul_(0.9).add_(inputs[0].float().mean(), alpha=0.1)

    def with_running_mean(self, model, *args, **kwargs):
        model.register_buffer("input_running_mean", torch.zeros(()))
        model.register_buffer("input_scale", torch.arange(4.0))
        model.register_forward_pre_hook(update_running_mean)
        original_parallel(self, model, *args, **kwargs)

    parallel.DistributedModel.__init__ = with_running_mean

if FAULT == "crash_in_save" and RANK == FAULT_RANK:
    target = snapshot.MANIFEST if os.environ.get("FAULT_FILE") == "manifest" else snapshot.rank_file(RANK)
    original_write = format.write_atomic

    def crashing_write(path, write):
        if os.path.basename(path) == target and in_target_save(path) and should_fire():
            die_halfway(path)
        return original_write(path, write)

    format.write_atomic = writer.write_atomic = crashing_write  # receipts and manifest, and the state files

if FAULT == "kill_after_commit" and RANK == 0:
    original_commit = snapshot.Snapshots.commit

    def commit_then_die(self, folder, step, *args, **kwargs):
        original_commit(self, folder, step, *args, **kwargs)
        if step == FAULT_STEP and should_fire():
            os.kill(os.getpid(), signal.SIGKILL)

    snapshot.Snapshots.commit = commit_then_die
if FAULT == "kill_after_save" and RANK == FAULT_RANK:
    original_save = checkpointer.Checkpointer.save

    def save_then_die(self, *args, **kwargs):
        original_save(self, *args, **kwargs)
        if self.progress.step == FAULT_STEP and should_fire():
            os.kill(os.getpid(), signal.SIGKILL)

    checkpointer.Checkpointer.save = save_then_die
{% if cookiecutter.replica_groups == "yes" %}
if FAULT == "raise_in_quorum" and RANK == FAULT_RANK:
    from {{ cookiecutter.project_slug }}.machinery import replicas

    def start_step_then_fail(self, *args):
        self.manager.start_quorum()
        raise RuntimeError(f"injected failure on rank {RANK} while the quorum forms")

    replicas.ReplicaGroup.start_step = start_step_then_fail
{% endif %}
if os.environ.get("NO_RNG_RESTORE"):
    trainer.restore_rng = lambda state: None

if os.environ.get("COUNT_ALLREDUCE"):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    calls = [0]

    def counting_hook(state, bucket):
        calls[0] += 1
        return allreduce_hook(None, bucket)

    class CountingDDP(parallel.DistributedDataParallel):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.register_comm_hook(None, counting_hook)

    parallel.DistributedDataParallel = CountingDDP
    if RANK == 0:
        atexit.register(lambda: print(f"gradient all-reduces: {calls[0]}", flush=True))


def delayed(function, seconds):
    """`function`, called `seconds` later each time."""
    import time

    def late(*args, **kwargs):
        time.sleep(seconds)
        return function(*args, **kwargs)

    return late


if os.environ.get("SLOW_STEP"):
    trainer.Trainer.optimizer_step = delayed(trainer.Trainer.optimizer_step, float(os.environ["SLOW_STEP"]))

if os.environ.get("SLOW_COPY"):
    writer.copy_to_cpu = delayed(writer.copy_to_cpu, float(os.environ["SLOW_COPY"]))

if os.environ.get("SLOW_WRITE"):
    writer.write_atomic = delayed(writer.write_atomic, float(os.environ["SLOW_WRITE"]))

if __name__ == "__main__":
    warmstart.run_and_exit(lambda: train.main(sys.argv[1:]))  # as train.py ends
