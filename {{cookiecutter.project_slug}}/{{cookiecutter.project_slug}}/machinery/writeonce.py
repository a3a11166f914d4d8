"""write_once: a folder (a tokenized dataset, a download) made once, however many jobs on however many machines
ask for it at the same time.

Each caller builds into a temporary folder of its own beside the target and renames it into place; the rename is
atomic, so the target is all there or absent. When two jobs build at once, the first rename wins, and the other
discards its own copy and takes the winner's. A build killed midway leaves its temporary folder; the next call on
the same machine removes it once its process is gone.
"""

from __future__ import annotations

import errno
import os
import shutil
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path

from .identity import process_alive, process_start

MARK = ".partial-"  # between the target's name and the builder's host, pid and start time


def write_once(path: str | os.PathLike[str], build: Callable[[Path], object]) -> Path:
    """The folder `path`, made by `build(folder)` (which fills the empty `folder` it is given) unless it is there.

    Safe for jobs that call it at once on one cache: each builds into its own folder, and the target is whichever
    finished first, complete. An exception in `build` leaves no target and no temporary folder."""
    target = Path(path)
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned(target)
    host, pid = socket.gethostname(), os.getpid()
    prefix = f"{target.name}{MARK}{host}-{pid}-{process_start(pid) or 0}-"
    folder = Path(tempfile.mkdtemp(prefix=prefix, dir=target.parent))
    try:
        build(folder)
        try:
            os.rename(folder, target)
        except OSError as error:  # another job's folder is there already (not empty: ENOTEMPTY or EEXIST)
            if error.errno not in (errno.ENOTEMPTY, errno.EEXIST) or not target.is_dir():
                raise
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return target


def _remove_abandoned(target: Path) -> None:
    """Remove the temporary folders of builds on this machine whose process is gone (killed midway)."""
    host = socket.gethostname()
    for leftover in target.parent.glob(f"{target.name}{MARK}*"):
        try:
            owner, pid, started, _ = leftover.name[len(target.name) + len(MARK) :].rsplit("-", 3)
            alive = process_alive(int(pid), int(started) or None)
        except ValueError:
            continue  # not a name this module made
        if owner == host and not alive:
            shutil.rmtree(leftover, ignore_errors=True)
