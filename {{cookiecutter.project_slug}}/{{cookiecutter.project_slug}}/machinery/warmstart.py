"""Warm restarts: a worker that torchrun restarts runs in a fork of a process that has imported torch already.

Local rank 0 of a job's first attempt forks a *zygote* right after its imports (`serve_restarts`). A restarted
worker hands its rank to it at the top of train.py (`handoff`) and stays on as the child's stand-in: it passes
torchrun's signals on to the child's process group and exits as the child exits. The zygote drops the project's own
modules, so each child imports them afresh. When restarts stay cold: docs/fault-tolerance.md, "Warm restarts".
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib
import json
import os
import runpy
import selectors
import signal
import socket
import struct
import sys
import threading
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from . import identity, parentdeath
from .processexit import debugged, exit_as, finish, run_and_exit

ENV_SWITCH = "WARM_RESTART"  # "0": every restart is cold
ENV_POOL = "WARM_START_POOL"  # names a standing zygote (serve_pool) that serves first starts too
POOL_ADDRESS = "\0warm-start-pool-"  # + its name: the pool's socket, in Linux's abstract namespace
NAME = "warm-restart"  # the zygote's process name (ps -o comm, top): it trains nothing itself
PR_SET_NAME = 15  # from <linux/prctl.h>
FORWARDED = tuple(
    getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1", "SIGUSR2") if hasattr(signal, name)
)
_LENGTH = struct.Struct("!I")


def enabled() -> bool:
    """Whether restarts here may be warm: Linux, not switched off, no debugger in this process."""
    return sys.platform.startswith("linux") and os.environ.get(ENV_SWITCH, "1").strip() != "0" and not debugged()


def _address(agent: int, run_id: str) -> str:
    """The zygote's socket (Linux's abstract namespace: no file to clean up): one per agent process and job."""
    key = f"{agent}:{identity.process_start(agent)}:{run_id}:{os.getuid()}"
    return "\0warm-restart-" + hashlib.sha256(key.encode()).hexdigest()[:24]


def _set_name(name: bytes) -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_NAME, ctypes.c_char_p(name[:15]), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _rewrite_command_line(args: list[str], scrub_environment: bool = False) -> None:
    """Rewrite what /proc/<pid>/cmdline shows (ps, pgrep -f) in place, as setproctitle does; optionally turn each
    /proc/<pid>/environ entry into `_=___` (its length kept). Else a tool that finds a job's ranks by command line
    and RANK takes the zygote, or a child of it, for a rank. Writes only where memory holds what /proc shows."""
    fields = identity.proc_stat(os.getpid())
    try:
        arg_start, arg_end, env_start, env_end = (int(fields[i]) for i in range(45, 49)) if fields else (0,) * 4
        shown, environment = (Path(f"/proc/self/{name}").read_bytes() for name in ("cmdline", "environ"))
    except (OSError, ValueError, IndexError):
        return
    size = arg_end - arg_start
    if size <= 0 or ctypes.string_at(arg_start, size) != shown[:size]:
        return
    wanted = "\0".join(args).encode(errors="replace")[: size - 1]
    ctypes.memmove(arg_start, wanted + b"\0" * (size - len(wanted)), size)
    size = env_end - env_start
    if scrub_environment and size > 0 and ctypes.string_at(env_start, size) == environment[:size]:
        entries = environment[:size].split(b"\0")
        scrubbed = [b"_=" + b"_" * (len(e) - 2) if len(e) >= 2 else b"_" * len(e) for e in entries]
        ctypes.memmove(env_start, b"\0".join(scrubbed)[:size], size)


def serve_restarts() -> None:
    """In local rank 0 of a torchrun job that may restart, after the heavy imports and before anything else: fork
    this machine's zygote (a copy of this process as it is now), once per job."""
    if os.environ.get("LOCAL_RANK") != "0" or identity.warm_child() or not identity.torchrun_worker() or not enabled():
        return
    restarts = os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0").strip()
    if not restarts.isdigit() or int(restarts) == 0 or not _forkable():
        return  # no restarts to serve, or nothing to keep
    agent = identity.agent_pid()
    if os.getppid() != agent:
        return  # the agent died while this worker started: no restart will come (exit_with_parent ends it)
    importlib.import_module("torch._dynamo")  # this worker imports it next anyway (distributed.init): 1-2 s of CPU
    for stream in (sys.stdout, sys.stderr):
        stream.flush()  # nothing buffered may be written twice
    listener = _listen(_address(agent, os.environ["TORCHELASTIC_RUN_ID"]))
    if listener is None:
        return  # this job's zygote is there already
    first = os.fork()
    if first:
        listener.close()
        os.waitpid(first, 0)
        return
    try:  # a new session, out of torchrun's reach (it signals each worker's process group), then the zygote
        os.setsid()
        if os.fork() == 0:
            _Zygote(listener, agent).run()
    finally:
        os._exit(0)


