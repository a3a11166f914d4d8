"""launch(): train from a notebook or a script on this machine's ranks, with torchrun's behaviour and no torchrun.

    from {{ cookiecutter.project_slug }}.launch import launch

    summary = launch(nproc_per_node=2, args=["--max-steps", "200"], max_restarts=2)

It runs torch's own elastic launcher (`torch.distributed.launcher.api`) in the calling process, as
`torchrun --standalone` does: fresh interpreters for the ranks, restarts from the newest snapshot. What it adds for a
notebook (README.md, "From a notebook or a script"): the ranks' output in the caller's sys.stdout and sys.stderr as
it comes, a failure as one exception naming its cause (`RunError` for a refused setting, also checked here before
any rank starts; `TrainingFailed`), and KeyboardInterrupt once an interrupt has stopped every rank with a snapshot.
Unlike mp.spawn, CUDA initialised in the caller, functions defined in a notebook and a script without an
`if __name__ == "__main__":` guard do not matter: the ranks are fresh interpreters.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shlex
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from . import warmstart
from .settings import RunError

PROJECT_ROOT = Path(__file__).resolve().parents[2]  # train.py sits beside the package
# One job at a time per process: a job swaps the process's streams and environment (threads share them)
_RUNNING = threading.Lock()


class TrainingFailed(RuntimeError):
    """A rank failed on every attempt. `rank`, `exitcode` and `cause` (one line) say which and why."""

    def __init__(self, cause: str, rank: int, exitcode: int):
        super().__init__(f"{cause} (rank {rank}, exit code {exitcode})")
        self.cause, self.rank, self.exitcode = cause, rank, exitcode


def launch(
    nproc_per_node: int = 1,
    args: Sequence[Any] | str = (),
    max_restarts: int = 0,
    *,
    log_dir: str | None = None,
) -> dict[str, Any] | None:
    """Train with `train.py`'s flags `args` in `nproc_per_node` ranks on this machine; return rank 0's summary.

    `max_restarts`: how often a failed job restarts from its newest snapshot (torchrun's --max-restarts).
    `log_dir`: keep every rank's full output there (`<log_dir>/<job>/attempt_<n>/<rank>/std{out,err}.log`);
    by default it goes to a temporary folder, removed at the end, after it was shown.
    Returns None when `args` asked for --help.
    """
    if isinstance(args, str):
        argv = shlex.split(args)
    elif isinstance(args, Iterable) and not isinstance(args, (bytes, Mapping)):
        argv = [str(arg) for arg in args]
    else:
        raise TypeError(
            f"launch(args=...) takes train.py's flags as a list (['--max-steps', '200']) or as one string "
            f"('--max-steps 200'), got {type(args).__name__} {args!r}"
        )
    if not isinstance(nproc_per_node, int) or nproc_per_node < 1:
        raise RunError(f"nproc_per_node must be a whole number >= 1, got {nproc_per_node!r}")
    if not isinstance(max_restarts, int) or max_restarts < 0:
        raise RunError(f"max_restarts must be a whole number >= 0, got {max_restarts!r}")
    cfg = _parse(argv)
    if cfg is None:
        return None
    script = PROJECT_ROOT / "train.py"
    if not script.is_file():
        raise RunError(f"launch() runs {script}, which does not exist (is the project installed without its files?)")

    import torch
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from .distributed import resolve_backend

    if resolve_backend(cfg.backend) == "nccl" and nproc_per_node > (gpus := torch.cuda.device_count()):
        raise RunError(
            f"nproc_per_node={nproc_per_node} with nccl needs {nproc_per_node} GPUs, this machine has {gpus}; "
            "use fewer ranks, or args=['--backend', 'gloo'] to train on CPU"
        )
    logs = log_dir or tempfile.mkdtemp(prefix="launch-")
    config = LaunchConfig(  # what `torchrun --standalone` sets up
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc_per_node,
        run_id=str(uuid.uuid4()),
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=max_restarts,
        monitor_interval=0.1,
        logs_specs=DefaultLogsSpecs(log_dir=logs, redirects=Std.ALL, tee=Std.NONE),
    )
    started = time.time()
    environment = {"OMP_NUM_THREADS": "1"} if nproc_per_node > 1 else {}  # as torchrun does
    if not _RUNNING.acquire(blocking=False):
        if log_dir is None:
            shutil.rmtree(logs, ignore_errors=True)
        raise RunError(
            "launch() is already running a job in this process (called from another thread): a job takes over the "
            "process's sys.stdout, sys.stderr and environment while it runs; wait for it to return, or start the "
            "second job in another process"
        )
    try:
        with _kept_signal_handlers(), _environment(environment), _shown(logs, config.run_id):
            elastic_launch(config, sys.executable)("-u", str(script), *argv)
    except SignalException as exc:  # the agent stopped every rank (each saved a snapshot first)
        if exc.sigval == signal.SIGINT:
            raise KeyboardInterrupt from None
        raise
    except ChildFailedError as exc:
        rank, exitcode, cause = _cause(exc)
        if cause.startswith(f"{RunError.__name__}: "):  # a setting refused by the ranks: the same error as here
            raise RunError(cause.split(": ", 1)[1]) from None
        raise TrainingFailed(cause, rank, exitcode) from None
    finally:
        warmstart.stop(os.getpid(), config.run_id)  # the agent was this process: the job's zygote stops with it
        _RUNNING.release()
        if log_dir is None:
            shutil.rmtree(logs, ignore_errors=True)
    export_dir = cfg.export_dir
    if "://" in export_dir:  # a store: rank 0's summary is also in its staging folder (snapshot/store.py)
        from .snapshot.store import staging_folder

        export_dir = f"{staging_folder(export_dir, 0)}-export"
    return _summary(Path(export_dir), started)


def _parse(argv: list[str]) -> Any:
    """The settings, or RunError with the one line train.py would print; None for --help (shown here)."""
    from .. import config

    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            return config.parse_args(argv)
    except SystemExit as exc:
        if not exc.code:
            print(out.getvalue(), end="")
            return None
        lines = [line for line in err.getvalue().splitlines() if line.strip()]
        message = lines[-1] if lines else f"bad arguments {argv}"
        raise RunError(message.split(": error: ", 1)[-1]) from None


@contextlib.contextmanager
def _kept_signal_handlers() -> Iterator[None]:
    """The agent installs its own SIGINT/SIGTERM/... handlers; give the caller (a notebook kernel) its own back."""
    handled = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)  # the agent's defaults
    main = threading.current_thread() is threading.main_thread()  # where handlers can be set
    kept = {signum: signal.getsignal(signum) for signum in handled} if main else {}
    try:
        yield
    finally:
        for signum, handler in kept.items():
            if handler is not None:
                signal.signal(signum, handler)


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """Set what the workers should inherit (unless the caller set it), and what the agent sets, back afterwards."""
    kept: dict[str, str | None] = {name: os.environ.get(name) for name in [*values, "TORCHELASTIC_SIGNALS_TO_HANDLE"]}
    for name, value in values.items():
        os.environ.setdefault(name, value)
    try:
        yield
    finally:
        for name, before in kept.items():
            if before is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = before


@contextlib.contextmanager
def _shown(log_dir: str, job: str) -> Iterator[None]:
    """Copy every rank's output files, as they grow, to the caller's sys.stdout and sys.stderr, whole lines only
    (rank 0 logs INFO and up, the other ranks their warnings and errors: logs.py)."""
    done = threading.Event()
    offsets: dict[Path, int] = {}

    def copy(final: bool = False) -> None:
        for path in sorted(Path(log_dir).glob(f"{job}_*/attempt_*/*/std*.log")):
            try:
                with open(path, "rb") as handle:
                    handle.seek(offsets.get(path, 0))
                    data = handle.read()
            except OSError:
                continue
            whole = data if final else data[: data.rfind(b"\n") + 1]  # a line being written: the next time
            offsets[path] = offsets.get(path, 0) + len(whole)
            if whole:
                stream = sys.stdout if path.name == "stdout.log" else sys.stderr
                text = whole.decode("utf-8", errors="replace")
                stream.write(text if text.endswith("\n") else text + "\n")
                stream.flush()

    def follow() -> None:
        while not done.wait(0.1):
            copy()

    thread = threading.Thread(target=follow, name="launch-output", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        copy(final=True)


def _cause(exc: Any) -> tuple[int, int, str]:
    """(rank, exit code, one line) of the failure that explains the others.

    A rank that failed on its own records its error (train.py, also for a refused setting); ranks stopped because
    of it record that they were (`peer`), and ranks killed by a signal record nothing. The earliest error of a
    rank's own wins, then a rank killed by a signal, then what a rank stopped by another says.
    """
    failures = exc.failures
    recorded = {rank: _recorded(f) for rank, f in failures.items()}  # (whose, first line)
    killed = [rank for rank, f in failures.items() if f.exitcode < 0]
    # SIGTERM is how the agent stops the survivors: a rank killed by another signal says more.
    by_signal = [rank for rank in killed if failures[rank].exitcode != -signal.SIGTERM]
    for ranks, says in (
        ([rank for rank in failures if recorded[rank][0] == "own"], lambda rank: recorded[rank][1]),
        (by_signal or killed, lambda rank: f"killed by {failures[rank].signal_name()}"),
        ([rank for rank in failures if recorded[rank][0] == "peer"], lambda rank: recorded[rank][1]),
    ):
        if ranks:
            rank = min(ranks, key=lambda r: (failures[r].timestamp, r))
            return rank, failures[rank].exitcode, says(rank)
    rank, failure = exc.get_first_failure()
    return rank, failure.exitcode, "failed without recording an error (its output above says why)"


def _recorded(failure: Any) -> tuple[str, str]:
    """Whose error a failed rank recorded ("own"; "peer": it stopped because of another rank; "": none), and the
    error's first line."""
    if not os.path.isfile(failure.error_file):
        return "", ""
    message = failure.message  # record()'s layout: {"message": "Kind: text", "extraInfo": {...}}, or a string
    extra = message.get("extraInfo", {}) if isinstance(message, dict) else {}
    lines = str(message.get("message", "") if isinstance(message, dict) else message).strip().splitlines()
    return "peer" if extra.get("peer") else "own", lines[0] if lines else "failed"


def _summary(export_dir: Path, started: float) -> dict[str, Any]:
    """Rank 0's summary.json of this launch: in the export folder, or in `<export-dir>.<run id>` where another
    live job held the folder (outputs.py)."""
    candidates = [export_dir / "summary.json", *export_dir.parent.glob(f"{export_dir.name}.*/summary.json")]
    written = []
    for path in candidates:
        with contextlib.suppress(OSError):  # gone meanwhile
            written.append((path.stat().st_mtime, path))
    written = [(mtime, path) for mtime, path in written if mtime >= started - 1]
    if not written:
        raise TrainingFailed(f"the run finished but rank 0 wrote no summary to {export_dir}", 0, 0)
    path = max(written)[1]
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise TrainingFailed(f"the run finished but its summary {path} cannot be read: {exc}", 0, 0) from None
