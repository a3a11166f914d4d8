"""What the benchmark and the kill stress test share: baking, launching torchrun under the probe, reading its clocks."""

import contextlib
import datetime
import glob
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
PROBE = BENCH / "probe.py"
BARE = BENCH / "bare_ddp.py"
FAILED_ATTEMPT = "failed (exitcode: "
_GLOG = r"^[EW](\d{4}) (\d\d:\d\d:\d\d\.\d+) "  # torchrun's own lines: level, MMDD, time
STOPPING = re.compile(_GLOG + r".*closing signal", re.M)  # the agent signals the surviving workers
FAILED = re.compile(_GLOG + r".*failed \(exitcode", re.M)  # ... and, once they are gone, reports the failure


# data.py of the benches that train a transformers GPT-2: random token rows, BENCH_TOKENS long, ids below BENCH_VOCAB
TOKEN_DATA = """
import os

import torch


class Tokens(torch.utils.data.Dataset):
    def __init__(self, rows):
        tokens, vocab = int(os.environ.get("BENCH_TOKENS", 16)), int(os.environ.get("BENCH_VOCAB", 128))
        self.ids = torch.randint(0, vocab, (rows, tokens), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, index):
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def build_datasets(cfg):
    return Tokens(256), None
"""


def bake(scratch, **answers):
    """Bake the template with its defaults (or these answers) into `scratch`; return (project folder, package name)."""
    subprocess.run(
        [sys.executable, "-m", "cookiecutter", "--no-input", "--overwrite-if-exists", str(ROOT), "-o", str(scratch)]
        + [f"{key}={value}" for key, value in answers.items()],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    project = Path(scratch) / "ddp_project"
    return project, "ddp_project"


def project_in(work, given=None):
    """A default bake in `work` (or a copy of the baked project `given`, its venv and logs left out); return
    (project folder, package name)."""
    if not given:
        return bake(Path(work) / "bake")
    shutil.copytree(given, Path(work) / "ddp_project", ignore=shutil.ignore_patterns(".venv", "logs"))
    return Path(work) / "ddp_project", "ddp_project"


def child_env(probe_dir, **extra):
    """The environment of a benchmark run: no debugger, no wandb, no torchrun leftovers of the caller."""
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("DEBUG_", "WANDB_", "TORCHELASTIC_", "OMP_", "PROBE_"))
    }
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
    env.update({"PYTHONUNBUFFERED": "1", "PROBE_DIR": str(probe_dir), "WANDB_MODE": "disabled"})
    env.update({k: str(v) for k, v in extra.items()})
    return env


class Run:
    """One torchrun job started under the probe: its launch time, its output file, its clocks."""

    def __init__(self, script, args, nproc, workdir, torchrun_args=(), env_extra=None):
        self.workdir = Path(workdir)
        self.probe_dir = self.workdir / "probe"
        self.probe_dir.mkdir(parents=True, exist_ok=True)
        self.output = self.workdir / "torchrun.out"
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            *torchrun_args,
            str(PROBE),
            str(script),
            *map(str, args),
        ]
        self._out = open(self.output, "w")
        self.launched = time.time()
        self.proc = subprocess.Popen(
            command,
            cwd=self.workdir,
            env=child_env(self.probe_dir, **(env_extra or {})),
            stdout=self._out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait(self, timeout):
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise RuntimeError(f"{self.workdir}: still running after {timeout} s; output in {self.output}") from None
        finally:
            self._out.close()
        return code

    def stop(self, grace=20):
        """SIGTERM torchrun (it stops its workers); SIGKILL whatever is left after `grace` seconds."""
        if self.proc.poll() is None:
            workers = worker_pids(self.proc.pid)
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                for pid in [self.proc.pid, *workers.values()]:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                self.proc.wait()
        if not self._out.closed:
            self._out.close()

    def text(self):
        return self.output.read_text(errors="replace")

    def first_step(self, attempt=0, timeout=None):
        """Wall-clock time at which every rank of `attempt` had finished its first optimizer step."""

        def read():
            files = glob.glob(str(self.probe_dir / f"first-rank*-attempt{attempt}.json"))
            return [json.loads(Path(f).read_text())["first_step"] for f in files]

        if timeout is not None:
            deadline = time.monotonic() + timeout
            while not read():
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"no optimizer step in attempt {attempt} of {self.workdir}; see {self.output}")
                time.sleep(0.02)
        times = read()
        return max(times) if times else None

    def step_times(self, rank=0, attempt=0):
        return json.loads((self.probe_dir / f"steps-rank{rank}-attempt{attempt}.json").read_text())["steps"]


