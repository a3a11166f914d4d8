"""Which process is which under torchrun: this rank's job, its worker and agent, whether a pid is still the same
process. A warm child (warmstart.py) answers as its stand-in, the worker torchrun started, would."""

import os
import socket

ENV_WORKER = "WARM_RESTART_WORKER_PID"  # in a warm child: the pid torchrun started for this rank (the stand-in)
ENV_AGENT = "WARM_RESTART_AGENT_PID"  # in a warm child: torchrun's agent
PID_MAX = 2**31 - 1  # the largest pid_t: a pid outside 1..PID_MAX names no process
# This process's parent when this module was first imported (at the top of train.py, before torch): torchrun's
# agent for a worker. os.getppid() names the reaper instead once the agent has died.
_FIRST_PARENT = os.getppid()


def torchrun_worker() -> bool:
    """Whether this process runs a rank of a torchrun job (as the worker torchrun started, or in a warm child)."""
    return "TORCHELASTIC_RUN_ID" in os.environ and "LOCAL_RANK" in os.environ


def warm_child() -> bool:
    """Whether this process is a warm child: a rank run in a fork of the job's zygote (warmstart.py)."""
    return ENV_WORKER in os.environ


def worker_pid() -> int:
    """The pid torchrun started for this rank: this process, or in a warm child its stand-in."""
    return int(os.environ.get(ENV_WORKER) or os.getpid())


def agent_pid() -> int:
    """The torchrun agent that started this rank's worker (its first parent, outside a warm child)."""
    return int(os.environ.get(ENV_AGENT) or _FIRST_PARENT)


def first_parent() -> int:
    """The process whose death should end this one: a warm child's zygote, else the parent this process started
    with (which may be dead already: then os.getppid() differs)."""
    return os.getppid() if warm_child() else _FIRST_PARENT


def current_job() -> str:
    """The torchrun job this process belongs to: TORCHELASTIC_RUN_ID, "" outside torchrun. torchrun's default id
    "none" is every job's without --rdzv-id, so the agent (which lives as long as the job) names it instead."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if run_id == "none":
        return f"none@{socket.gethostname()}:{agent_pid()}"
    return run_id


def boot_id() -> str:
    """This machine's boot: with the host name, it tells whether a pid recorded elsewhere is one of this machine's."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as handle:
            return handle.read().strip()
    except OSError:
        return ""


def proc_stat(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (state first), or None where there is none."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as handle:
            return handle.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def process_start(pid: int) -> int | None:
    """When a process started (clock ticks since boot): with its pid, it names one process, not a reused pid."""
    fields = proc_stat(pid)
    try:
        return int(fields[19]) if fields else None
    except (IndexError, ValueError):
        return None


def process_alive(pid: int, started: int | None) -> bool:
    """Whether `pid` on this machine is still the process that started at `started` (None: any process)."""
    if not 0 < pid <= PID_MAX:
        return False  # no process has it
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by another user
    fields = proc_stat(pid)
    if fields and fields[0] in ("Z", "X"):
        return False  # exited, not yet reaped by its parent
    if started is not None:
        now = process_start(pid)
        if now is not None and now != started:
            return False  # the pid was reused by another process
    return True