def handoff() -> None:
    """At the top of train.py: in a torchrun restart, run this rank in a child of the job's zygote, and exit as the
    child exits (this process stays as its stand-in); return at once where there is none (a cold start). With
    WARM_START_POOL set, first starts and `python train.py` too run in a child of that standing zygote (serve_pool).
    """
    pool = os.environ.get(ENV_POOL, "")
    if identity.warm_child() or not (pool or identity.torchrun_worker()) or not enabled():
        return
    if not pool and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") in ("", "0"):
        return  # a first attempt: no zygote yet
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    module = spec.name if spec is not None else None  # python -m package.module
    if module is None and not (sys.argv and os.path.isfile(sys.argv[0])):
        return
    agent = identity.agent_pid()
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(30)  # a zygote that does not answer: start cold
    try:
        conn.connect(POOL_ADDRESS + pool if pool else _address(agent, os.environ["TORCHELASTIC_RUN_ID"]))
        request = {
            "argv": sys.argv,
            "module": module,
            "cwd": os.getcwd(),
            "env": dict(os.environ),
            "executable": sys.executable,
            "agent": agent,
            "cmdline": Path("/proc/self/cmdline").read_bytes().decode(errors="replace").rstrip("\0").split("\0"),
        }
        message = _frame(request)
        conn.sendall(message[socket.send_fds(conn, [message], [0, 1, 2]) :])
        replies = conn.makefile("rb")
        reply = json.loads(replies.readline() or b"{}")
        if "pid" not in reply:
            raise ValueError(reply.get("refused") or "no reply")
    except ConnectionRefusedError:
        conn.close()
        return  # no zygote listens: a cold start
    except (OSError, ValueError) as problem:  # a refusal, or a zygote going away: a cold start, said
        conn.close()
        print(f"warm start: the zygote did not take this process ({problem!r}); it starts cold", file=sys.stderr)
        return
    conn.settimeout(None)
    parentdeath.exit_with_parent()  # the agent gone: this stand-in dies, and the zygote kills the child

    def forward(signum: int, frame: Any) -> None:
        try:
            conn.sendall(b"%d\n" % signum)
        except OSError:
            pass

    for signum in FORWARDED:
        signal.signal(signum, forward)
    line = replies.readline()
    exit_as(int(json.loads(line)["exit"]) if line else 1)


def stop(agent: int, run_id: str) -> None:
    """Stop the zygote of a job whose agent lives on (launch(): the agent is the caller's process)."""
    if not sys.platform.startswith("linux"):
        return
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        try:
            conn.connect(_address(agent, run_id))
            conn.sendall(_frame({"quit": True}))
            conn.recv(1)  # closed once the zygote has stopped
        except OSError:
            pass


def serve_pool(name: str, preload: tuple[str, ...] = ()) -> None:
    """Be a standing zygote named `name` while the parent process lives (a test session): every train.py started
    with WARM_START_POOL=name, first start or restart, under torchrun or not, runs in a fork of it and skips the
    imports (2-3 s of CPU). `preload`: more installed packages its runs use (transformers, ...), imported once here.
    Returns at once where it cannot serve."""
    if not enabled():
        return
    package = __name__.split(".")[0]
    for module in ("torch._dynamo", f"{package}.machinery.trainer", f"{package}.machinery.debugflags", *preload):
        importlib.import_module(module)  # what every run imports, installed packages included
    for module in (f"{package}.model", f"{package}.data"):
        try:  # and the packages the project's model and data use (transformers, datasets, ...)
            importlib.import_module(module)
        except Exception:  # noqa: BLE001, S112 - a run that imports it says what is wrong
            continue
    listener = _listen(POOL_ADDRESS + name) if _forkable() else None
    if listener is not None:  # else served already, or not to be forked
        _Zygote(listener, os.getppid(), pool=True).run()


def _forkable() -> bool:
    """Torch imported, one thread (a fork copies only the caller), no CUDA context (none survives fork())."""
    torch = sys.modules.get("torch")
    return torch is not None and threading.active_count() == 1 and not torch.cuda.is_initialized()


