"""A watch on the training thread: a rank that hangs leaves the others waiting in a collective until --dist-timeout.
Shortly before that, each waiting rank writes every thread's stack to `stacks-rank<N>.txt` beside the log file: the
rank whose file is missing, or whose stack is not in a collective, is the one that hung (docs/troubleshooting.md).
"""

import contextlib
import faulthandler
import logging
import os
import sys
import threading
import time

from . import logs

log = logging.getLogger(__name__)


class HangWatch:
    """Call `beat()` whenever the training thread makes progress; `close()` at the end."""

    def __init__(self, rank: int, after_s: float, log_file: str):
        self.rank, self.after_s = rank, after_s
        folder = os.path.dirname(logs.rank_file(log_file, rank)) if log_file else ""
        self.path = os.path.join(folder, f"stacks-rank{rank}.txt") if folder else ""
        self._last_beat = time.monotonic()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="hang-watch", daemon=True)
        self._thread.start()

    def beat(self) -> None:
        self._last_beat = time.monotonic()

    def close(self) -> None:
        self._closed.set()

    def _watch(self) -> None:
        reported = None
        while not self._closed.wait(min(5.0, self.after_s / 4)):
            beat = self._last_beat
            idle = time.monotonic() - beat
            if idle >= self.after_s and reported != beat:
                reported = beat
                self._dump(idle)

    def _dump(self, idle: float) -> None:
        header = (
            f"--- rank {self.rank}, pid {os.getpid()}, {time.strftime('%Y-%m-%d %H:%M:%S')}: no training step "
            f"finished for {idle:.0f} s; the stack of every thread follows ---\n"
        )
        with open(self.path, "a", encoding="utf-8") if self.path else contextlib.nullcontext(sys.stderr) as handle:
            handle.write(header)
            handle.flush()
            faulthandler.dump_traceback(file=handle, all_threads=True)
        log.warning(
            "no training step finished for %.0f s (a rank may hang; the job fails at --dist-timeout): the "
            "stacks of this rank's threads are in %s",
            idle,
            self.path or "the console",
        )
