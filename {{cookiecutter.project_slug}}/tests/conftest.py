"""Helpers for tests that run the real thing: train.py in processes, under torchrun, on gloo."""

import inspect
import json
import multiprocessing.process
import os
import pty
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from {{ cookiecutter.project_slug }}.machinery import baked

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "{{ cookiecutter.project_slug }}"
# The backend this machine has, where the project's default is one it lacks: a project whose default is nccl trains
# on gloo here when there are no CUDA GPUs, as an auto default would (the tests check training, snapshots and their
# promises, whichever backend carries them; test_config.py checks that nccl without GPUs is refused).
MACHINE_BACKEND = ["--backend", "gloo"] if baked.BACKEND == "nccl" and not torch.cuda.is_available() else []
# Settings every test run shares. They name no setting of the model or the data, so the tests run unchanged on
# whatever model.py and data.py hold.
QUICK = ["--wandb", "disabled", "--log-every", "5", *MACHINE_BACKEND]
# Runs compared bit for bit: a snapshot every 10 steps, one thread per rank (the thread count is part of the numerics).
EXACT = QUICK + ["--snapshot-every", "10", "--threads-per-rank", "1"]


# The two tiers. A test that starts a process (torchrun, train.py, a notebook kernel, a debug adapter) is "slow";
# every other test runs in this process, and `pytest -m "not slow"` runs those in seconds. The mark comes from what
# the test does: the collection hook below follows the names each test, its fixtures and the helpers they call
# refer to, and marks the test slow when one of them can start a process. A guard fails any other test that
# starts one anyway, so the quick tier stays quick whatever a new test does.
# What starts processes: these modules and everything they hold (jupyter_client and nbclient start notebook kernels).
STARTERS = ("subprocess", "multiprocessing", "torch.multiprocessing", "pty", "jupyter_client", "nbclient")


def _is_starter(value):
    name = value.__name__ if inspect.ismodule(value) else getattr(value, "__module__", None)
    return isinstance(name, str) and any(name == m or name.startswith(m + ".") for m in STARTERS)


def _starts_processes(obj, seen):
    """Whether calling obj (a test, fixture or helper of these tests) can start a process."""
    if id(obj) in seen:
        return False
    seen.add(id(obj))
    if inspect.isclass(obj):
        return any(_starts_processes(member, seen) for member in vars(obj).values())
    obj = inspect.unwrap(getattr(obj, "__func__", obj))
    code = getattr(obj, "__code__", None)
    if code is None or not str(code.co_filename).startswith(str(Path(__file__).parent)):
        return False  # torch, the project and the standard library are followed no further
    names, pending = set(), [code]
    while pending:  # the function and the functions, lambdas and comprehensions defined inside it
        current = pending.pop()
        names.update(current.co_names)
        pending.extend(const for const in current.co_consts if inspect.iscode(const))
    if names & set(STARTERS):
        return True  # imported inside the function
    found = [obj.__globals__[name] for name in names if name in obj.__globals__]
    return any(_is_starter(value) or _starts_processes(value, seen) for value in found)


def pytest_collection_modifyitems(items):
    for item in items:
        used = [item.obj] + [
            definitions[-1].func for definitions in item._fixtureinfo.name2fixturedefs.values() if definitions
        ]
        if any(_starts_processes(obj, {id(inspect.unwrap(_in_process_only))}) for obj in used):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def _in_process_only(request, monkeypatch):
    """A quick test that starts a process anyway fails at once, naming what it started."""
    if request.node.get_closest_marker("slow") is None:

        def refused(*args, **kwargs):
            raise AssertionError(f"a quick test (not marked slow) started a process: {args[1:2]}")

        start_process = multiprocessing.process.BaseProcess.start

        def data_loader_workers_only(process):  # a DataLoader's workers are part of the loader in this process
            target = getattr(process, "_target", None)
            if not getattr(target, "__module__", "").startswith("torch.utils.data"):
                refused(process, target)
            start_process(process)

        monkeypatch.setattr(subprocess.Popen, "__init__", refused)
        monkeypatch.setattr(pty, "fork", refused)
        monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", data_loader_workers_only)


