"""Debugging without VSCode, as docs/debugging.md tells it: pdb on one rank through
torch.distributed.breakpoint, a post-mortem stop at a rank's exception, and other debugpy clients (nvim-dap,
Emacs dap-mode) attaching to a rank started with DEBUG_RANK.
"""

import os
import re
import signal
import subprocess
import time

import dap
import pytest
from conftest import ROOT, child_env, free_port, outputs, train_cmd

from {{ cookiecutter.project_slug }}.machinery import baked

DIST_TIMEOUT = 2  # seconds: every wait below outlasts it, so the other ranks must be waiting on purpose
RUN = ["--wandb", "disabled", "--dist-timeout", str(DIST_TIMEOUT)]


class Job:
    """torchrun with its output in a file (debugpy's helper processes may hold a pipe open) and, if asked, a
    pipe to its stdin: what a user types in the terminal that runs it."""

    def __init__(self, cmd, env, log, stdin=False):
        self.log = log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                cmd,
                env=env,
                cwd=ROOT,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                start_new_session=True,
            )

    def output(self):
        return self.log.read_text(errors="replace")

    def wait_for(self, pattern, timeout=180):
        pattern = re.compile(pattern, re.M) if isinstance(pattern, str) else pattern
        deadline = time.monotonic() + timeout
        while True:
            found = pattern.search(self.output())
            if found:
                return found
            if self.proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"no line matching {pattern!r} (exit code {self.proc.poll()}):\n{self.output()[-6000:]}")
            time.sleep(0.05)

    def type(self, text):
        self.proc.stdin.write(text.encode())
        self.proc.stdin.flush()

    def finish(self, timeout=180):
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running after {timeout} s:\n{self.output()[-6000:]}")

    def close(self):
        """Kill torchrun and its workers, each in a session of its own, if still there."""
        if self.proc.poll() is None:
            from conftest import worker_pids

            for pid in worker_pids(self.proc.pid).values():
                os.kill(pid, signal.SIGKILL)
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        if self.proc.stdin:
            self.proc.stdin.close()


# torch.distributed.breakpoint: pdb on one rank, typed into the terminal.

BREAKING_TRAIN = '''
"""train.py, with torch.distributed.breakpoint(rank=1) called by every rank after its BREAK_AT-th optimizer step."""
import os
import sys

sys.path.insert(0, {root!r})
import torch
import torch.distributed
from torch.optim.optimizer import register_optimizer_step_post_hook

import train

BREAK_AT = int(os.environ["BREAK_AT"])
steps_done = 0


def break_once(optimizer, args, kwargs):
    global steps_done
    steps_done += 1
    if steps_done == BREAK_AT:
        torch.distributed.breakpoint(rank=1)  # every rank calls it; rank 1 stops in pdb, the others wait


register_optimizer_step_post_hook(break_once)
train.main(sys.argv[1:])
'''


def test_distributed_breakpoint_takes_pdb_commands_from_the_terminal(tmp_path, cleanup):
    script = tmp_path / "train_with_breakpoint.py"
    script.write_text(BREAKING_TRAIN.format(root=str(ROOT)))
    job = Job(
        train_cmd(2, ["--max-restarts=0"], script=script) + outputs(tmp_path) + RUN + ["--max-steps", "6"],
        child_env(BREAK_AT=3),
        tmp_path / "job.log",
        stdin=True,
    )
    cleanup.append(job)
    job.wait_for(r"\(Pdb\) ")
    time.sleep(DIST_TIMEOUT + 2)  # the user reads the code; rank 0 waits past --dist-timeout
    assert job.proc.poll() is None, job.output()[-6000:]

    job.type("up\n")  # from torch.distributed.breakpoint to the frame that called it
    job.type("p ('answer', steps_done, torch.distributed.get_rank())\n")
    job.type("c\n")
    assert job.finish() == 0, job.output()[-6000:]
    assert "('answer', 3, 1)" in job.output(), job.output()[-6000:]


# Post-mortem: a rank that raises waits for a debugger at the exception.

POSTMORTEM = re.compile(r"^rank (\d+) waiting for debugger on (\S+):(\d+) \(post-mortem\)$", re.M)


