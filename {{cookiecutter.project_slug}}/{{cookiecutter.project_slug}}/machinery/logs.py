"""Rank-aware logging: rank 0 logs INFO and up to the console and the log file; the other ranks' warnings and errors
show too, tagged `[rank N]`. DEBUG_ALL_RANKS=1 turns every rank to DEBUG on the console; `{rank}` in the log file's
name gives every rank its own full file. Use `logging.getLogger(__name__)`: no code asks which rank it is on.
"""

import logging
import os
import re
import sys
from typing import Any

FORMAT = "%(asctime)s %(levelname)s [rank %(rank)s] %(name)s: %(message)s"
DATE_FORMAT = "%Y-%m-%d %H:%M:%S"
_HANDLER_MARK = "_rank_aware_handler"
_START_MARK = "_rank_aware_start"  # where this process began writing its log file


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


def rank_file(log_file: str, rank: int) -> str:
    """This rank's --log-file, absolute: `{rank}` in the name becomes the rank ('' stays '')."""
    return os.path.abspath(log_file.replace("{rank}", str(rank))) if log_file else ""


def setup(rank: int, log_file: str = "", level: int = logging.INFO) -> None:
    """Configure the root logger for this rank. Calling it again replaces, never duplicates, its handlers."""
    every_rank = os.environ.get("DEBUG_ALL_RANKS", "").lower() in ("1", "true", "yes")
    console_level = logging.DEBUG if every_rank else (level if rank == 0 else logging.WARNING)

    root = logging.getLogger()
    for handler in [h for h in root.handlers if getattr(h, _HANDLER_MARK, False)]:
        root.removeHandler(handler)
        handler.close()

    handlers: list[logging.Handler] = [_ConsoleHandler(sys.stderr)]
    handlers[0].setLevel(console_level)
    # A file per rank holds everything; the other ranks add only their warnings to rank 0's.
    file_level = logging.DEBUG if "{rank}" in log_file else console_level if rank == 0 else logging.WARNING
    if log_file:
        path = rank_file(log_file, rank)
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            file_handler = logging.FileHandler(path, mode="a", encoding="utf-8")
        except OSError:
            pass  # the console only: the trainer's start-up check refuses a log file it cannot write, in one line
        else:
            file_handler.setLevel(file_level)
            setattr(file_handler, _START_MARK, os.path.getsize(file_handler.baseFilename))
            handlers.append(file_handler)

    def tag(record: logging.LogRecord) -> bool:  # this rank, even on a record that carries a "rank" of its own
        record.rank = rank
        return True

    formatter = logging.Formatter(FORMAT, DATE_FORMAT)
    for handler in handlers:
        setattr(handler, _HANDLER_MARK, True)
        handler.addFilter(tag)
        handler.setFormatter(formatter)
        root.addHandler(handler)
    lowest = min(console_level, file_level)
    root.setLevel(max(lowest, logging.INFO))  # other libraries' DEBUG chatter stays out
    logging.getLogger(__name__.split(".")[0]).setLevel(lowest)  # the whole project: train.py, yours, machinery
    logging.captureWarnings(True)  # warnings.warn() from any rank shows up tagged, like a log record
    sys.excepthook = _excepthook


def follow_moved_files() -> None:
    """Follow a log file whose folder was moved away (`--resume never` moves the snapshot folder aside, and the log
    file may lie in it): what this process wrote to it goes to a new file at the same path, and the moved file
    keeps only what was there before."""
    for handler in logging.getLogger().handlers:
        if not getattr(handler, _HANDLER_MARK, False) or not isinstance(handler, logging.FileHandler):
            continue
        stream = handler.stream
        if stream is None:
            continue
        try:
            if os.path.samestat(os.stat(handler.baseFilename), os.fstat(stream.fileno())):
                continue
        except FileNotFoundError:
            pass
        handler.acquire()
        try:
            stream.flush()
            start, ours = getattr(handler, _START_MARK, 0), b""
            try:  # the moved file, through this process's descriptor of it (Linux)
                with open(f"/proc/self/fd/{stream.fileno()}", "r+b") as moved:
                    moved.seek(start)
                    ours = moved.read()
                    if ours:
                        moved.truncate(start)
            except OSError:
                pass  # elsewhere its lines stay where they are
            stream.close()
            os.makedirs(os.path.dirname(handler.baseFilename), exist_ok=True)
            handler.stream = handler._open()
            setattr(handler, _START_MARK, os.fstat(handler.stream.fileno()).st_size)
            handler.stream.write(ours.decode("utf-8", errors="replace"))
            handler.stream.flush()
        finally:
            handler.release()


