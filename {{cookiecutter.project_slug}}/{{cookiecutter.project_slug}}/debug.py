"""Attach a debugger to chosen ranks of a torchrun job.

    DEBUG_RANK=1 torchrun --standalone --nproc_per_node=2 train.py     # rank 1 waits for a debugger
    DEBUG_RANK=0,2 ... / DEBUG_RANK=all ...                             # several ranks, or every rank

A chosen rank listens on DEBUG_HOST:DEBUG_PORT+LOCAL_RANK (default 127.0.0.1 and the port baked into the
project), prints `rank N waiting for debugger on HOST:PORT` and waits; then every rank meets at a barrier.
While debugging, the process group's timeout is a day, so the other ranks wait for a rank held at a
breakpoint instead of failing. Under VSCode's F5 ("torchrun (F5)") every rank already runs under the
debugger (DEBUGPY_RUNNING is set) and nothing here is needed. With no DEBUG_* variable set, debugpy is
not even imported.
"""

import ipaddress
import os
import sys

from . import baked


def requested():
    """True when a debugger is or may be attached to this process: collectives must then wait patiently."""
    return bool(os.environ.get("DEBUG_RANK")) or bool(os.environ.get("DEBUGPY_RUNNING"))


def chosen_ranks(value, world_size):
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


def is_loopback(host):
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: assume it reaches other machines
        return False


def debug_address(local_rank):
    host = os.environ.get("DEBUG_HOST", "127.0.0.1")
    base_text = os.environ.get("DEBUG_PORT", str(baked.DEBUG_PORT))
    if not base_text.isdigit() or not 1024 <= int(base_text) + local_rank <= 65535:
        raise ValueError(f"DEBUG_PORT={base_text!r}: expected an integer with 1024 <= DEBUG_PORT + local rank <= 65535")
    return host, int(base_text) + local_rank


def wait_for_debugger(env):
    """If DEBUG_RANK names this rank, listen for a debugger and wait for it; then all ranks meet."""
    value = os.environ.get("DEBUG_RANK")
    if not value or os.environ.get("DEBUGPY_RUNNING"):
        return
    from . import distributed  # imported here: distributed imports this module

    if env.rank in chosen_ranks(value, env.world_size):
        host, port = debug_address(env.local_rank)
        if not is_loopback(host):
            print(
                f"[rank {env.rank}] WARNING: debugpy listens on {host}:{port}, reachable from other machines; "
                "whoever connects can run any code as you. Prefer 127.0.0.1 and an SSH tunnel.",
                file=sys.stderr, flush=True,
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
        print(f"rank {env.rank} waiting for debugger on {host}:{port}", file=sys.stderr, flush=True)
        debugpy.wait_for_client()
    distributed.barrier(env)