def rank_files(nproc, script, args, cwd, env, out, timeout):
    """Run `script` on `nproc` ranks under torchrun (--standalone) with MEMORY_OUT=`out`, where each rank writes its
    rank<N>.json; the texts of those files, in rank order. A failed run raises with the end of its output."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", script, *args]
    result = subprocess.run(
        cmd, cwd=cwd, env={**env, "MEMORY_OUT": str(out)}, capture_output=True, text=True, timeout=timeout
    )
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return [path.read_text() for path in sorted(out.glob("rank*.json"))]


def steps_per_second(step_times, warmup):
    """Optimizer steps per second from step `warmup` to the last one."""
    if len(step_times) <= warmup + 1:
        raise ValueError(f"only {len(step_times)} steps recorded, need more than {warmup + 1}")
    return (len(step_times) - 1 - warmup) / (step_times[-1] - step_times[warmup])


def worker_pids(agent_pid):
    """{global rank: pid} of the workers a torchrun agent runs now."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                parent = int(handle.read().rsplit(")", 1)[1].split()[1])
            if parent != agent_pid:
                continue
            with open(f"/proc/{entry}/environ", "rb") as handle:
                variables = handle.read().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        for item in variables:
            if item.startswith(b"RANK="):
                found[int(item[5:])] = int(entry)
    return found


def agent_time(pattern, text, year=None):
    """The wall-clock time of torchrun's first line matching `pattern` (glog format: MMDD HH:MM:SS.ffffff), or None."""
    match = pattern.search(text)
    if not match:
        return None
    year = year or datetime.date.today().year
    month, day = int(match.group(1)[:2]), int(match.group(1)[2:])
    clock = datetime.datetime.strptime(match.group(2), "%H:%M:%S.%f").time()
    return datetime.datetime.combine(datetime.date(year, month, day), clock).timestamp()


def process_start(pid):
    """The wall-clock time at which process `pid` started (from /proc: boot time + its start in clock ticks)."""
    with open(f"/proc/{pid}/stat") as handle:
        ticks = int(handle.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/stat") as handle:
        boot = next(int(line.split()[1]) for line in handle if line.startswith("btime "))
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def median(values):
    return statistics.median(values)


def load():
    with open("/proc/loadavg") as handle:
        return tuple(float(x) for x in handle.read().split()[:3])


def machine():
    """What a result was measured on."""
    import torch

    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "cores": os.cpu_count(),
        "nproc": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "cpu": cpu,
        "torch": str(torch.__version__),
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
    }


class CpuMeter:
    """CPU seconds this machine spent outside the benchmark's own processes: how noisy a section was."""

    def __init__(self):
        self.start = self._read()

    @staticmethod
    def _read():
        with open("/proc/stat") as handle:
            fields = [int(x) for x in handle.readline().split()[1:]]
        busy = (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait
        times = os.times()
        return busy, times.user + times.system + times.children_user + times.children_system, time.monotonic()

    def stop(self):
        busy, ours, wall = self._read()
        foreign = max(0.0, (busy - self.start[0]) - (ours - self.start[1]))
        seconds = wall - self.start[2]
        return {
            "wall_s": seconds,
            "foreign_cpu_s": foreign,
            "foreign_cores": foreign / seconds if seconds else 0.0,
            "load_after": load()[0],
        }


def wait_for(predicate, timeout, what, poll=0.005):
    """The predicate's first true value, polled every `poll` seconds; TimeoutError after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise TimeoutError(f"waited {timeout} s for {what}")


def scratch_dir(prefix):
    return Path(tempfile.mkdtemp(prefix=prefix))


@contextlib.contextmanager
def scratch_folder(prefix, keep, say=print):
    """A new folder for a benchmark's files (scratch_dir): removed when the block ends, or kept and named (--keep)."""
    folder = scratch_dir(prefix)
    try:
        yield folder
    finally:
        if keep:
            say(f"scratch folder kept: {folder}")
        else:
            shutil.rmtree(folder, ignore_errors=True)