# What a collective or the process-group store raises on a rank whose peer vanished (killed, crashed, its
# machine gone): gloo's "Connection reset/closed by peer ... GLHF!", NCCL's "remote process exited", the
# store's "Connection was likely closed". Matched on RuntimeError (torch's Dist*Error included), never on
# OSError, so a network error of the rank's own (a download in the dataset) is not mistaken for one.
_PEER_LOST = re.compile(
    r"Connection (?:reset|closed) by (?:remote )?peer|Broken pipe|remote process exited"
    r"|Connection was likely closed|remote server shut ?down or crash|GLHF",
    re.IGNORECASE,
)


def warn_from_rank_0(logger: logging.Logger, is_main: bool, message: str, *args: Any) -> None:
    """A warning that every rank reaches alike (a setting, an agreed stop): rank 0 says it, the others at DEBUG."""
    logger.log(logging.WARNING if is_main else logging.DEBUG, message, *args)


def lost_peer(exc: BaseException) -> str | None:
    """Why `exc` (or an exception it wraps) means another rank is gone, as a short phrase; None when the failure is
    this rank's own."""
    seen = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, RuntimeError):
            found = _PEER_LOST.search(str(current))
            if found:
                return found.group(0) if found.group(0) != "GLHF" else "gloo lost a connection"
        current = current.__cause__ or current.__context__
    return None


def restart_note() -> str:
    """What happens next, from the variables torchrun gives its workers."""
    if "TORCHELASTIC_MAX_RESTARTS" not in os.environ:
        return "run the same command again to resume from the newest snapshot"
    restarts = int(os.environ["TORCHELASTIC_MAX_RESTARTS"])
    done = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    if done < restarts:
        return f"torchrun restarts the job from the newest snapshot (restart {done + 1} of {restarts})"
    return (
        f"torchrun has no restarts left (--max-restarts={restarts}): run the same command again to resume "
        "from the newest snapshot"
    )


def log_failure(
    logger: logging.Logger,
    exc: BaseException,
    peer: str | None = None,
    line: str | None = None,
    shown_by: int | None = None,
) -> None:
    """Log an exception that is about to end this rank, once: a failure of its own with its traceback, after `line`
    (what failed) when given; the one line alone when rank `shown_by` failed the same way first and shows that
    traceback (the traceback here at DEBUG). When it only says that another rank is gone, one warning naming `peer`
    (`rank N failed: ...`, when that rank left word), and the traceback at DEBUG: the rank that died has its own
    error to show."""
    if isinstance(exc, KeyboardInterrupt):
        logger.warning("interrupted")
        return
    if type(exc).__name__ == "BdbQuit" and type(exc).__module__ == "bdb":
        logger.warning("stopped from the debugger (pdb: quit)")
    elif (reason := lost_peer(exc)) is not None:
        what = f"{peer};" if peer else "it stopped, crashed or was killed,"
        logger.warning("lost another rank (%s): %s so this rank stops too; %s", reason, what, restart_note())
        logger.debug("the error that told this rank", exc_info=exc)
    elif shown_by is not None:
        logger.error("%s (as on rank %d, which shows the traceback)", line or "training failed", shown_by)
        logger.debug("the traceback on this rank", exc_info=exc)
    else:
        logger.error("%s", line or "training failed", exc_info=exc)
    exc.__dict__["already_logged"] = True  # read by the excepthook below: this failure is on the console


def _excepthook(kind, value, traceback, previous=sys.excepthook):
    if not getattr(value, "already_logged", False):  # already on the console, tagged with the rank
        previous(kind, value, traceback)
