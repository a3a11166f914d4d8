"""Several machines, played by torchrun agents on 127.0.0.1: one agent per "node", joined by a c10d rendezvous.

Each agent runs one rank (--nproc_per_node=1), so two agents make the same 2-rank world as one
`--standalone --nproc_per_node=2` run. --threads-per-rank 1 keeps the numerics of the two layouts the same.
"""

import json
import os
import re
import signal
import sys

from conftest import (QUICK, ROOT, assert_same_weights, child_env, final_model, finish, free_port, outputs, start,
                      wait_for, worker_pids)

STEPS = 200
ARGS = QUICK + ["--max-steps", str(STEPS), "--snapshot-every", "20", "--threads-per-rank", "1"]
SAMPLES_PER_RANK_STEP = 32  # --batch-size default
DATASET_SIZE = int(QUICK[QUICK.index("--dataset-size") + 1])
# Seconds, not torchrun's defaults of 30 s (wait for more nodes) and 15 s (declare a silent node dead).
FAST_ELASTIC = "last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=2"
RESUMED = re.compile(r"(training|resuming) from step (\d+) of \d+: (\d+) rank\(s\)")


def agent_cmd(port, job, nnodes, is_host, rdzv_conf="", torchrun_args=()):
    """One node's torchrun; node 0 hosts the rendezvous, as the first node of a SLURM job does."""
    conf = ",".join(filter(None, [f"is_host={int(is_host)}", rdzv_conf]))
    return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", "--nproc_per_node=1",
            "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={job}", f"--rdzv-conf={conf}",
            *torchrun_args, str(ROOT / "train.py")]


def start_nodes(args_per_node, nnodes="2", env=None, **kwargs):
    port = free_port()
    env = child_env(LOGLEVEL="INFO", **(env or {}))  # LOGLEVEL: the agents say when they (re)start their workers
    return [start(agent_cmd(port, f"job-{port}", nnodes, node == 0, **kwargs) + args, env=env)
            for node, args in enumerate(args_per_node)]


def finish_all(agents, timeout=240):
    return [finish(agent, timeout) for agent in agents]


def committed(snapshot_dir, world_size=None):
    """Steps committed in snapshot_dir (by a job of world_size ranks, if given)."""
    steps = []
    for manifest in snapshot_dir.glob("step-*/manifest.json"):
        try:
            written = json.loads(manifest.read_text())
        except (OSError, ValueError):
            continue  # being pruned
        if world_size is None or written["world_size"] == world_size:
            steps.append(written["step"])
    return steps


def test_two_nodes_train_like_one_node_with_two_ranks(tmp_path, reference_runs):
    agents = start_nodes([ARGS + outputs(tmp_path)] * 2)
    reference = reference_runs(ARGS)  # the one-node run, while the agents run
    results = finish_all(agents)
    for node, (code, out) in enumerate(results):
        assert code == 0, f"node {node} exited {code}:\n{out[-6000:]}"
    assert "rank 0 of 2" in "".join(out for _, out in results)  # one world of two ranks, not two of one
    final = final_model(tmp_path / "run-snapshots")
    assert (final["step"], final["world_size"]) == (STEPS, 2)
    assert_same_weights(final["model"], reference["model"])


def test_killed_worker_on_one_node_restarts_every_node(tmp_path, reference_runs):
    agents = start_nodes([ARGS + outputs(tmp_path)] * 2, torchrun_args=["--max-restarts=3"])
    wait_for(lambda: committed(tmp_path / "run-snapshots"), timeout=120, what="a first snapshot")
    victim = worker_pids(agents[1].pid)
    assert victim, "node 1 runs no worker"
    os.kill(next(iter(victim.values())), signal.SIGKILL)
    results = finish_all(agents)
    for node, (code, out) in enumerate(results):
        assert code == 0, f"node {node} exited {code}:\n{out[-6000:]}"
        # Every node's agent joins a second round: its workers were restarted too.
        assert out.count("Rendezvous complete for workers") >= 2, f"node {node} did not restart:\n{out[-6000:]}"
    log = (tmp_path / "run.log").read_text()
    assert re.search(r"resuming from step [1-9]\d* of", log), log[-3000:]
    assert_same_weights(final_model(tmp_path / "run-snapshots")["model"], reference_runs(ARGS)["model"])


def test_elastic_job_loses_a_node_and_finishes_on_the_other(tmp_path):
    """--nnodes=1:2: when node 1 dies, node 0 alone resumes the 2-rank snapshot with 1 rank and finishes."""
    steps = STEPS
    args = QUICK + ["--max-steps", str(steps), "--snapshot-every", "20", "--threads-per-rank", "1"] + outputs(tmp_path)
    agents = start_nodes([args] * 2, nnodes="1:2", rdzv_conf=FAST_ELASTIC, torchrun_args=["--max-restarts=3"])
    wait_for(lambda: committed(tmp_path / "run-snapshots", world_size=2), timeout=120, what="a 2-rank snapshot")
    workers = worker_pids(agents[1].pid)
    os.killpg(agents[1].pid, signal.SIGKILL)  # the whole node: its agent, and its worker (in a session of its own)
    for pid in workers.values():
        os.kill(pid, signal.SIGKILL)
    finish(agents[1])
    code, out = finish(agents[0])
    assert code == 0, out[-6000:]
    log = (tmp_path / "run.log").read_text()
    assert "the snapshot was written by 2 rank(s) and this job has 1" in log, log[-3000:]
    final = final_model(tmp_path / "run-snapshots")
    assert (final["step"], final["world_size"]) == (steps, 1)
    # The data position carried over by samples seen: each attempt counted its own ranks' samples from the
    # step it resumed at up to the step the next one resumed at.
    attempts = [(int(step), int(ranks)) for _, step, ranks in RESUMED.findall(log)]
    assert attempts[-1][1] == 1 and attempts[-1][0] > 0, attempts
    bounds = [step for step, _ in attempts[1:]] + [steps]
    expected = sum((end - start) * ranks * SAMPLES_PER_RANK_STEP for (start, ranks), end in zip(attempts, bounds))
    progress = final["progress"]
    assert progress["samples_seen"] == expected, attempts
    # 2048 samples make whole steps for 1 and 2 ranks, so no epoch drops a remainder.
    assert progress["epoch"] * DATASET_SIZE + progress["samples_in_epoch"] == expected, progress


def test_nodes_that_see_different_snapshot_folders_stop_at_start_up(tmp_path):
    """Two machines whose --snapshot-dir is not one shared folder (here: two folders) must not train."""
    folders = [tmp_path / "node0-snapshots", tmp_path / "node1-snapshots"]
    env = {"SHARED_FOLDER_WAIT_S": "1"}  # no network filesystem to wait for here
    results = finish_all(start_nodes([QUICK + ["--snapshot-dir", str(folder), "--log-file", ""] for folder in folders],
                                     env=env), timeout=120)
    out = "".join(out for _, out in results)
    assert all(code != 0 for code, _ in results), out[-6000:]
    message = re.search(r"not every rank sees the snapshot folder (\S+) that rank 0 writes to \(rank 1 does not, "
                        r"looking in (\S+)\): on several machines, --snapshot-dir must be a folder they all share", out)
    assert message, out[-6000:]
    assert sorted(message.groups()) == sorted(map(str, folders))
    assert "step 1/" not in out  # stopped before training
