"""Replica groups (--fault-tolerance torchft) against the torchrun path: steady-state speed, and what a failure costs
the live group.

Run: .venv/bin/python bench/replica_groups.py [--kills 3] [--steps 300] [--widths 256 1024 2048] [--repeats 3]
(bakes the template; needs torchft, which requirements-dev.txt installs; ~15 minutes)

Steady state, per demo width: the same global batch (2 x 32 samples a step) trained by one torchrun job of 2 ranks
(DDP) and by 2 replica groups of 1 rank each (a lighthouse, two torchrun jobs, the groups' gradient average through
torchft). Speed: the median of the logged samples/s over the steps after the first 50 (every step logged in both),
then the median over --repeats runs of each kind, run alternately. Cold start: a torchrun job's launch -> its first
logged step.

Failures: 2 groups of 1 rank train on; after group 1 has logged 30 steps its worker gets SIGKILL, torchrun restarts
it, and it rejoins by taking group 0's state. For each kill: group 0's longest interval between two logged steps
from the kill to the rejoin (its logged steps are polled every 10 ms), what group 0 lost (that interval less its
median step), and group 1's time from the kill to its first step after the rejoin. Between kills the groups train
20 steps together. The lighthouse runs with --heartbeat_timeout_ms 500 (its default is 5000): that timeout is
how long the live group waits before a quorum without the dead group.
Writes bench/REPLICA_GROUPS.md and bench/REPLICA_GROUPS.json.
"""

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import BENCH, CpuMeter, bake, child_env, machine, scratch_dir, wait_for, worker_pids  # noqa: E402

GLOBAL_BATCH = 64  # samples a step: 2 ranks x 32, or 2 groups x 1 rank x 32
BASE = ["--wandb", "disabled", "--log-every", "1", "--eval-every", "0", "--threads-per-rank", "1"]
HEARTBEAT_MS = 500


def records(path):
    try:
        return [json.loads(line) for line in Path(path).read_text().splitlines() if line.endswith("}")]
    except OSError:
        return []


class Clock:
    """When each logged step of a metrics file first appears (polled every 10 ms)."""

    def __init__(self, path):
        self.path, self.seen, self._lock, self._stop = Path(path), {}, threading.Lock(), threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self):
        while not self._stop.is_set():
            now = time.monotonic()
            found = records(self.path)
            with self._lock:
                for record in found:
                    self.seen.setdefault(record["step"], now)
            time.sleep(0.01)

    def snapshot(self):
        with self._lock:
            return dict(self.seen)

    def last(self):
        found = records(self.path)
        return found[-1]["step"] if found else -1

    def close(self):
        self._stop.set()
        self._thread.join()


def torchrun(project, nproc, args, out, env, restarts=0):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    command += [f"--max-restarts={restarts}", str(project / "train.py"), *args]
    return subprocess.Popen(
        command, cwd=project, env=env, stdout=open(out, "w"), stderr=subprocess.STDOUT, start_new_session=True
    )


def lighthouse(folder, port):
    binary = Path(sys.executable).parent / "torchft_lighthouse"
    command = [str(binary) if binary.exists() else shutil.which("torchft_lighthouse"), "--min_replicas", "1"]
    command += ["--join_timeout_ms", "1000", "--heartbeat_timeout_ms", str(HEARTBEAT_MS), "--bind", f"[::]:{port}"]
    return subprocess.Popen(command, stdout=open(folder / "lighthouse.out", "w"), stderr=subprocess.STDOUT)


def free_port():
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def files(folder, name):
    return ["--snapshot-dir", str(folder / f"{name}-snap"), "--export-dir", str(folder / f"{name}-export")] + [
        "--metrics-file",
        str(folder / f"{name}.jsonl"),
        "--log-file",
        str(folder / f"{name}.log"),
    ]


def group_env(folder, port, group):
    return child_env(
        folder / "probe",
        TORCHFT_LIGHTHOUSE=f"http://localhost:{port}",
        REPLICA_GROUP_ID=group,
        NUM_REPLICA_GROUPS=2,
    )


