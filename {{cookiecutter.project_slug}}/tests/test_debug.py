"""Debugging for real: debugpy over the Debug Adapter Protocol, torchrun on gloo, and no VSCode.

The client in dap.py does what VSCode does with .vscode/launch.json and tasks.json: it substitutes their
variables, runs the tasks, launches `python -m debugpy.adapter` or connects to a rank that listens, sets a
breakpoint in the training loop, and reads variables where it stops.
"""

import ast
import inspect
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import dap
import pytest
from conftest import (
    PACKAGE,
    QUICK,
    ROOT,
    child_env,
    final_model,
    finish,
    free_port,
    logged_steps,
    outputs,
    processes_naming,
    run,
    start,
    summary,
    train_cmd,
)
from jsonc import load_jsonc

from {{ cookiecutter.project_slug }}.machinery import baked, trainer

VSCODE = ROOT / ".vscode"
WAITING = re.compile(r"^rank (\d+) waiting for debugger on (\S+):(\d+)$", re.M)
SHORT = QUICK + ["--max-steps", "10"]


# VSCode's side: its files, their variables, its tasks.


def vscode_variables(workspace):
    """The values VSCode gives its predefined variables, with train.py as the file open in the editor."""
    file = workspace / "train.py"
    return {
        "workspaceFolder": str(workspace),
        "workspaceRoot": str(workspace),
        "workspaceFolderBasename": workspace.name,
        "file": str(file),
        "fileBasename": file.name,
        "fileBasenameNoExtension": file.stem,
        "fileExtname": file.suffix,
        "fileDirname": str(file.parent),
        "fileWorkspaceFolder": str(workspace),
        "relativeFile": file.name,
        "relativeFileDirname": "",
        "cwd": str(workspace),
        "userHome": os.path.expanduser("~"),
        "pathSeparator": os.sep,
        "lineNumber": "1",
        "command:python.interpreterPath": sys.executable,  # the interpreter selected in VSCode
    }


def resolve(value, workspace, inputs=(), choose=None):
    """Substitute ${...} as VSCode does; any variable VSCode could not resolve fails the test."""
    if isinstance(value, dict):
        return {key: resolve(item, workspace, inputs, choose) for key, item in value.items()}
    if isinstance(value, list):
        return [resolve(item, workspace, inputs, choose) for item in value]
    if not isinstance(value, str):
        return value
    known = vscode_variables(workspace)
    declared = {spec["id"]: spec for spec in inputs}

    def substitute(match):
        name = match.group(1)
        if name in known:
            return known[name]
        if name.startswith("env:"):
            return os.environ.get(name[4:], "")
        if name.startswith("input:") and name[6:] in declared:
            spec = declared[name[6:]]
            if spec["type"] == "promptString":  # what the user types; the default stands in for it
                return choose(spec) if choose else spec["default"]
            assert spec["type"] == "pickString", spec
            values = [option["value"] if isinstance(option, dict) else option for option in spec["options"]]
            chosen = choose(spec) if choose else spec.get("default", values[0])
            assert chosen in values, f"{chosen!r} is not an option of input {spec['id']}"
            return chosen
        raise AssertionError(f"VSCode cannot resolve {match.group(0)} in {value!r}")

    return re.sub(r"\$\{([^}]+)\}", substitute, value)


def launch_json():
    return load_jsonc(VSCODE / "launch.json")


def tasks_json():
    return load_jsonc(VSCODE / "tasks.json")


def configuration(name):
    found = [config for config in launch_json()["configurations"] if config["name"] == name]
    assert len(found) == 1, f"launch.json needs exactly one configuration named {name!r}"
    return found[0]


def task(label):
    found = [spec for spec in tasks_json()["tasks"] if spec["label"] == label]
    assert len(found) == 1, f"tasks.json needs exactly one task labelled {label!r}"
    return found[0]


def baked_ranks():
    """The ranks of one machine, and the base debug port, that the configurations were made for."""
    return list(range(baked.NPROC_PER_NODE)), baked.DEBUG_PORT


def body_lines(function):
    """The source file of `function` and the first lines of the statements of its body (its docstring left out)."""
    source, first = inspect.getsourcelines(function)
    definition = ast.parse(textwrap.dedent("".join(source))).body[0]
    body = definition.body[1:] if ast.get_docstring(definition) is not None else definition.body
    return Path(inspect.getsourcefile(function)).resolve(), [first + statement.lineno - 1 for statement in body]


