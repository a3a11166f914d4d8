"""A user's bug reads as the user's bug: one line naming their function and line, on the rank where it happened
(docs/troubleshooting.md). The failing rank records its line as torchrun's error file (torchrun's summary and
launch() show it) and leaves it in the job's store before it leaves the process group, so that a rank that then
loses it reads there which rank failed and why.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import re
import socket
import time
import traceback
from pathlib import Path

from .settings import RunError

HOOK_TAG = "user_hook"  # the attribute hooks.py sets on an exception raised in a hook: (hook, file)
PACKAGE_DIR = Path(__file__).resolve().parents[1]  # model.py, data.py, config.py and anything else of the user's
MACHINERY_DIR = Path(__file__).resolve().parent
NOTICE_TIMEOUT = datetime.timedelta(seconds=2)
NOTICE_WAIT_S = 0.1  # how long a rank that lost a peer looks for the peer's notice in the store
REFUSAL_KEY = "ddp_template/refused"  # the start-up refusal of the job's last attempt (refused_before)
_FRAME = re.compile(
    r'^\s*File "(?P<path>[^"]+)", line (?P<line>\d+), in (?P<function>\S+)\n(?:\s{4,}(?P<code>\S.*))?', re.M
)
_WORKER = re.compile(r"^Caught (?P<type>\w+) in DataLoader worker process \d+\.\nOriginal Traceback", re.S)


class BadUserValue(RunError):
    """A value of the user's code refused on this rank; other ranks may have met another value."""


class PeerFailed(Exception):
    """This rank stops because another rank failed (the one-line reason names it)."""


def tag(exc: BaseException, hook: str, file: str) -> None:
    """Mark `exc` as raised in `hook` of `file` (the innermost hook, if hooks call each other)."""
    exc.__dict__.setdefault(HOOK_TAG, (hook, file))


def _is_users(path: str) -> bool:
    """A file of the user's package (model.py, data.py, ...), not of the machinery."""
    try:
        resolved = Path(path).resolve()
    except (OSError, ValueError):
        return False
    return resolved.is_relative_to(PACKAGE_DIR) and not resolved.is_relative_to(MACHINERY_DIR)


def _shown_path(path: str) -> str:
    try:
        return os.path.relpath(path)
    except ValueError:
        return path


def describe(exc: BaseException) -> str | None:
    """`<hook> in <file>.py raised <Type>: <message> (at <path>:<line>: <code>)` when `exc` came from the user's
    code (a hook, or a frame of model.py, data.py, ...), else None."""
    worker = _WORKER.match(str(exc))
    if worker:  # re-raised from a DataLoader worker: the original traceback is the message's text
        frames = [(m["path"], int(m["line"]), m["function"], m["code"] or "") for m in _FRAME.finditer(str(exc))]
        kind = worker["type"]
    else:
        frames = [(f.filename, f.lineno or 0, f.name, f.line or "") for f in traceback.extract_tb(exc.__traceback__)]
        kind = type(exc).__name__
    text = message(exc)
    users = [frame for frame in frames if _is_users(frame[0])]
    hook, file = getattr(exc, HOOK_TAG, (None, None))
    if hook is None:
        if not users:
            return None
        hook, file = users[0][2], Path(users[0][0]).stem  # the outermost of the user's frames: what was called
    text = text.strip().splitlines()[0] if text.strip() else ""
    line = f"{hook} in {file}.py raised {kind}" + (f": {text}" if text else "")
    if users:
        path, number, _, code = users[-1]  # the deepest: where it happened
        line += f" (at {_shown_path(path)}:{number}" + (f": {code.strip()})" if code.strip() else ")")
    return line


# -- telling torchrun, launch() and the other ranks ------------------------------------------------------------


def record(line: str, peer: bool = False) -> None:
    """Write this rank's one line as torchrun's error file (the layout of torch's ErrorHandler): torchrun's summary
    and launch() show it, where record() would show the traceback a second time. `peer`: this rank stops because
    of another one; its record is one second later, so the rank that failed first is the root cause."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    stamp = int(time.time()) + (1 if peer else 0)
    data = {"message": {"message": line, "extraInfo": {"py_callstack": line, "timestamp": str(stamp), "peer": peer}}}
    with contextlib.suppress(OSError), open(path, "w", encoding="utf-8") as handle:  # else torchrun shows the exit code
        json.dump(data, handle)


def message(exc: BaseException) -> str:
    """The exception's text; for one re-raised from a DataLoader worker, the original's (without the traceback)."""
    text = str(exc)
    if _WORKER.match(text):
        last = [line for line in text.rstrip().splitlines() if line and not line.startswith(" ")]
        if last and ": " in last[-1]:
            return last[-1].split(": ", 1)[1]
    return text


def _notice_key() -> str:
    return f"ddp_template/failed/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def _store():
    """A client of the job's store: torchrun's agent serves it (it outlives every rank), else rank 0."""
    if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        return None
    import torch.distributed as dist

    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    try:  # a plain connect first: a store that is gone refuses it at once, where a TCPStore client retries for long
        socket.create_connection((host, port), timeout=NOTICE_TIMEOUT.total_seconds()).close()
        return dist.TCPStore(host, port, is_master=False, timeout=NOTICE_TIMEOUT)
    except (RuntimeError, ValueError, OSError):
        return None


def refused_before(line: str) -> bool:
    """Whether an earlier attempt of this torchrun job stopped at start-up with this same line (rank 0's, kept in
    the job's store, which outlives the attempts); else keep it there for the next attempt."""
    store = _store()
    if store is None:
        return False
    with contextlib.suppress(RuntimeError, ValueError, OSError):
        if store.check([REFUSAL_KEY]) and store.get(REFUSAL_KEY).decode(errors="replace") == line:
            return True
        store.set(REFUSAL_KEY, line)
    return False


def announce(line: str, rank: int) -> int | None:
    """Leave `rank failed: line` in the job's store for the ranks that will lose this one (the first rank wins).
    Returns the other rank that left this same line first (every rank failed alike, e.g. on data of the wrong dtype:
    its traceback tells this one's too), else None."""
    store = _store()
    with contextlib.suppress(RuntimeError, ValueError, OSError):
        if store is not None:
            first = store.compare_set(_notice_key(), "", f"rank {rank} failed: {line}").decode(errors="replace")
            told = re.fullmatch(r"rank (\d+) failed: (.*)", first, re.S)
            if told and int(told.group(1)) != rank and told.group(2) == line:
                return int(told.group(1))
    return None


def failed_peer() -> str | None:
    """`rank N failed: ...` as the rank that failed first left it in the job's store, or None (it was killed)."""
    store = _store()
    if store is None:
        return None
    # It writes before it leaves the process group, that is before this rank can lose it: by now it is there, or it
    # was killed and never writes. The wait only covers the store's own latency.
    deadline = time.monotonic() + NOTICE_WAIT_S
    try:
        while not store.check([_notice_key()]):
            if time.monotonic() > deadline:
                return None
            time.sleep(0.05)
        return store.get(_notice_key()).decode(errors="replace")
    except (RuntimeError, ValueError, OSError):
        return None