def groups(project, args, folder, name, port, restarts=0):
    """The 2 replica groups of 1 rank, each its own torchrun job; group g's output in <name>-group<g>.out."""
    return [
        torchrun(project, 1, args, folder / f"{name}-group{g}.out", group_env(folder, port, g), restarts=restarts)
        for g in range(2)
    ]


def speed(path, skip=50):
    values = [r["samples_per_s"] for r in records(path) if r["step"] > skip and "samples_per_s" in r]
    return statistics.median(values)


def replica_run(project, args, folder, name):
    """2 replica groups of 1 rank, with a lighthouse of their own, trained to their end: group 0's samples/s."""
    port = free_port()
    house = lighthouse(folder, port)
    jobs = groups(project, args + ["--fault-tolerance", "torchft"] + files(folder, name), folder, name, port)
    try:
        for g, job in enumerate(jobs):
            assert job.wait(600) == 0, (folder / f"{name}-group{g}.out").read_text()[-3000:]
    finally:
        house.kill()
        house.wait()
    return speed(folder / f"{name}.group0.jsonl")


def steady_state(project, folder, width, steps, repeats):
    """samples/s of the torchrun path and of 2 replica groups, runs alternating (`repeats` of each: this machine's
    speed drifts by several percent from run to run); the torchrun path's cold start."""
    args = BASE + ["--max-steps", str(steps), "--width", str(width), "--snapshot-every", str(steps)]
    folder.mkdir(parents=True)
    plain, ft, colds = [], [], []
    for repeat in range(repeats):
        name = f"torchrun{repeat}"
        launched = time.monotonic()
        job = torchrun(project, 2, args + files(folder, name), folder / f"{name}.out", child_env(folder / "probe"))
        clock = Clock(folder / f"{name}.jsonl")
        assert job.wait(600) == 0, (folder / f"{name}.out").read_text()[-3000:]
        clock.close()
        colds.append(min(clock.seen.values()) - launched)
        plain.append(speed(folder / f"{name}.jsonl"))
        ft.append(replica_run(project, args, folder, f"ft{repeat}"))
    plain_s, ft_s = statistics.median(plain), statistics.median(ft)
    return {
        "width": width,
        "torchrun_samples_per_s": plain_s,
        "ft_samples_per_s": ft_s,
        "ratio": ft_s / plain_s,
        "pair_ratios": [f / p for f, p in zip(ft, plain, strict=True)],
        "torchrun_step_ms": 1000 * GLOBAL_BATCH / plain_s,
        "ft_step_ms": 1000 * GLOBAL_BATCH / ft_s,
        "torchrun_runs": plain,
        "ft_runs": ft,
        "torchrun_cold_start_s": statistics.median(colds),
    }


def failures(project, folder, kills):
    folder.mkdir(parents=True)
    port = free_port()
    house = lighthouse(folder, port)
    args = BASE + ["--max-steps", "1000000", "--snapshot-every", "50", "--fault-tolerance", "torchft"]
    args += files(folder, "ft")
    launched = time.monotonic()
    jobs = groups(project, args, folder, "ft", port, restarts=kills)
    clocks = [Clock(folder / f"ft.group{g}.jsonl") for g in range(2)]
    results = []
    try:
        wait_for(lambda: len(clocks[1].snapshot()) >= 30, 180, "30 steps of group 1")
        cold = min(min(c.snapshot().values()) for c in clocks) - launched
        for _ in range(kills):
            before = clocks[0].snapshot()
            steps_before = sorted(before)[-20:]
            step_time = statistics.median(
                b - a
                for a, b in zip([before[s] for s in steps_before], [before[s] for s in steps_before[1:]], strict=False)
            )
            victim = worker_pids(jobs[1].pid)[0]
            os.kill(victim, signal.SIGKILL)
            killed_at, killed_step = time.monotonic(), max(clock.last() for clock in clocks)
            rejoined = wait_for(
                lambda at=killed_at, step=killed_step: [
                    s for s, t in clocks[1].snapshot().items() if t > at and s > step
                ],
                180,
                "the rejoin",
            )
            rejoin_step = min(rejoined)
            rejoin_time = clocks[1].snapshot()[rejoin_step]
            wait_for(lambda step=rejoin_step: clocks[1].last() >= step + 20, 180, "20 steps after the rejoin")
            seen = clocks[0].snapshot()
            times = sorted(t for s, t in seen.items() if killed_step < s <= rejoin_step)
            gaps = [b - a for a, b in zip([killed_at, *times], times, strict=False)]
            results.append(
                {
                    "killed_at_step": killed_step,
                    "rejoined_at_step": rejoin_step,
                    "live_group_steps_meanwhile": rejoin_step - killed_step,
                    "live_longest_gap_s": max(gaps),
                    "live_step_s": step_time,
                    "live_lost_s": max(gaps) - step_time,
                    "restart_s": rejoin_time - killed_at,
                }
            )
            print(results[-1], flush=True)
    finally:
        for job in jobs:
            for pid in worker_pids(job.pid).values():
                os.kill(pid, signal.SIGTERM)
        for job in jobs:
            try:
                job.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(job.pid, signal.SIGKILL)
        for clock in clocks:
            clock.close()
        house.kill()
        house.wait()
    return {"group_cold_start_s": cold, "kills": results}