def step_breakpoints(root=ROOT):
    """(file, first line, second line): the first two statements of Trainer.optimizer_step, where the tests stop.

    Every rank runs it once per optimizer step. Found by function, so edits elsewhere in trainer.py don't move it.
    `root` is this project or a copy of it (the workspace "opened in VSCode"), whose file has the same lines.
    """
    source, lines = body_lines(trainer.Trainer.optimizer_step)
    assert len(lines) >= 2, f"Trainer.optimizer_step in {source} needs two statements for the tests' breakpoints"
    return root / source.relative_to(ROOT), lines[0], lines[1]


def flag_value(args, flag, default):
    """The value of `flag` in an argument list (the last one wins, as in argparse), or `default`."""
    value = default
    for index, arg in enumerate(args):
        if arg == flag and index + 1 < len(args):
            value = args[index + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


def workspace_copy(tmp_path):
    """A copy of the project to open "in VSCode": debug runs write their snapshots and logs there, not here."""
    workspace = tmp_path / ROOT.name
    workspace.mkdir()
    shutil.copy(ROOT / "train.py", workspace)
    for folder in (PACKAGE, ".vscode"):
        shutil.copytree(ROOT / folder, workspace / folder, ignore=shutil.ignore_patterns("__pycache__"))
    return workspace


# The job's side.


class Job:
    """A run whose output goes to a file: a pipe could be held open by debugpy's adapter after the job ends."""

    def __init__(self, cmd, env, log, cwd=ROOT):
        self.log = log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                cmd, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )

    def output(self):
        return self.log.read_text(errors="replace")

    def wait_for(self, pattern, count=1, timeout=120):
        """The first `count` matches of pattern in the output, waiting for them."""
        pattern = re.compile(pattern, re.M) if isinstance(pattern, str) else pattern
        deadline = time.monotonic() + timeout
        while True:
            found = list(pattern.finditer(self.output()))
            if len(found) >= count:
                return found[:count]
            if self.proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(
                    f"{len(found)} of {count} lines matching {pattern!r} (exit code {self.proc.poll()}):\n"
                    f"{self.output()[-6000:]}"
                )
            time.sleep(0.05)

    def finish(self, timeout=120, sessions=()):
        """The job's exit code; past `timeout`, a failure that says which of its processes are left, and where the
        debugged ones are (`sessions`)."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            debuggees = [event.get("systemProcessId") for s in sessions for event in s.events("process")]
            left = "\n".join([*processes_left(str(self.log.parent), debuggees), *(s.describe() for s in sessions)])
            self.kill()
            pytest.fail(f"still running after {timeout} s:\n{self.output()[-6000:]}\n{left}")

    def kill(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def processes_left(text, pids=()):
    """A line per process whose command line has `text` or whose pid is in `pids` (a warm start's child shows only
    the start of its stand-in's command line), and per child of one: its pid, parent, state and the kernel function
    it waits in."""

    def read(path):
        try:
            return Path(path).read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            return ""

    named = list(dict.fromkeys(processes_naming(text) + [int(pid) for pid in pids if pid]))
    tasks = [task for pid in named for task in Path(f"/proc/{pid}/task").glob("*")]  # a child is its thread's
    children = [int(child) for task in tasks for child in read(task / "children").split()]
    lines = []
    for pid in named + children:
        state, parent = (read(f"/proc/{pid}/stat").rsplit(")", 1)[-1].split() or ["gone", "?"])[:2]
        wchan, cmdline = read(f"/proc/{pid}/wchan") or "-", read(f"/proc/{pid}/cmdline")[:100]
        lines.append(f"pid {pid} (parent {parent}) {state} in {wchan}: {cmdline}")
    return lines


def attach(port, breakpoints, cleanup):
    """Attach to a rank that waits for a debugger, as the attach configurations do."""
    session = dap.Session.connect("127.0.0.1", port, name=f"port {port}")
    cleanup.append(session)
    session.start("attach", {"connect": {"host": "127.0.0.1", "port": port}, "justMyCode": True}, breakpoints)
    return session


def resume(session, source):
    """Clear the breakpoints and continue, as a user does once done with a rank."""
    session.set_breakpoints(source, [])
    session.request("continue", threadId=0)


# The configuration files.


def test_vscode_files_parse_and_every_variable_resolves(tmp_path):
    ranks, base_port = baked_ranks()
    launch, tasks = launch_json(), tasks_json()
    inputs = launch.get("inputs", [])
    labels = {spec["label"] for spec in tasks["tasks"]}
    names = [config["name"] for config in launch["configurations"]]
    assert len(names) == len(set(names))
    expected = {"torchrun (F5)", "Attach to rank N", "Python: current file", "pytest"}
    assert expected | {f"Debug rank {rank}" for rank in ranks} <= set(names)
    for config in launch["configurations"]:
        assert config["type"] == "debugpy", config["name"]  # the current Python debugger, not the old "python"
        assert "python" not in config and "pythonPath" not in config, "use the interpreter selected in VSCode"
        assert config.get("preLaunchTask") in labels | {None}
        resolve(config, tmp_path, inputs)
    for spec in tasks["tasks"]:
        resolved = resolve(spec, tmp_path)
        assert resolved.get("command") == sys.executable, "tasks run the interpreter selected in VSCode"
        assert not spec.get("dependsOn") or spec["dependsOn"] in labels

    f5 = configuration("torchrun (F5)")
    assert (f5["request"], f5["module"], f5.get("subProcess")) == ("launch", "torch.distributed.run", True)
    assert f5["args"][:4] == [
        "--standalone",
        f"--nproc_per_node={len(ranks)}",
        "--max-restarts=0",
        "${workspaceFolder}/train.py",
    ]

    # "Attach to rank N" asks which rank and connects to that rank's port.
    attach_config = configuration("Attach to rank N")
    picks = {}
    for rank in ranks:

        def choose(spec, rank=rank):
            option = next(o for o in spec["options"] if re.search(rf"\brank {rank}\b", o["label"]))
            return option["value"]

        picks[rank] = resolve(attach_config, tmp_path, inputs, choose)["connect"]
    assert {rank: (c["host"], int(c["port"])) for rank, c in picks.items()} == {
        rank: ("127.0.0.1", base_port + rank) for rank in ranks
    }

    # "Debug rank N": its task runs torchrun with DEBUG_RANK=N; it attaches to N's port once N says so.
    for rank in ranks:
        config = configuration(f"Debug rank {rank}")
        assert config["request"] == "attach"
        assert (config["connect"]["host"], int(config["connect"]["port"])) == ("127.0.0.1", base_port + rank)
        spec = task(config["preLaunchTask"])
        assert spec["isBackground"] and spec["options"]["env"]["DEBUG_RANK"] == str(rank)
        assert spec["options"]["env"]["DEBUG_PORT"] == str(base_port)
        assert spec["args"][:5] == [
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={len(ranks)}",
            "--max-restarts=0",
        ]
        background = spec["problemMatcher"]["background"]
        assert background["activeOnStart"]
        ready = f"rank {rank} waiting for debugger on 127.0.0.1:{base_port + rank}"
        assert re.search(background["endsPattern"], ready)
        for other in ranks + [rank + 10, rank * 10 + 1]:  # rank 1's task must not take rank 11's line
            if other != rank:
                assert not re.search(background["endsPattern"], f"rank {other} waiting for debugger on 127.0.0.1:1")
        # VSCode tries beginsPattern first and skips endsPattern on a line that matched it.
        assert not re.search(background["beginsPattern"], ready)

    settings = load_jsonc(VSCODE / "settings.json")
    assert settings["python.testing.pytestEnabled"] is True
    extensions = load_jsonc(VSCODE / "extensions.json")["recommendations"]
    assert {"ms-python.python", "ms-python.debugpy"} <= set(extensions)


# Attach to chosen ranks (DEBUG_RANK).


def test_attach_to_rank_2_of_3_outlives_the_collective_timeout(tmp_path, cleanup):
    source, line, _ = step_breakpoints()
    port, dist_timeout = free_port(3), 2  # rank 2 listens on port + 2
    started = time.monotonic()
    job = Job(
        train_cmd(3) + SHORT + ["--dist-timeout", str(dist_timeout)] + outputs(tmp_path),
        child_env(DEBUG_RANK=2, DEBUG_PORT=port, PYDEVD_DISABLE_FILE_VALIDATION=1),
        tmp_path / "job.log",
    )
    cleanup.append(job)
    (announced,) = job.wait_for(WAITING)
    assert announced.group(0) == f"rank 2 waiting for debugger on 127.0.0.1:{port + 2}"

    session = attach(port + 2, {source: [line]}, cleanup)
    stopped, frame = session.stopped_frame()
    print(f"\nattach: {time.monotonic() - started:.1f} s from launch to the first stop")
    assert stopped["reason"] == "breakpoint"
    assert (frame["source"]["path"], frame["line"]) == (str(source), line)
    assert session.evaluate('__import__("os").environ["RANK"]', frame["id"]) == "'2'"
    assert session.evaluate("self.env.rank, self.env.world_size", frame["id"]) == "(2, 3)"
    assert session.evaluate("self.progress.step", frame["id"]) == "0", "it waited for the debugger before step 1"

    # Ranks 0 and 1 wait for rank 2 inside a collective; they must not give up at --dist-timeout.
    time.sleep(dist_timeout + 2)
    assert job.proc.poll() is None, job.output()[-6000:]
    resume(session, source)
    assert job.finish(sessions=[session]) == 0, job.output()[-6000:]
    session.request("disconnect")
    output = job.output()
    assert [m.group(0) for m in WAITING.finditer(output)] == [announced.group(0)], "only rank 2 waits"
    done = summary(tmp_path)
    assert (done["world_size"], done["steps"]) == (3, 10)


def test_debug_rank_all_stops_every_rank_and_a_rank_condition_stops_one(tmp_path, cleanup):
    source, line, second = step_breakpoints()
    port = free_port(2)  # rank 1 listens on the next one
    job = Job(
        train_cmd(2) + SHORT + outputs(tmp_path),
        child_env(DEBUG_RANK="all", DEBUG_PORT=port, PYDEVD_DISABLE_FILE_VALIDATION=1),
        tmp_path / "job.log",
    )
    cleanup.append(job)
    lines = job.wait_for(WAITING, count=2)
    assert sorted((m.group(1), int(m.group(3))) for m in lines) == [("0", port), ("1", port + 1)]

    sessions = [attach(port + rank, {source: [line]}, cleanup) for rank in (0, 1)]
    ranks = set()
    for session in sessions:
        _, frame = session.stopped_frame()
        assert frame["line"] == line
        ranks.add(session.evaluate("self.env.rank", frame["id"]))
    assert ranks == {"0", "1"}

    # The conditional breakpoint of docs/debugging.md: only rank 1 stops on the next line.
    for session in sessions:
        session.set_breakpoints(source, [second], condition='__import__("os").environ["RANK"] == "1"')
        session.request("continue", threadId=0)
    _, frame = sessions[1].stopped_frame()
    assert frame["line"] == second
    assert sessions[1].evaluate("self.env.rank", frame["id"]) == "1"
    resume(sessions[1], source)
    assert job.finish(sessions=sessions) == 0, job.output()[-6000:]
    for session in sessions:
        session.request("disconnect")
    assert len(sessions[0].events("stopped")) == 1, "rank 0 must not stop where the condition is false"


def test_break_at_step_stops_the_debugger_where_batch_model_and_step_are(tmp_path, cleanup):
    """DEBUG_RANK with --break-at-step: the rank waits for a debugger at step 3, and debugpy, answering
    breakpoint(), stops in a frame whose locals are the step's; a batch rebound there (here to NaN, from the Debug
    Console) is what the step trains on, so the run stops at that step's log."""
    port = free_port()
    args = SHORT + ["--break-at-step", "3", "--log-every", "1"] + outputs(tmp_path)
    job = Job(
        train_cmd() + args,
        child_env(DEBUG_RANK=0, DEBUG_PORT=port, PYDEVD_DISABLE_FILE_VALIDATION=1),
        tmp_path / "job.log",
    )
    cleanup.append(job)
    job.wait_for(rf"^rank 0 waiting for debugger on 127\.0\.0\.1:{port} \(break at step 3\)$")
    session = attach(port, {}, cleanup)
    stopped, frame = session.stopped_frame()
    found = session.evaluate("step, isinstance(model, torch.nn.Module), batch is micro_batches[0]", frame["id"])
    assert found == "(3, True, True)", found
    nan_filled = "[torch.full_like(part, float('nan')) if part.is_floating_point() else part for part in batch]"
    session.evaluate(f"batch = {nan_filled}", frame["id"])
    session.request("continue", threadId=stopped["threadId"])
    assert job.finish(sessions=[session]) == 2, job.output()[-6000:]
    session.request("disconnect")
    assert logged_steps(tmp_path) == [1, 2]


