"""Workers that do not outlive their torchrun agent (exit_with_parent)."""

import ctypes
import logging
import os
import signal
import sys
import threading
import time

from . import identity

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
_watching = False


def _kill_self() -> None:
    os.kill(os.getpid(), getattr(signal, "SIGKILL", signal.SIGTERM))


def set_parent_death_signal() -> bool:
    """Ask Linux to SIGKILL this process when its parent dies; False where that is not available."""
    if not sys.platform.startswith("linux"):
        return False
    zero = ctypes.c_ulong(0)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(ctypes.c_int(PR_SET_PDEATHSIG), ctypes.c_ulong(signal.SIGKILL), zero, zero, zero) == 0:
            return True
        reason = os.strerror(ctypes.get_errno())
    except (OSError, AttributeError) as exc:
        reason = str(exc)
    log.debug("prctl(PR_SET_PDEATHSIG) is not available (%s): watching the parent process instead", reason)
    return False


def watch_parent(parent: int, interval: float = 1.0) -> threading.Thread:
    """A daemon thread that SIGKILLs this process once its parent is no longer `parent` (it died)."""

    def watch() -> None:
        while True:
            time.sleep(interval)
            if os.getppid() != parent:
                log.error("the parent process (pid %d) is gone: exiting", parent)
                _kill_self()

    thread = threading.Thread(target=watch, name="exit-with-parent", daemon=True)
    thread.start()
    return thread


def exit_with_parent() -> None:
    """Die (SIGKILL) when the process that started this one dies: under torchrun, the agent.

    A worker whose agent was SIGKILLed would otherwise keep training and committing snapshots with nobody to
    restart, stop or report it, holding the snapshot folder's lock. Call it once, early. On Linux the kernel sends
    the signal (PR_SET_PDEATHSIG) when the thread that started this process exits: torchrun starts its workers from
    its main thread, so that is the agent's exit. Elsewhere a daemon thread checks the parent every second.
    """
    global _watching
    parent = identity.first_parent()  # one that died before this call (the worker was importing) is caught below
    if set_parent_death_signal():
        if os.getppid() != parent:
            _kill_self()
        return
    if not _watching:
        _watching = True
        watch_parent(parent)
