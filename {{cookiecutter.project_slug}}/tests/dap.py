"""A small Debug Adapter Protocol client that drives debugpy the way VSCode does, without VSCode.

DAP messages are JSON bodies, each after a `Content-Length: N` header and a blank line, over a socket
(attach to a debugpy that listens) or over a process's stdin/stdout (`python -m debugpy.adapter`, as F5 does).
"""

import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

TIMEOUT = 60


class DAPError(AssertionError):
    pass


class Session:
    """One debug session: requests, their responses, events, and the adapter's requests to the client."""

    start_debugging = True  # say what VSCode says: subprocesses are reported as "startDebugging" requests

    def __init__(self, read, write, name):
        self.name = name
        self._read_stream, self._write = read, write
        self._seq = itertools.count(1)
        self._send_lock = threading.Lock()
        self._changed = threading.Condition()
        self._responses = {}
        self._events = []  # every event received, in order
        self._taken = set()  # indices of events already returned by wait_event
        self.closed = False
        self.reverse_handlers = {}  # adapter-to-client request -> function(arguments) -> response body
        self.terminals = []  # processes started for "runInTerminal"
        self.terminal_env = None  # the environment of that "terminal" (default: ours)
        self.terminal_log = None  # file for its output
        threading.Thread(target=self._reader, name=f"dap-{name}", daemon=True).start()

    @classmethod
    def connect(cls, host, port, name=None, timeout=TIMEOUT):
        deadline = time.monotonic() + timeout
        while True:
            try:
                sock = socket.create_connection((host, int(port)), timeout=5)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        sock.settimeout(None)
        reader = sock.makefile("rb")
        session = cls(reader.read, sock.sendall, name or f"{host}:{port}")

        def close():
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes the reader thread
            finally:
                sock.close()

        session._close = close
        return session

    @classmethod
    def adapter(cls, python=sys.executable, env=None, log_dir=None):
        """Start `python -m debugpy.adapter` and talk to it over its stdio, as VSCode does for a launch."""
        cmd = [python, "-m", "debugpy.adapter"] + (["--log-dir", str(log_dir)] if log_dir else [])
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, start_new_session=True)
        session = cls(proc.stdout.read, lambda data: (proc.stdin.write(data), proc.stdin.flush()), "adapter")
        session.process = proc

        def close():
            proc.stdin.close()  # the adapter ends when its client goes away
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

        session._close = close
        return session

    def close(self):
        """Close the connection, and end what was started "in the terminal" (the debuggee of a launch)."""
        try:
            self._close()
        except Exception:
            pass
        for proc in self.terminals:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    # Framing.

    def _send(self, message):
        body = json.dumps(message).encode()
        with self._send_lock:
            self._write(b"Content-Length: %d\r\n\r\n" % len(body) + body)

    def _receive(self):
        length = None
        line = b""
        while True:
            char = self._read_stream(1)
            if not char:
                return None
            line += char
            if line.endswith(b"\r\n"):
                if line == b"\r\n":
                    break
                key, _, value = line.decode().partition(":")
                if key.strip().lower() == "content-length":
                    length = int(value)
                line = b""
        body = b""
        while len(body) < length:
            chunk = self._read_stream(length - len(body))
            if not chunk:
                return None
            body += chunk
        return json.loads(body)

    def _reader(self):
        try:
            while (message := self._receive()) is not None:
                kind = message["type"]
                if kind == "request":
                    self._answer(message)
                    continue
                with self._changed:
                    if kind == "response":
                        self._responses[message["request_seq"]] = message
                    elif kind == "event":
                        self._events.append(message)
                    self._changed.notify_all()
        except (OSError, ValueError):
            pass
        finally:
            with self._changed:
                self.closed = True
                self._changed.notify_all()

    def _answer(self, request):
        handler = self.reverse_handlers.get(request["command"])
        if handler is None and request["command"] == "runInTerminal":
            handler = self._run_in_terminal
        try:
            if handler is None:
                raise DAPError(f"no handler for {request['command']}")
            body, success, error = handler(request.get("arguments", {})), True, None
        except Exception as exc:
            body, success, error = {}, False, str(exc)
        response = {
            "seq": next(self._seq),
            "type": "response",
            "request_seq": request["seq"],
            "success": success,
            "command": request["command"],
            "body": body,
        }
        if error:
            response["message"] = error
        self._send(response)

    def _run_in_terminal(self, arguments):
        """What VSCode's integrated terminal does: run the command in cwd with env added to the environment."""
        env = dict(self.terminal_env or os.environ)
        env.update({k: v for k, v in (arguments.get("env") or {}).items() if v is not None})
        out = open(self.terminal_log, "ab") if self.terminal_log else subprocess.DEVNULL
        proc = subprocess.Popen(
            arguments["args"],
            cwd=arguments.get("cwd"),
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.terminals.append(proc)
        return {"processId": proc.pid}

    # Requests and events.

    def send(self, command, **arguments):
        seq = next(self._seq)
        self._send({"seq": seq, "type": "request", "command": command, "arguments": arguments})
        return seq

    def response(self, seq, timeout=TIMEOUT):
        with self._changed:
            if not self._changed.wait_for(lambda: seq in self._responses or self.closed, timeout):
                raise DAPError(f"{self.name}: no response to request {seq} within {timeout} s")
            if seq not in self._responses:
                raise DAPError(f"{self.name}: connection closed before the response to request {seq}")
            message = self._responses.pop(seq)
        if not message["success"]:
            raise DAPError(f"{self.name}: {message['command']} failed: {message.get('message')} {message.get('body')}")
        return message.get("body", {})

    def request(self, command, timeout=TIMEOUT, **arguments):
        return self.response(self.send(command, **arguments), timeout)

    def wait_event(self, event, where=lambda body: True, timeout=TIMEOUT):
        """The body of the first event of this name (and matching `where`) not returned before."""

        def find():
            for index, message in enumerate(self._events):
                if index not in self._taken and message["event"] == event and where(message.get("body", {})):
                    self._taken.add(index)
                    return message.get("body", {})
            return None

        found = []

        def ready():
            body = find()
            if body is not None:
                found.append(body)
            return found or self.closed

        with self._changed:
            self._changed.wait_for(ready, timeout)
            if not found:
                seen = [message["event"] for message in self._events]
                raise DAPError(
                    f"{self.name}: no {event!r} event within {timeout} s (closed: {self.closed}; seen {seen})"
                )
        return found[0]

    def events(self, event):
        with self._changed:
            return [message.get("body", {}) for message in self._events if message["event"] == event]

    def describe(self, frames=6):
        """For a failure message: the events seen so far (but the many `output` and `module` ones) and, while
        connected, where each thread of the debuggee is (paused first, as VSCode's pause button does; a thread blocked
        outside Python cannot pause and says so). Short: an outer test shows only the tail of a failure."""
        with self._changed:
            seen = [m for m in self._events if m["event"] not in ("output", "module")]
        events = [(m["event"], *map(m.get("body", {}).get, ("reason", "threadId"))) for m in seen]
        lines = [f"{self.name}: closed {self.closed}; events {events}"]
        try:
            threads = [] if self.closed else self.request("threads", timeout=10)["threads"]
            if threads:
                self.request("pause", timeout=10, threadId=threads[0]["id"])
                time.sleep(1)
            for thread in threads:
                try:
                    stack = self.request("stackTrace", timeout=10, threadId=thread["id"], levels=frames)["stackFrames"]
                    files = [Path(frame.get("source", {}).get("path") or "?").name for frame in stack]
                    where = " <- ".join(f"{f['name']} {file}:{f['line']}" for f, file in zip(stack, files, strict=True))
                except DAPError as exc:
                    where = str(exc)
                lines.append(f"  thread {thread['id']} {thread['name']!r}: {where}")
        except DAPError as exc:
            lines.append(f"  {exc}")
        return "\n".join(lines)

    # What VSCode does to start a session and to look at a stopped thread.

    def start(self, command, configuration, breakpoints, timeout=TIMEOUT):
        """initialize, launch or attach, breakpoints, configurationDone: the order VSCode uses."""
        self.request(
            "initialize",
            clientID="vscode",
            clientName="Visual Studio Code",
            adapterID="debugpy",
            pathFormat="path",
            linesStartAt1=True,
            columnsStartAt1=True,
            supportsVariableType=True,
            supportsRunInTerminalRequest=True,
            supportsStartDebuggingRequest=self.start_debugging,
            locale="en",
        )
        start = self.send(command, **configuration)  # answered only after configurationDone
        self.wait_event("initialized", timeout=timeout)
        for path, lines in breakpoints.items():
            self.set_breakpoints(path, lines)
        self.request("setExceptionBreakpoints", filters=[])
        self.request("configurationDone")
        return self.response(start, timeout)

    def set_breakpoints(self, path, lines, condition=None):
        body = self.request(
            "setBreakpoints",
            source={"path": str(path)},
            breakpoints=[{"line": line, **({"condition": condition} if condition else {})} for line in lines],
        )
        return body["breakpoints"]

    def stopped_frame(self, timeout=TIMEOUT):
        """Wait for a `stopped` event; return (event body, top frame of the stopped thread)."""
        stopped = self.wait_event("stopped", timeout=timeout)
        frames = self.request("stackTrace", threadId=stopped["threadId"], startFrame=0, levels=20)["stackFrames"]
        return stopped, frames[0]

    def evaluate(self, expression, frame_id):
        return self.request("evaluate", expression=expression, frameId=frame_id, context="repl")["result"]


class Subprocesses:
    """Follow the subprocesses an adapter reports, as VSCode does: a new connection and session for each.

    Newer clients get a `startDebugging` request, older ones a `debugpyAttach` event; both carry an attach
    configuration with the adapter's address and the subprocess id.
    """

    def __init__(self, parent, breakpoints):
        self.parent = parent
        self.breakpoints = breakpoints
        self.sessions = []
        self.errors = []
        self._lock = threading.Lock()
        parent.reverse_handlers["startDebugging"] = self._start_debugging
        threading.Thread(target=self._follow_events, daemon=True).start()

    def _start_debugging(self, arguments):
        threading.Thread(target=self._attach, args=(arguments["configuration"],), daemon=True).start()
        return {}

    def _follow_events(self):
        while not self.parent.closed:
            try:
                config = self.parent.wait_event("debugpyAttach", timeout=1)
            except DAPError:
                continue
            threading.Thread(target=self._attach, args=(config,), daemon=True).start()

    def _attach(self, config):
        try:
            connect = config["connect"]
            session = Session.connect(connect["host"], connect["port"], name=f"subprocess {config['subProcessId']}")
            with self._lock:
                self.sessions.append(session)
            session.start("attach", config, self.breakpoints)
        except Exception as exc:
            with self._lock:
                self.errors.append(f"{config.get('subProcessId')}: {exc!r}")

    def wait_for(self, count, timeout=TIMEOUT):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if self.errors:
                    raise DAPError(f"attaching to a subprocess failed: {self.errors}")
                if len(self.sessions) >= count:
                    return list(self.sessions)
            if self.parent.events("terminated"):
                raise DAPError(f"the debuggee ended with {len(self.sessions)} of {count} subprocesses reported")
            time.sleep(0.05)
        raise DAPError(f"{len(self.sessions)} of {count} subprocesses reported within {timeout} s")

    def close(self):
        for session in self.sessions:
            session.close()