# Every run a test starts skips torch's imports (2-3 s of CPU per rank, most of a short run): train.py hands itself
# to a standing zygote this test process starts once (machinery/warmstart.py's serve_pool), as a torchrun restart
# hands itself to its job's. Tests of cold starts, of the job's own zygote or under a debugger (which is never
# forked) start cold: child_env(WARM_START_POOL=""). WARM_START_POOL in this session's environment names a standing
# zygote to use instead (the template's tests share one among the projects they bake); it is taken out of this
# process's environment, where `import train` would hand the test session itself to the zygote.
_POOL: dict = {}  # its name -> its process (None: a given one)
if os.environ.get("WARM_START_POOL"):
    _POOL[os.environ.pop("WARM_START_POOL")] = None
STAND_IN_VARIABLE = b"TEST_TORCHRUN_STAND_IN"  # tests/warm_torchrun.py's: the pid a test started, in its ranks


def warm_pool():
    """The name of this test process's standing zygote, started on first use and waited for: a run started before
    it is up would import everything itself, cold (where it cannot serve, it exits and runs start cold)."""
    if not _POOL:
        name = f"{os.getpid()}-{random.SystemRandom().getrandbits(48):x}"
        # torchrun's agent (tests/warm_torchrun.py), and what WARM_START_PRELOAD adds (transformers, ...)
        preload = ("torch.distributed.run", *filter(None, os.environ.get("WARM_START_PRELOAD", "").split(",")))
        script = f"from {PACKAGE}.machinery import warmstart; warmstart.serve_pool({name!r}, {preload!r})"
        env = child_env(WARM_START_POOL="")
        _POOL[name] = subprocess.Popen(
            [sys.executable, "-c", script],
            env=env,
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        from {{ cookiecutter.project_slug }}.machinery.warmstart import POOL_ADDRESS

        shown = POOL_ADDRESS.replace("\0", "@", 1) + name  # how /proc/net/unix shows an abstract socket
        listening = lambda: shown in Path("/proc/net/unix").read_text()  # noqa: E731
        wait_for(lambda: _POOL[name].poll() is not None or listening(), timeout=120, what="the warm pool")
    return next(iter(_POOL))


def child_env(**extra):
    dropped = ("DEBUG_", "WANDB_", "TORCHELASTIC_", "WARM_RESTART", "WARM_START")
    env = {k: v for k, v in os.environ.items() if not k.startswith(dropped)}
    for key in (
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "DEBUGPY_RUNNING",
    ):
        env.pop(key, None)
    env.update({"PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)})
    if "WARM_START_POOL" not in extra:
        env["WARM_START_POOL"] = warm_pool()
    env.update({k: str(v) for k, v in extra.items()})
    return env


def train_cmd(nproc=None, torchrun_args=(), script="train.py"):
    """`python train.py` when nproc is None, else torchrun --standalone with nproc ranks (its agent warm too:
    tests/warm_torchrun.py)."""
    if nproc is None:
        return [sys.executable, str(ROOT / script)]
    return [
        sys.executable,
        str(Path(__file__).parent / "warm_torchrun.py"),
        "--standalone",
        f"--nproc_per_node={nproc}",
        *torchrun_args,
        str(ROOT / script),
    ]


def outputs(tmp_path, name="run"):
    """Every file a run writes, under tmp_path: snapshots, log, exported weights and summary, metrics."""
    return [
        "--snapshot-dir",
        str(tmp_path / f"{name}-snapshots"),
        "--log-file",
        str(tmp_path / f"{name}.log"),
        "--export-dir",
        str(tmp_path / f"{name}-export"),
        "--metrics-file",
        str(tmp_path / f"{name}-metrics.jsonl"),
    ]


def summary(tmp_path, name="run"):
    """The summary.json rank 0 wrote at the end of the last attempt of `name` that finished."""
    return json.loads((tmp_path / f"{name}-export" / "summary.json").read_text())


def metrics(tmp_path, name="run"):
    """The records of the metrics file of `name`, one per logged step (an absent file: none)."""
    path = tmp_path / f"{name}-metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def logged_steps(tmp_path, name="run"):
    """The steps a run of `name` has logged so far; it may be writing a line at this moment: that one is left out."""
    path = tmp_path / f"{name}-metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.endswith("}")]


def default_config():
    """The settings of a run with no flags."""
    from {{ cookiecutter.project_slug }} import config

    return config.parse_args([])


def default_datasets():
    """(train, val) as the project builds them with the default settings: the seam, whatever it holds."""
    from {{ cookiecutter.project_slug }}.data import build_datasets

    return build_datasets(default_config())


def run(cmd, env=None, timeout=300, cwd=None, check=True):
    """Run to the end; return the CompletedProcess with stdout and stderr merged into .stdout."""
    result = subprocess.run(
        cmd,
        env=env or child_env(),
        cwd=cwd or ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
    )
    if check and result.returncode != 0:
        pytest.fail(f"{' '.join(map(str, cmd))} exited {result.returncode}:\n{result.stdout[-6000:]}")
    return result


def start(cmd, env=None, cwd=None):
    return subprocess.Popen(
        cmd,
        env=env or child_env(),
        cwd=cwd or ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def finish(proc, timeout=300):
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"timed out after {timeout} s:\n{out[-6000:]}")
    return proc.returncode, out


def processes_naming(text):
    """The pids of the processes whose command line (as ps shows it) holds `text`."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            if not entry.isdigit():
                continue
            if str(text).encode() in open(f"/proc/{entry}/cmdline", "rb").read().replace(b"\0", b" "):
                found.append(int(entry))
        except OSError:
            continue
    return found


def worker_pids(agent_pid):
    """{global rank: pid} of the workers a torchrun agent runs now (`agent_pid`: the process the test started,
    which for tests/warm_torchrun.py is the agent's stand-in)."""
    stand_in = str(agent_pid).encode()
    return rank_pids(lambda pid, parent, cmdline, env: stand_in in (str(parent).encode(), env.get(STAND_IN_VARIABLE)))


def rank_pids(accept):
    """{global rank: pid} of the processes with RANK in their environment that accept(pid, parent, cmdline, env)."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                parent = int(handle.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as handle:
                cmdline = handle.read()
            with open(f"/proc/{entry}/environ", "rb") as handle:
                env = dict(item.partition(b"=")[::2] for item in handle.read().split(b"\0") if item)
        except (OSError, ValueError, IndexError):
            continue
        if b"RANK" in env and accept(int(entry), parent, cmdline, env):
            found[int(env[b"RANK"])] = int(entry)
    return found


def project(tmp_path, model="", data="", name="project"):
    """A copy of this project in tmp_path/name whose model.py and data.py end with `model` and `data` (later
    definitions win)."""
    workspace = tmp_path / name
    shutil.copytree(ROOT / PACKAGE, workspace / PACKAGE, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "train.py", workspace / "train.py")
    for name, extra in (("model.py", model), ("data.py", data)):
        path = workspace / PACKAGE / name
        path.write_text(path.read_text() + "\n\n" + textwrap.dedent(extra))
    return workspace


def sigkill_at_random_and_resume(tmp_path, nproc, args, kill_after=(12, 40), workspace=None):
    """An uninterrupted run ("reference") and one whose random rank is SIGKILLed after a random logged step in
    `kill_after`, at a random moment (mid-step, mid-save or between saves), and restarted by torchrun; both of
    this project, or of `workspace` (a copy from `project`). Returns the summary of the restarted run, which must
    have finished."""
    script, env = "train.py", None
    if workspace is not None:
        script, env = str(workspace / "train.py"), child_env(PYTHONPATH=workspace)
    run(train_cmd(nproc, script=script) + args + outputs(tmp_path, "reference"), env=env, cwd=workspace)
    proc = start(
        train_cmd(nproc, ["--max-restarts=2"], script=script) + args + outputs(tmp_path), env=env, cwd=workspace
    )
    # The workers first (reading /proc takes a while): a warm run takes milliseconds a step, so the kill follows
    # the chosen step at once, at a moment within the next steps.
    workers = wait_for(lambda: len(found := worker_pids(proc.pid)) == nproc and found, timeout=180, what="workers")
    step = random.randint(*kill_after)
    reached = lambda: any(logged >= step for logged in logged_steps(tmp_path))  # noqa: E731
    wait_for(reached, timeout=180, interval=0.002, what=f"step {step}")
    time.sleep(random.uniform(0, 0.01))
    victim = random.randrange(nproc)
    os.kill(workers[victim], signal.SIGKILL)
    code, out = finish(proc)
    assert code == 0, out[-5000:]
    resumed = summary(tmp_path)
    print(f"\n{nproc} ranks: killed rank {victim} after step {step}, resumed from {resumed['resumed_from']}")
    return resumed


# A torchrun attempt that failed, in torchrun's summary (each restart follows one).
FAILED_ATTEMPT = re.compile(r"failed \(exitcode: ")


def reached_step(tmp_path, step):
    """True once the run's metrics file has a record of `step` or later (each line is flushed as it is written)."""

    def check():
        try:
            return any(record["step"] >= step for record in metrics(tmp_path))
        except ValueError:
            return False  # the line being written

    return check


def injected(tmp_path, **fault):
    return child_env(FAULT_ONCE=tmp_path / "fault-fired", **fault)


def starts(tmp_path):
    """{attempt: ["warm" or "cold" for each rank]}, as tests/fault_injection.py recorded (RECORD_STARTS)."""
    found = {}
    for path in sorted((tmp_path / "starts").glob("start-rank*-attempt*")):
        attempt = int(path.name.rsplit("attempt", 1)[1])
        found.setdefault(attempt, []).append(path.read_text())
    return found


def wait_for(predicate, timeout=60, interval=0.05, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def free_port(count=1):
    """The first of `count` ports in a row that are free now, below the kernel's range for outgoing connections:
    a port from bind(("", 0)) comes from that range, so a connection made meanwhile could take it (or the next
    one, which DEBUG_PORT + LOCAL_RANK uses) before the process it is meant for binds it."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as handle:
            ephemeral = int(handle.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral = 32768
    for _ in range(1000):
        base = random.SystemRandom().randint(min(20000, ephemeral // 2), ephemeral - count)  # whatever seeds tests set
        sockets = []
        try:
            for port in range(base, base + count):
                sockets.append(socket.socket())
                sockets[-1].bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
    raise RuntimeError(f"no {count} free ports in a row below {ephemeral}")


def final_model(snapshot_dir):
    from {{ cookiecutter.project_slug }}.machinery.snapshot import load_latest

    state = load_latest(str(snapshot_dir))
    assert state is not None, f"no snapshot in {snapshot_dir}"
    return state


def save_base_model(folder, seed=0, max_shard_size=None):
    """A tiny GPT-2 (its output layer tied to the token embedding) and a tokenizer of the words "0" to "62", written
    by save_pretrained into `folder` (offline): a pretrained model to start from. Returns the model."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    model.save_pretrained(folder, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    save_tokenizer(folder)
    return model


def save_tokenizer(folder):
    """The tokenizer of save_base_model alone (the words "0" to "62"), written by save_pretrained into `folder`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({"[UNK]": 0, **{str(n): n + 1 for n in range(63)}}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]").save_pretrained(folder)


def assert_same_weights(a, b):
    assert a.keys() == b.keys()
    different = [name for name in a if not torch.equal(a[name], b[name])]
    assert not different, f"weights differ in {different}"


@pytest.fixture(scope="session")
def reference_runs(tmp_path_factory):
    """Uninterrupted runs, computed once per argument list and world size, to compare others against."""
    cache = {}

    def get(args, nproc=2):
        key = (tuple(args), nproc)
        if key not in cache:
            folder = tmp_path_factory.mktemp("reference")
            run(train_cmd(nproc) + list(args) + outputs(folder))
            cache[key] = final_model(folder / "run-snapshots")
        return cache[key]

    return get


@pytest.fixture
def cleanup():
    """Debug sessions and jobs to close (or processes to kill) when a test ends, however it ends."""
    items = []
    yield items
    for item in reversed(items):
        try:
            item.close() if hasattr(item, "close") else item.kill()
        except Exception as problem:  # one failed close must not keep the others from running
            print(f"cleanup: {problem!r}")