def _listen(address: str) -> socket.socket | None:
    """A socket listening at `address`, or None where another zygote listens there already."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(address)
        listener.listen(64)
    except OSError:
        listener.close()
        return None
    return listener


def _frame(request: dict[str, Any]) -> bytes:
    """A request to the zygote: its length, then its JSON."""
    payload = json.dumps(request).encode()
    return _LENGTH.pack(len(payload)) + payload


@dataclass
class _Client:
    conn: socket.socket
    child: int = 0
    pidfd: int = -1
    buffer: bytes = b""


class _Zygote:
    """One process per machine and job, single-threaded: forks a child per request, reports how it ended."""

    def __init__(self, listener: socket.socket, agent: int, pool: bool = False) -> None:
        self.listener = listener
        self.agent = agent  # the zygote lives as long as this process: the job's agent, or the pool's parent
        self.pool = pool  # serves any job (else only its agent's)
        self.selector = selectors.DefaultSelector()
        self.clients: dict[int, _Client] = {}  # by child pid
        self.pidfds = hasattr(os, "pidfd_open")
        self.name = Path("/proc/self/comm").read_bytes().strip()  # the interpreter's: the children take it back
        self.python_path = os.environ.get("PYTHONPATH", "")

    def run(self) -> None:
        _set_name(NAME.encode())
        title = f"{NAME} pool for pid {self.agent}" if self.pool else f"{NAME} for torchrun pid {self.agent}"
        _rewrite_command_line([title], scrub_environment=True)
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):  # hold none of the worker's pipes or log files open
            os.dup2(devnull, fd)
        os.close(devnull)
        for signum in FORWARDED:  # a scheduler's SIGTERM to every process: stay, so the children can save and exit
            signal.signal(signum, signal.SIG_IGN)
        _forget_project_modules()
        # Each registration's data is its handler; one that returns True stops the zygote.
        self.selector.register(self.listener, selectors.EVENT_READ, self._accept)
        agent_fd = self._pidfd(self.agent)
        if agent_fd >= 0:
            self.selector.register(agent_fd, selectors.EVENT_READ, lambda: True)
        started = identity.process_start(self.agent)
        stopping = False
        while not stopping:
            events = self.selector.select(timeout=None if self.pidfds and agent_fd >= 0 else 0.05)
            if agent_fd < 0 and not identity.process_alive(self.agent, started):
                break
            if not self.pidfds:
                self._reap_any()
            for key, _ in events:
                stopping |= bool(key.data())
        for client in list(self.clients.values()):
            _kill_group(client.child, signal.SIGKILL)

    def _pidfd(self, pid: int) -> int:
        if not self.pidfds:
            return -1
        try:
            return os.pidfd_open(pid)
        except OSError:
            self.pidfds = False  # kernel before 5.3: poll instead
            return -1

    def _accept(self) -> bool:
        """Serve one connection; True when it asks the zygote to stop."""
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return False
        pid, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        fds: list[int] = []
        try:
            if uid != os.getuid():
                raise OSError("another user")
            conn.settimeout(10)
            data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
            while len(data) < _LENGTH.size or len(data) < _LENGTH.size + _LENGTH.unpack_from(data)[0]:
                chunk = conn.recv(1 << 16)
                if not chunk:
                    raise OSError("short request")
                data += chunk
            request = json.loads(data[_LENGTH.size :])
            if request.get("quit"):
                conn.close()
                return True
            ours = self.pool or request.get("agent") == self.agent
            if len(fds) != 3 or request.get("executable") != sys.executable or not ours:
                _reply(conn, {"refused": "another interpreter or job"})
                raise OSError("refused")
        except (OSError, ValueError):
            for fd in fds:
                os.close(fd)
            conn.close()
            return False
        child = os.fork()
        if child == 0:
            self._become(conn, request, fds, pid)
        for fd in fds:
            os.close(fd)
        client = _Client(conn, child, self._pidfd(child))
        self.clients[child] = client
        conn.setblocking(False)
        _reply(conn, {"pid": child})
        self.selector.register(conn, selectors.EVENT_READ, partial(self._read, client))
        if client.pidfd >= 0:
            self.selector.register(client.pidfd, selectors.EVENT_READ, partial(self._reap, client))
        return False

    def _read(self, client: _Client) -> None:
        """Signals from the stand-in, passed to the child's group; the stand-in gone: SIGKILL the group."""
        try:
            data = client.conn.recv(4096)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            _kill_group(client.child, signal.SIGKILL)
            self.selector.unregister(client.conn)
            client.conn.close()
            return
        client.buffer += data
        *lines, client.buffer = client.buffer.split(b"\n")
        for line in lines:
            if line.strip().isdigit():
                _kill_group(client.child, int(line))

    def _reap(self, client: _Client) -> None:
        _, status = os.waitpid(client.child, 0)
        self._ended(client, status)

    def _reap_any(self) -> None:
        while self.clients:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if pid in self.clients:
                self._ended(self.clients[pid], status)

    def _ended(self, client: _Client, status: int) -> None:
        self.clients.pop(client.child, None)
        if client.pidfd >= 0:
            self.selector.unregister(client.pidfd)
            os.close(client.pidfd)
        if client.conn.fileno() >= 0:
            try:
                client.conn.setblocking(True)
            except OSError:
                pass  # gone: _reply finds it so too
            _reply(client.conn, {"exit": os.waitstatus_to_exitcode(status)})
            self.selector.unregister(client.conn)
            client.conn.close()

    def _become(self, conn: socket.socket, request: dict[str, Any], fds: list[int], stand_in: int) -> None:
        """In the forked child: become the restarted worker, run its script, exit as Python would."""
        code = 1
        try:
            self.selector.close()
            self.listener.close()
            for client in self.clients.values():
                client.conn.close()
                if client.pidfd >= 0:
                    os.close(client.pidfd)
            conn.close()
            os.setsid()  # its own process group, signalled as a whole like torchrun's workers
            _set_name(self.name)
            _rewrite_command_line(request["cmdline"])  # the stand-in's; the environ stays the zygote's: no RANK
            os.sched_setaffinity(0, os.sched_getaffinity(stand_in))  # the CPUs torchrun gave this rank's worker
            parentdeath.set_parent_death_signal()  # the zygote gone (the job over): so is this child
            for fd, target in zip(fds, (0, 1, 2), strict=True):
                os.dup2(fd, target)
                os.close(fd)
            os.chdir(request["cwd"])
            os.environ.clear()
            os.environ.update(request["env"])
            os.environ[identity.ENV_WORKER] = str(stand_in)
            os.environ[identity.ENV_AGENT] = str(request["agent"])
            _use_python_path(self.python_path, os.environ.get("PYTHONPATH", ""))
            for signum in FORWARDED:
                signal.signal(signum, signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL)
            sys.argv = argv = list(request["argv"])
        except BaseException:
            sys.excepthook(*sys.exc_info())
            finish(code)
        if request["module"]:
            run_and_exit(lambda: runpy.run_module(request["module"], run_name="__main__", alter_sys=True))
        else:
            sys.path[0] = str(Path(argv[0]).resolve().parent)  # what `python script.py` puts first
            run_and_exit(lambda: runpy.run_path(argv[0], run_name="__main__"))
        finish(0)