def test_listen_errors_name_the_port_and_rank(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        base = taken.getsockname()[1] - 1  # rank 1 (local rank 1) finds its port taken
        busy = start(
            train_cmd(2) + SHORT + outputs(tmp_path, "busy"),
            env=child_env(DEBUG_RANK=1, DEBUG_PORT=base, PYDEVD_DISABLE_FILE_VALIDATION=1),
        )
        # TEST-NET-1 (RFC 5737) is on no interface here: a non-loopback address that nothing can reach.
        remote = start(
            train_cmd() + SHORT + outputs(tmp_path, "remote"),
            env=child_env(
                DEBUG_RANK=0, DEBUG_HOST="192.0.2.1", DEBUG_PORT=free_port(), PYDEVD_DISABLE_FILE_VALIDATION=1
            ),
        )
        busy_code, busy_out = finish(busy, timeout=120)
        remote_code, remote_out = finish(remote, timeout=120)
    assert busy_code != 0
    # One line names the rank, the address it could not take, and the variable that moves it.
    assert any(
        re.search(rf"\brank 1\b.*127\.0\.0\.1:{base + 1}\b.*DEBUG_PORT", line) for line in busy_out.splitlines()
    ), busy_out[-4000:]
    assert remote_code != 0
    # A non-loopback address is warned about (and 127.0.0.1 offered) before the rank fails to listen on it.
    assert any(re.search(r"WARNING.*192\.0\.2\.1.*127\.0\.0\.1", line) for line in remote_out.splitlines()), remote_out
    assert any(
        re.search(r"\brank 0\b.*192\.0\.2\.1:\d+", line) and "WARNING" not in line for line in remote_out.splitlines()
    ), remote_out[-4000:]


def test_without_debug_variables_debugpy_is_not_imported(tmp_path):
    code = "import sys, train; train.main(sys.argv[1:]); print('debugpy imported:', 'debugpy' in sys.modules)"
    result = run([sys.executable, "-c", code] + SHORT + outputs(tmp_path))
    assert "debugpy imported: False" in result.stdout, result.stdout[-3000:]


# The VSCode configurations, run as VSCode runs them.


def run_task(spec, workspace, log, **env_overrides):
    """Run a tasks.json process task: resolved command and args, options.cwd, options.env over our environment."""
    resolved = resolve(spec, workspace)
    assert resolved["type"] == "process"
    options = resolved.get("options", {})
    env = child_env(**{**options.get("env", {}), **env_overrides})
    env.pop("PYTHONPATH")  # VSCode adds nothing: the workspace's train.py finds its package beside it
    return Job([resolved["command"]] + resolved["args"], env, log, cwd=options.get("cwd", workspace))


def test_debug_rank_task_then_attach(tmp_path, cleanup):
    """One click on "Debug rank 1": the preLaunchTask starts torchrun, VSCode waits for its endsPattern, attaches."""
    workspace = workspace_copy(tmp_path)
    source, line, _ = step_breakpoints(workspace)
    ranks, base_port = baked_ranks()
    rank = ranks[-1]
    config = resolve(configuration(f"Debug rank {rank}"), workspace)
    spec = task(config["preLaunchTask"])
    if spec.get("dependsOn"):
        pre = run_task(task(spec["dependsOn"]), workspace, tmp_path / "pre.log")
        assert pre.finish() == 0, pre.output()
    # The baked ports, shifted together to a free one, so other runs on this machine can't collide with the test.
    port = free_port() - rank
    shift = port - base_port
    job = run_task(spec, workspace, tmp_path / "task.log", DEBUG_PORT=port)
    cleanup.append(job)

    matcher = spec["problemMatcher"]
    deadline = time.monotonic() + 120
    ready = None
    while ready is None:  # what VSCode's background matcher does with each line of the task's output
        for text in job.output().splitlines():
            assert not re.search(matcher["pattern"]["regexp"], text), f"reported as a problem: {text}"
            assert not re.search(matcher["background"]["beginsPattern"], text)
            if re.search(matcher["background"]["endsPattern"], text):
                ready = text
                break
        assert job.proc.poll() is None and time.monotonic() < deadline, job.output()[-6000:]
        time.sleep(0.05)
    assert WAITING.fullmatch(ready.strip()), ready

    connect = config["connect"]
    session = dap.Session.connect(connect["host"], int(connect["port"]) + shift, name=config["name"])
    cleanup.append(session)
    attach_args = {k: v for k, v in config.items() if k not in ("name", "preLaunchTask")}
    attach_args["connect"] = {**connect, "port": int(connect["port"]) + shift}
    session.start("attach", attach_args, {source: [line]})
    _, frame = session.stopped_frame()
    assert (frame["source"]["path"], frame["line"]) == (str(source), line)
    assert session.evaluate("self.env.rank", frame["id"]) == str(rank)
    resume(session, source)
    assert job.finish(sessions=[session]) == 0, job.output()[-6000:]
    session.request("disconnect")


def test_f5_stops_in_every_rank(tmp_path, cleanup):
    """F5 on "torchrun (F5)": the adapter launches torchrun; each worker arrives as a subprocess to attach to."""
    workspace = workspace_copy(tmp_path)
    source, line, _ = step_breakpoints(workspace)
    ranks, _ = baked_ranks()
    config = resolve(configuration("torchrun (F5)"), workspace)
    # Where the configuration's run writes: its flags, else train.py's defaults (relative to its cwd).
    cwd = Path(config.get("cwd", workspace))
    snapshot_dir, log_file, export_dir = (
        cwd / flag_value(config["args"], name, default)
        for name, default in (
            ("--snapshot-dir", "snapshots"),
            ("--log-file", "logs/train.log"),
            ("--export-dir", "export"),
        )
    )
    # Its preLaunchTask removes the snapshots of earlier debug runs, or this one would resume a finished run.
    stale = snapshot_dir / "step-00000100"
    stale.mkdir(parents=True)
    pre = run_task(task(config["preLaunchTask"]), workspace, tmp_path / "pre.log")
    assert pre.finish() == 0, pre.output()
    assert not stale.exists()

    # What VSCode sends: the configuration, plus the selected interpreter added by the Python extension.
    launch = {k: v for k, v in config.items() if k not in ("name", "preLaunchTask")}
    launch["python"] = [sys.executable]
    terminal_env = child_env()
    terminal_env.pop("PYTHONPATH")
    adapter = dap.Session.adapter(env=terminal_env)
    adapter.terminal_env, adapter.terminal_log = terminal_env, tmp_path / "terminal.log"
    cleanup.append(adapter)
    breakpoints = {source: [line]}
    workers = dap.Subprocesses(adapter, breakpoints)
    cleanup.append(workers)
    started = time.monotonic()
    adapter.start("launch", launch, breakpoints)

    sessions = workers.wait_for(len(ranks), timeout=120)
    stopped_ranks = set()
    for session in sessions:
        _, frame = session.stopped_frame(timeout=120)
        if not stopped_ranks:
            print(f"\nF5: {time.monotonic() - started:.1f} s from launch to the first stop")
        assert (frame["source"]["path"], frame["line"]) == (str(source), line)
        stopped_ranks.add(session.evaluate("self.env.rank", frame["id"]))
    assert stopped_ranks == {str(rank) for rank in ranks}

    for session in sessions:
        resume(session, source)
    exited = adapter.wait_event("exited", timeout=180)
    assert exited["exitCode"] == 0, adapter.terminal_log.read_text()[-6000:]
    done = json.loads((export_dir / "summary.json").read_text())
    assert (done["world_size"], done["steps"], done["resumed_from"]) == (len(ranks), 100, -1), done
    assert (done["snapshot_dir"], done["log_file"]) == (str(snapshot_dir), str(log_file))
    assert final_model(snapshot_dir)["step"] == 100
    for session in sessions + [adapter]:
        session.request("disconnect")
