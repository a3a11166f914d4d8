"""Workers that do not outlive their torchrun agent.

exit_with_parent() makes a worker die when the process that started it (torchrun's agent) dies, so a SIGKILLed
agent does not leave workers training and committing snapshots on their own.
"""

import ctypes
import logging
import os
import signal
import sys
import threading
import time

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
_watching = False


def _kill_self() -> None:
    os.kill(os.getpid(), getattr(signal, "SIGKILL", signal.SIGTERM))


def set_parent_death_signal() -> bool:
    """Ask Linux to SIGKILL this process when its parent dies; False where that is not available."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        result = libc.prctl(
            ctypes.c_int(PR_SET_PDEATHSIG),
            ctypes.c_ulong(signal.SIGKILL),
            ctypes.c_ulong(0),
            ctypes.c_ulong(0),
            ctypes.c_ulong(0),
        )
    except (OSError, AttributeError) as exc:
        log.debug("prctl is not available (%s): watching the parent process instead", exc)
        return False
    if result != 0:
        log.debug(
            "prctl(PR_SET_PDEATHSIG) failed (%s): watching the parent process instead", os.strerror(ctypes.get_errno())
        )
        return False
    return True


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
    restart, stop or report it, and would hold the snapshot folder's lock. On Linux the kernel delivers the signal
    (prctl PR_SET_PDEATHSIG); elsewhere a daemon thread checks the parent every second. Call it once, early.
    Linux sends the signal when the thread that started this process exits: torchrun starts its workers from
    its main thread, so that is the agent's exit.
    """
    global _watching
    parent = os.getppid()  # before prctl: a parent that dies in between is caught below
    if set_parent_death_signal():
        if os.getppid() != parent:
            _kill_self()
        return
    if not _watching:
        _watching = True
        watch_parent(parent)