def _reply(conn: socket.socket, message: dict[str, Any]) -> None:
    """One line of JSON to a stand-in (handoff); one that is gone already is not waiting for it."""
    try:
        conn.sendall(json.dumps(message).encode() + b"\n")
    except OSError:
        pass


def _kill_group(pid: int, signum: int) -> None:
    try:
        os.killpg(pid, signum)
    except OSError:
        try:  # not yet its own group
            os.kill(pid, signum)
        except OSError:
            pass


def _use_python_path(before: str, now: str) -> None:
    """Put the request's PYTHONPATH in sys.path where the zygote's was, as a fresh interpreter would have it."""
    dropped = {form for entry in before.split(os.pathsep) if entry for form in (entry, os.path.abspath(entry))}
    sys.path[1:] = [entry for entry in sys.path[1:] if entry not in dropped]
    entries = [os.path.abspath(entry) for entry in now.split(os.pathsep) if entry]
    sys.path[1:1] = [entry for entry in entries if entry not in sys.path]


def _forget_project_modules() -> None:
    """Drop the modules imported from the project (this package, train.py, tests): each child imports them anew.
    Installed packages (under the interpreter's prefix or a site-packages folder) stay imported."""
    package = __name__.split(".")[0]
    root = Path(sys.modules[package].__file__ or ".").resolve().parents[1]
    script = Path(sys.argv[0]).resolve().parent if sys.argv and sys.argv[0] else root
    installed = {Path(p).resolve() for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if name == package or name.startswith(package + "."):
            del sys.modules[name]
        elif path and name != "__main__":
            resolved = Path(path).resolve()
            in_packages = "site-packages" in resolved.parts or "dist-packages" in resolved.parts
            if (
                not in_packages
                and installed.isdisjoint(resolved.parents)
                and (root in resolved.parents or script in resolved.parents)
            ):
                del sys.modules[name]
