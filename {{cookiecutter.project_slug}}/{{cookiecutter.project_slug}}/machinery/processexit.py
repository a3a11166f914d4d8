"""How a rank's process exits: as the interpreter would, without its last garbage collection (`run_and_exit`, for
train.py and warm children); a warm child's stand-in exits with the child's code or signal (`exit_as`)."""

import atexit
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import NoReturn


def debugged() -> bool:
    """Whether a debugger runs in this process (F5 starts each worker under debugpy)."""
    return sys.gettrace() is not None or "debugpy" in sys.modules or "pydevd" in sys.modules


def exit_as(code: int) -> NoReturn:
    """Exit with `code`, as waitstatus_to_exitcode() gives it (negative: killed by that signal)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError, AttributeError):  # closed, or replaced by None
            stream.flush()
    if code < 0:
        signum = -code
        if signum not in (getattr(signal, "SIGKILL", -1), getattr(signal, "SIGSTOP", -1)):
            signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        code = 128 + signum
    os._exit(code)


def run_and_exit(main: Callable[[], object]) -> None:
    """Run a script's `main`, then exit as the interpreter does (non-daemon threads joined, atexit functions run,
    the standard streams flushed) but without its last garbage collection over every object left: torch and dynamo
    leave millions, and that sweep costs a rank about a second at every exit, which torchrun waits for before it
    restarts a job whose peer died. Under a debugger, `main` runs and the interpreter exits as usual."""
    if debugged():
        main()
        return
    # On an exception, finish() runs inside the handler: the exception, and every frame it passed through, lives
    # until the process ends. Leaving the handler would free them: DDP's reducer would destroy the process group
    # while a gloo thread may still be releasing a finished collective's tensors, which takes the GIL this thread
    # holds. The two would wait for each other until torchrun's SIGKILL, 30 s after its SIGTERM (a destructor that
    # blocks with the GIL held: pytorch/pytorch#56297).
    try:
        main()
    except SystemExit as exc:
        finish(exit_code(exc))
    except KeyboardInterrupt:
        sys.excepthook(*sys.exc_info())
        finish(-signal.SIGINT)
    except BaseException:
        sys.excepthook(*sys.exc_info())
        finish(1)
    finish(0)


def exit_code(exc: SystemExit) -> int:
    """The exit code the interpreter gives a SystemExit (a message goes to stderr, with code 1)."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code & 0xFF
    print(exc.code, file=sys.stderr)
    return 1


def finish(code: int) -> NoReturn:
    """Exit as the interpreter does: wait for non-daemon threads, run the atexit functions, flush, exit."""
    with contextlib.suppress(Exception):  # exiting regardless
        threading._shutdown()  # type: ignore[attr-defined]  # the interpreter's own step (multiprocessing's too)
    try:
        atexit._run_exitfuncs()
    finally:
        exit_as(code)
