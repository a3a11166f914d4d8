"""Rank-aware logging: one clean console, and no rank's warning or error is ever lost.

- Rank 0 logs INFO and up to the console and to the log file.
- Other ranks are quiet on the console, but their warnings and errors show, tagged `[rank N]`, and go to the
  log file too.
- DEBUG_ALL_RANKS=1 turns every rank to DEBUG on the console.
- A log file name with `{rank}` in it (`--log-file logs/rank{rank}.log`) gives every rank its own full file.

Use `logs.get_logger(__name__)` and log as usual; nothing in the code needs to ask which rank it is on.
Records are formatted only where a handler takes them, so quiet ranks pay for nothing.
"""

import logging
import os
import sys

FORMAT = "%(asctime)s %(levelname)s [rank %(rank)s] %(name)s: %(message)s"
DATE_FORMAT = "%Y-%m-%d %H:%M:%S"
_HANDLER_MARK = "_rank_aware_handler"


class _RankFilter(logging.Filter):
    def __init__(self, rank):
        super().__init__()
        self.rank = rank

    def filter(self, record):
        record.rank = self.rank
        return True


class _ConsoleHandler(logging.StreamHandler):
    """Writes around a live tqdm bar instead of through it."""

    def emit(self, record):
        tqdm = sys.modules.get("tqdm")
        if tqdm is None:
            return super().emit(record)
        try:
            tqdm.tqdm.write(self.format(record), file=self.stream)
        except Exception:
            self.handleError(record)


def setup(rank, log_file="", level=logging.INFO):
    """Configure the root logger for this rank. Calling it again replaces, never duplicates, its handlers."""
    every_rank = os.environ.get("DEBUG_ALL_RANKS", "").lower() in ("1", "true", "yes")
    console_level = logging.DEBUG if every_rank else (level if rank == 0 else logging.WARNING)

    root = logging.getLogger()
    for handler in [h for h in root.handlers if getattr(h, _HANDLER_MARK, False)]:
        root.removeHandler(handler)
        handler.close()

    handlers = [_ConsoleHandler(sys.stderr)]
    handlers[0].setLevel(console_level)
    file_level = console_level
    if log_file:
        per_rank = "{rank}" in log_file
        path = log_file.replace("{rank}", str(rank))
        if per_rank:
            file_level = logging.DEBUG
        elif rank != 0:
            file_level = logging.WARNING  # other ranks add only their warnings to the shared file
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        file_handler = logging.FileHandler(path, mode="a", encoding="utf-8")
        file_handler.setLevel(file_level)
        handlers.append(file_handler)

    formatter = logging.Formatter(FORMAT, DATE_FORMAT)
    for handler in handlers:
        setattr(handler, _HANDLER_MARK, True)
        handler.setFormatter(formatter)
        handler.addFilter(_RankFilter(rank))
        root.addHandler(handler)
    lowest = min(console_level, file_level)
    root.setLevel(max(lowest, logging.INFO))  # other libraries' DEBUG chatter stays out
    logging.getLogger(__package__).setLevel(lowest)
    logging.captureWarnings(True)  # warnings.warn() from any rank shows up tagged, like a log record
    sys.excepthook = _excepthook


def get_logger(name):
    return logging.getLogger(name)


def log_failure(logger, exc):
    """Log an exception that is about to end this rank: once, tagged, with its traceback."""
    if isinstance(exc, KeyboardInterrupt):
        logger.warning("interrupted")
    else:
        logger.error("training failed", exc_info=exc)
        exc.already_logged = True


def _excepthook(kind, value, traceback, previous=sys.excepthook):
    if not getattr(value, "already_logged", False):  # already on the console, tagged with the rank
        previous(kind, value, traceback)
