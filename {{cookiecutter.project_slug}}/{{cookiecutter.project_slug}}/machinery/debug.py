"""Attach a debugger to chosen ranks of a torchrun job (docs/debugging.md).

    DEBUG_RANK=1 torchrun --standalone --nproc_per_node=2 train.py     # rank 1 waits for a debugger
    DEBUG_RANK=0,2 ... / DEBUG_RANK=all ...                             # several ranks, or every rank
    DEBUG_RANK=all DEBUG_POSTMORTEM=1 torchrun ... train.py            # a chosen rank that raises waits for one

A chosen rank listens on DEBUG_HOST:DEBUG_PORT+LOCAL_RANK and prints `rank N waiting for debugger on HOST:PORT`;
the others wait for it (a day's timeout while debugging). With no DEBUG_* variable set, debugpy is not imported.
"""

import ipaddress
import os
import sys

from . import baked, logs


def requested() -> bool:
    """True when a debugger is or may be attached to this process: collectives must then wait patiently."""
    return bool(os.environ.get("DEBUG_RANK")) or bool(os.environ.get("DEBUGPY_RUNNING"))


def chosen_ranks(value: str, world_size: int) -> set[int]:
    """The global ranks named by DEBUG_RANK: a number, a comma list, or `all`."""
    if value.strip().lower() == "all":
        return set(range(world_size))
    ranks = set()
    for part in value.split(","):
        part = part.strip()
        if not part.isdigit() or int(part) >= world_size:
            raise ValueError(
                f"DEBUG_RANK={value!r}: expected a rank in 0..{world_size - 1}, a comma list of them, or 'all'"
            )
        ranks.add(int(part))
    return ranks


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: assume it reaches other machines
        return False


def debug_address(local_rank: int) -> tuple[str, int]:
    host = os.environ.get("DEBUG_HOST", "127.0.0.1")
    base_text = os.environ.get("DEBUG_PORT", str(baked.DEBUG_PORT))
    if not base_text.isdigit() or not 1024 <= int(base_text) + local_rank <= 65535:
        raise ValueError(f"DEBUG_PORT={base_text!r}: expected an integer with 1024 <= DEBUG_PORT + local rank <= 65535")
    return host, int(base_text) + local_rank


def postmortem_requested() -> bool:
    return os.environ.get("DEBUG_POSTMORTEM", "").strip().lower() in ("1", "true", "yes")


def is_chosen(env, unset: bool = False) -> bool:
    """Whether DEBUG_RANK names this rank; `unset` when DEBUG_RANK is not set."""
    value = os.environ.get("DEBUG_RANK")
    return env.rank in chosen_ranks(value, env.world_size) if value else unset


def _listen(env, note: str = "") -> None:
    """Listen for a debugger on this rank's address and wait until one attaches."""
    host, port = debug_address(env.local_rank)
    if not is_loopback(host):
        print(
            f"[rank {env.rank}] WARNING: debugpy listens on {host}:{port}, reachable from other machines; "
            "whoever connects can run any code as you. Prefer 127.0.0.1 and an SSH tunnel.",
            file=sys.stderr,
            flush=True,
        )
    os.environ.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")  # quiets the frozen-modules warning
    import debugpy

    debugpy.configure(subProcess=False)  # DataLoader workers must not try to attach too
    try:
        debugpy.listen((host, port))
    except Exception as exc:  # debugpy reports a taken port as RuntimeError or OSError, by version
        raise RuntimeError(
            f"rank {env.rank} cannot listen for a debugger on {host}:{port}: {exc}. "
            f"Is the port taken (another job, or another rank on this machine)? Set DEBUG_PORT to a free base port."
        ) from exc
    print(f"rank {env.rank} waiting for debugger on {host}:{port}{note}", file=sys.stderr, flush=True)
    debugpy.wait_for_client()


def wait_for_debugger(env, at_start: bool = True) -> bool:
    """If DEBUG_RANK names this rank, wait for a debugger (`at_start` False: at --break-at-step's step instead).
    True when DEBUG_RANK is in effect: the ranks must then meet at a barrier (distributed.init does it), so that the
    ranks nobody debugs wait for the ones a debugger attaches to."""
    if not os.environ.get("DEBUG_RANK") or os.environ.get("DEBUGPY_RUNNING"):
        if postmortem_requested() and not os.environ.get("DEBUGPY_RUNNING") and env.rank == 0:
            print(
                "WARNING: DEBUG_POSTMORTEM=1 does nothing without DEBUG_RANK: set DEBUG_RANK=all (or the ranks "
                "to catch) as well",
                file=sys.stderr,
                flush=True,
            )
        return False
    if is_chosen(env) and at_start and not postmortem_requested():  # a bad DEBUG_RANK fails here, at start
        _listen(env)
    return True


def listen_at_break(env, step: int) -> None:
    """--break-at-step on a rank DEBUG_RANK names, with no debugger attached and none named by PYTHONBREAKPOINT:
    wait for a debugger now, so that the breakpoint() that follows stops in it (debugpy answers breakpoint() once
    imported)."""
    named_elsewhere = os.environ.get("DEBUGPY_RUNNING") or os.environ.get("PYTHONBREAKPOINT")
    if os.environ.get("DEBUG_RANK") and not named_elsewhere:
        _listen(env, note=f" (break at step {step})")


def post_mortem(env, exc: BaseException) -> None:
    """With DEBUG_POSTMORTEM=1, a rank chosen by DEBUG_RANK that `exc` is about to end waits for a debugger, which
    stops at the exception; returns once it detaches or continues (train.py's `main` then re-raises). Not for
    Ctrl-C, a quit from pdb, or a rank that only lost another rank: there the error to look at is elsewhere."""
    if not postmortem_requested() or os.environ.get("DEBUGPY_RUNNING"):
        return  # under F5 the debugger is already there: its "Uncaught Exceptions" breakpoint stops at the error
    if isinstance(exc, KeyboardInterrupt) or type(exc).__name__ == "BdbQuit" or logs.lost_peer(exc):
        return
    try:
        if not is_chosen(env):
            return
        _listen(env, note=" (post-mortem)")
    except (ValueError, RuntimeError) as problem:  # a bad DEBUG_RANK or a taken port: the error itself matters more
        print(f"[rank {env.rank}] no post-mortem debugging: {problem}", file=sys.stderr, flush=True)
        return
    import debugpy

    if hasattr(debugpy, "trigger_exception_handler"):  # newer debugpy: stop in the frame that raised
        debugpy.trigger_exception_handler(exc, as_uncaught=False)
    else:
        failed_with = exc  # noqa: F841 - older debugpy: stop here instead, with the exception in a local
        debugpy.breakpoint()