IMPORTS = {
    "import torch": "import torch",
    "+ torch._dynamo (DDP and the optimizer import it)": "import torch, torch._dynamo",
    "+ the project's machinery": "import torch, torch._dynamo; from {package}.machinery import trainer",
}


def import_costs(project, package, repeats=5):
    """Median CPU seconds (user + system) and wall seconds of a fresh interpreter's imports."""
    costs = {}
    for name, statement in IMPORTS.items():
        cpu, wall = [], []
        for _ in range(repeats):
            before = os.times()
            started = time.monotonic()
            subprocess.run([sys.executable, "-c", statement.format(package=package)], cwd=project, check=True)
            wall.append(time.monotonic() - started)
            after = os.times()
            cpu.append(after.children_user - before.children_user + after.children_system - before.children_system)
        costs[name] = {"cpu_s": statistics.median(cpu), "wall_s": statistics.median(wall)}
    return costs


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--widths", type=int, nargs="+", default=[256, 1024, 2048])
    parser.add_argument("--repeats", type=int, default=3, help="runs of each kind per width, alternating")
    options = parser.parse_args()
    scratch = scratch_dir("replica-groups-")
    project, package = bake(scratch, replica_groups="yes")
    meter = CpuMeter()
    imports = import_costs(project, package)
    steady = [steady_state(project, scratch / f"steady-{w}", w, options.steps, options.repeats) for w in options.widths]
    for row in steady:
        print(row, flush=True)
    failed = failures(project, scratch / "failures", options.kills)
    noise = meter.stop()
    result = {
        "machine": machine(),
        "noise": noise,
        "imports": imports,
        "steady_state": steady,
        "failures": failed,
        "options": vars(options),
    }
    (BENCH / "REPLICA_GROUPS.json").write_text(json.dumps(result, indent=2) + "\n")
    write_report(result)