def test_post_mortem_stops_at_the_exception_then_the_job_fails(tmp_path, cleanup):
    port = free_port() - 1  # rank 1 listens on DEBUG_PORT + 1: a port just seen free
    env = child_env(
        DEBUG_RANK="all",
        DEBUG_POSTMORTEM=1,
        DEBUG_PORT=port,
        PYDEVD_DISABLE_FILE_VALIDATION=1,
        FAULT="raise_at_step",
        FAULT_RANK=1,
        FAULT_STEP=3,
    )
    job = Job(
        train_cmd(2, ["--max-restarts=0"], script="tests/fault_injection.py")
        + outputs(tmp_path)
        + RUN
        + ["--max-steps", "50"],
        env,
        tmp_path / "job.log",
    )
    cleanup.append(job)
    waiting = job.wait_for(POSTMORTEM)
    assert (waiting.group(1), waiting.group(2), int(waiting.group(3))) == ("1", "127.0.0.1", port + 1)
    assert len(re.findall(r"waiting for debugger", job.output())) == 1, "no rank waits before it fails"
    time.sleep(DIST_TIMEOUT + 2)  # rank 0 waits for rank 1 in a collective, past --dist-timeout
    assert job.proc.poll() is None, job.output()[-6000:]

    session = dap.Session.connect("127.0.0.1", port + 1, name="rank 1")
    cleanup.append(session)
    session.start("attach", {"connect": {"host": "127.0.0.1", "port": port + 1}, "justMyCode": True}, {})
    stopped, frame = session.stopped_frame()
    assert stopped["reason"] == "exception"
    info = session.request("exceptionInfo", threadId=stopped["threadId"])
    assert "injected failure on rank 1 at step 3" in info["description"], info
    assert frame["source"]["path"] == str(ROOT / "tests" / "fault_injection.py")  # where it was raised
    assert session.evaluate('__import__("os").environ["RANK"]', frame["id"]) == "'1'"

    session.request("disconnect")
    assert job.finish() != 0, job.output()[-6000:]
    assert len(POSTMORTEM.findall(job.output())) == 1, "rank 0, which only lost rank 1, must not wait"


# Other debugpy clients: what nvim-dap and Emacs dap-mode send, with the configurations docs/debugging.md gives.


def docs_snippet(language):
    """The one ```LANGUAGE block of the README and the docs (docs/debugging.md has them)."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    blocks = [block for page in pages for block in re.findall(rf"```{language}\n(.*?)```", page.read_text(), re.S)]
    assert len(blocks) == 1, f"README.md and docs/ should have one ```{language} block, have {len(blocks)}"
    return blocks[0]


def nvim_dap_attach():
    """The attach configuration of docs/debugging.md's nvim-dap snippet (Lua), as nvim-dap sends it."""
    lua = docs_snippet("lua")
    host = re.search(r'host\s*=\s*"([^"]+)"', lua).group(1)
    port = int(re.search(r"port\s*=\s*(\d+)", lua).group(1))
    return {
        "type": "python",
        "request": "attach",
        "name": "attach",
        "connect": {"host": host, "port": port},
        "justMyCode": True,
    }


def dap_mode_attach():
    """The attach configuration of docs/debugging.md's dap-mode snippet (Emacs Lisp), as dap-python turns it into a
    request: :connect becomes :host and :debugServer, and :args is added."""
    elisp = docs_snippet("elisp")
    host = re.search(r':host\s+"([^"]+)"', elisp).group(1)
    port = int(re.search(r":port\s+(\d+)", elisp).group(1))
    return {
        "type": "python",
        "request": "attach",
        "name": "attach",
        "host": host,
        "debugServer": port,
        "args": [],
        "justMyCode": True,
    }


class OtherClient(dap.Session):
    """A DAP client that is not VSCode: it introduces itself by its own name and asks for nothing VSCode-only."""

    def start(self, command, configuration, breakpoints, timeout=dap.TIMEOUT):
        self.request(
            "initialize",
            clientID=self.name,
            clientName=self.name,
            adapterID="python",
            pathFormat="path",
            linesStartAt1=True,
            columnsStartAt1=True,
        )
        start = self.send(command, **configuration)  # answered only after configurationDone
        self.wait_event("initialized", timeout=timeout)
        self.request("configurationDone")
        return self.response(start, timeout)


def pause_and_read_rank(session):
    """Pause the running rank wherever it is, read its rank, and let it run again."""
    session.request("pause", threadId=0)
    stopped, frame = session.stopped_frame()
    rank = session.evaluate('__import__("os").environ["RANK"]', frame["id"])
    session.request("continue", threadId=stopped["threadId"])
    return rank


def test_nvim_dap_and_dap_mode_attach_with_the_readme_configurations(tmp_path, cleanup):
    configs = {"nvim-dap": nvim_dap_attach(), "dap-mode": dap_mode_attach()}
    assert nvim_dap_attach()["connect"]["port"] == dap_mode_attach()["debugServer"] == baked.DEBUG_PORT
    port = free_port()  # the snippets' port, moved to a free one so that nothing else on this machine interferes
    job = Job(
        train_cmd(2, ["--max-restarts=0"]) + outputs(tmp_path) + RUN + ["--max-steps", "1000000"],
        child_env(DEBUG_RANK=0, DEBUG_PORT=port, PYDEVD_DISABLE_FILE_VALIDATION=1),
        tmp_path / "job.log",
    )
    cleanup.append(job)
    job.wait_for(rf"^rank 0 waiting for debugger on 127\.0\.0\.1:{port}$")

    for client, config in configs.items():
        config = (
            {**config, "connect": {"host": "127.0.0.1", "port": port}}
            if "connect" in config
            else {**config, "debugServer": port}
        )
        session = OtherClient.connect("127.0.0.1", port, name=client)
        cleanup.append(session)
        session.start("attach", config, {})
        assert pause_and_read_rank(session) == "'0'", client
        session.request("disconnect")
        session.close()
    assert job.proc.poll() is None, "the rank trains on after its debuggers leave:\n" + job.output()[-6000:]