def write_report(result):
    info, steady, failed = result["machine"], result["steady_state"], result["failures"]
    cold = statistics.median(row["torchrun_cold_start_s"] for row in steady)
    lines = [
        "# Replica groups (--fault-tolerance torchft) against the torchrun path",
        "",
        f"{info['nproc']} cores ({info['cpu']}), torch {info['torch']}, Python {info['python']}, {info['date']}; "
        f"other processes used {result['noise']['foreign_cores']:.2f} cores on average. torchft 0.2.0, lighthouse "
        f"`--heartbeat_timeout_ms {HEARTBEAT_MS}`. Command: `.venv/bin/python bench/replica_groups.py "
        f"--kills {result['options']['kills']} --steps {result['options']['steps']} --widths "
        f"{' '.join(map(str, result['options']['widths']))} --repeats {result['options']['repeats']}`.",
        "",
        "## Steady state (nothing fails): 2 replica groups x 1 rank against one torchrun job of 2 ranks",
        "",
        f"Same global batch ({GLOBAL_BATCH} samples a step), every step logged; per run the median samples/s after "
        f"step 50, then the median of {result['options']['repeats']} runs of each kind, run alternately. Ratio: of "
        "those medians; per pair: each replica-group run against the torchrun run just before it.",
        "",
        "| demo --width | torchrun path samples/s (step) | replica groups samples/s (step) | ratio | per pair | "
        "added per step | torchrun cold start (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in steady:
        pairs = ", ".join(f"{ratio:.2f}" for ratio in row["pair_ratios"])
        lines.append(
            f"| {row['width']} | {row['torchrun_samples_per_s']:.0f} ({row['torchrun_step_ms']:.1f} ms) | "
            f"{row['ft_samples_per_s']:.0f} ({row['ft_step_ms']:.1f} ms) | {row['ratio']:.2f}x | {pairs} | "
            f"{row['ft_step_ms'] - row['torchrun_step_ms']:.1f} ms | {row['torchrun_cold_start_s']:.2f} |"
        )
    lines += [
        "",
        "## One group's worker SIGKILLed: what the live group loses",
        "",
        f"Cold start for the ratios: the torchrun path's launch -> first step, median {cold:.2f} s (above). A replica "
        f"group's own cold start in this run: {failed['group_cold_start_s']:.2f} s.",
        "",
        "| kill | at step | rejoined at step | live group's steps meanwhile | live group's longest gap (s) | its "
        "median step (s) | live group lost (s) | lost / cold start | group 1: kill -> first step (s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for index, row in enumerate(failed["kills"], 1):
        lines.append(
            f"| {index} | {row['killed_at_step']} | {row['rejoined_at_step']} | {row['live_group_steps_meanwhile']} | "
            f"{row['live_longest_gap_s']:.2f} | {row['live_step_s']:.4f} | {row['live_lost_s']:.2f} | "
            f"{row['live_lost_s'] / cold:.2f}x | {row['restart_s']:.2f} |"
        )
    lines += torchrun_path(result, cold)
    (BENCH / "REPLICA_GROUPS.md").write_text("\n".join(lines) + "\n")


def torchrun_path(result, cold):
    """What the torchrun path's recovery is made of (bench/RECOVERY.json) and what of it is the project's own."""
    lines = [
        "",
        "## The torchrun path: what a restart costs, and what of it is the project's",
        "",
        "A fresh interpreter's imports, median of 5 (the restarted workers of the torchrun path pay them; the live "
        "replica group does not):",
        "",
        "| imports | CPU s | wall s |",
        "|---|---|---|",
    ]
    lines += [f"| {name} | {v['cpu_s']:.2f} | {v['wall_s']:.2f} |" for name, v in result["imports"].items()]
    recovery_file = BENCH / "RECOVERY.json"
    if not recovery_file.exists():
        return lines
    runs = [run for run in json.loads(recovery_file.read_text())["runs"] if run["ranks"] == 2]

    def median(mode, measure):
        return statistics.median(measure(run) for run in runs if run.get("mode", "cold") == mode)

    cold_start = median("cold", lambda run: run["cold"]["first_step"] - run["cold"]["launch"])
    cold_back = median("cold", lambda run: run["restart"]["first_step"] - run["kill"])
    imported = median("cold", lambda run: run["restart"]["torch_imported"] - run["kill"])
    warm_back = median("warm", lambda run: run["restart"]["first_step"] - run["kill"])
    costs = list(result["imports"].values())
    ours = costs[2]["cpu_s"] - costs[1]["cpu_s"]
    live = statistics.median(row["live_lost_s"] for row in result["failures"]["kills"])
    lines += [
        "",
        f"bench/RECOVERY.md (2 ranks, medians): with new interpreters (`WARM_RESTART=0`) the torchrun path is back "
        f"{cold_back:.2f} s after a kill against a cold start of {cold_start:.2f} s ({cold_back / cold_start:.2f}x); "
        f"the restarted workers have only imported torch {imported:.2f} s after the kill. The project's package "
        f"imports cost {ours:.2f} CPU s beyond torch and dynamo (above). Warm restarts (the default) skip those "
        f"imports: back {warm_back:.2f} s after a kill ({warm_back / cold_start:.2f}x), every rank of the job "
        f"waiting meanwhile. The replica groups above keep the live group's interpreter and its place: it loses a "
        f"median {live:.2f} s per failure ({live / cold:.2f}x of this run's torchrun cold start of {cold:.2f} s), "
        "the lighthouse's heartbeat timeout.",
    ]
    return lines


if __name__ == "__main__":
    main()
