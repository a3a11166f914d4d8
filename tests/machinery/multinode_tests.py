"""Several machines, played by torchrun agents on 127.0.0.1: one agent per "node", joined by a c10d rendezvous.

Each agent runs one rank (--nproc_per_node=1), so two agents make the same 2-rank world as one
`--standalone --nproc_per_node=2` run. --threads-per-rank 1 keeps the numerics of the two layouts the same.
"""

import json
import os
import re
import signal
import sys

from conftest import (
    QUICK,
    ROOT,
    assert_same_weights,
    child_env,
    default_config,
    default_datasets,
    final_model,
    finish,
    free_port,
    metrics,
    outputs,
    start,
    summary,
    wait_for,
    worker_pids,
)

STEPS = 200
ARGS = QUICK + ["--max-steps", str(STEPS), "--snapshot-every", "20", "--threads-per-rank", "1"]
# Seconds, not torchrun's defaults of 30 s (wait for more nodes) and 15 s (declare a silent node dead).
FAST_ELASTIC = "last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=2"


def agent_cmd(port, job, nnodes, is_host, rdzv_conf="", torchrun_args=()):
    """One node's torchrun; node 0 hosts the rendezvous, as the first node of a SLURM job does."""
    conf = ",".join(filter(None, [f"is_host={int(is_host)}", rdzv_conf]))
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={nnodes}",
        "--nproc_per_node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        f"--rdzv-id={job}",
        f"--rdzv-conf={conf}",
        *torchrun_args,
        str(ROOT / "train.py"),
    ]


def start_nodes(args_per_node, nnodes="2", env=None, **kwargs):
    port = free_port()
    env = child_env(LOGLEVEL="INFO", **(env or {}))  # LOGLEVEL: the agents say when they (re)start their workers
    return [
        start(agent_cmd(port, f"job-{port}", nnodes, node == 0, **kwargs) + args, env=env)
        for node, args in enumerate(args_per_node)
    ]


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


def progress_matches(progress, samples):
    """The data position adds up: `samples` consumed, every finished epoch less than one step short of the data.

    An epoch ends when fewer samples than one optimizer step (at most 2 ranks x batch here) are left in it.
    """
    size, step_samples = len(default_datasets()[0]), 2 * default_config().batch_size
    assert progress["samples_seen"] == samples, progress
    assert 0 <= progress["samples_in_epoch"] <= size, progress
    before_this_epoch = samples - progress["samples_in_epoch"]
    assert progress["epoch"] * (size - step_samples + 1) <= before_this_epoch <= progress["epoch"] * size, progress
    return True


def test_two_nodes_train_like_one_and_a_worker_killed_on_one_restarts_every_node(tmp_path, reference_runs):
    """Two agents of one rank each make one 2-rank world: killed on node 1, it resumes on both nodes and ends
    bitwise-equal to the one-node run."""
    agents = start_nodes([ARGS + outputs(tmp_path)] * 2, torchrun_args=["--max-restarts=3"])
    wait_for(lambda: committed(tmp_path / "run-snapshots", world_size=2), timeout=120, what="a first snapshot")
    victim = worker_pids(agents[1].pid)
    assert victim, "node 1 runs no worker"
    os.kill(next(iter(victim.values())), signal.SIGKILL)
    reference = reference_runs(ARGS)  # the one-node run, while the agents run
    results = finish_all(agents)
    for node, (code, out) in enumerate(results):
        assert code == 0, f"node {node} exited {code}:\n{out[-6000:]}"
        # Every node's agent joins a second round: its workers were restarted too.
        assert out.count("Rendezvous complete for workers") >= 2, f"node {node} did not restart:\n{out[-6000:]}"
    done = summary(tmp_path)
    assert done["resumed_from"] > 0 and (done["world_size"], done["steps"]) == (2, STEPS), done
    final = final_model(tmp_path / "run-snapshots")
    assert (final["step"], final["world_size"]) == (STEPS, 2)  # one world of two ranks, not two of one
    assert_same_weights(final["model"], reference["model"])


def test_elastic_job_loses_a_node_and_finishes_on_the_other(tmp_path):
    """--nnodes=1:2: when node 1 dies, node 0 alone resumes the 2-rank snapshot with 1 rank and finishes."""
    agents = start_nodes(
        [ARGS + outputs(tmp_path)] * 2, nnodes="1:2", rdzv_conf=FAST_ELASTIC, torchrun_args=["--max-restarts=3"]
    )
    wait_for(lambda: committed(tmp_path / "run-snapshots", world_size=2), timeout=120, what="a 2-rank snapshot")
    workers = worker_pids(agents[1].pid)
    os.killpg(agents[1].pid, signal.SIGKILL)  # the whole node: its agent, and its worker (in a session of its own)
    for pid in workers.values():
        os.kill(pid, signal.SIGKILL)
    finish(agents[1])
    code, out = finish(agents[0])
    assert code == 0, out[-6000:]
    done = summary(tmp_path)
    assert done["world_size"] == 1 and done["resumed_from"] > 0, done
    final = final_model(tmp_path / "run-snapshots")
    assert (final["step"], final["world_size"]) == (done["steps"], 1)
    # The run's length is kept in samples: the steps left after the 2-rank snapshot were trained by 1 rank, in
    # steps of half the size, so the job ends with more steps but the samples of STEPS 2-rank steps.
    step_samples = 2 * default_config().batch_size
    assert progress_matches(final["progress"], samples=STEPS * step_samples)
    assert done["samples_seen"] == STEPS * step_samples and done["steps"] > STEPS, done
    logged = [record["step"] for record in metrics(tmp_path)]
    assert logged == sorted(set(logged)), "every step once, in order, across the attempts"


def test_nodes_that_see_different_snapshot_folders_stop_at_start_up(tmp_path):
    """Two machines whose --snapshot-dir is not one shared folder (here: two folders) must not train."""
    folders = [tmp_path / "node0-snapshots", tmp_path / "node1-snapshots"]
    env = {"SHARED_FOLDER_WAIT_S": "1"}  # no network filesystem to wait for here
    node_args = [
        QUICK + outputs(tmp_path, f"node{node}") + ["--snapshot-dir", str(folder), "--log-file", ""]
        for node, folder in enumerate(folders)
    ]
    results = finish_all(start_nodes(node_args, env=env), timeout=120)
    out = "".join(out for _, out in results)
    assert all(code != 0 for code, _ in results), out[-6000:]
    # One line that names both folders: the one rank 0 writes to and the one rank 1 looks in.
    errors = [line for line in out.splitlines() if re.search(r"ERROR \[rank 0\] ", line)]
    assert any(str(folders[0]) in line and str(folders[1]) in line for line in errors), out[-6000:]
    assert not metrics(tmp_path, "node0") and not metrics(tmp_path, "node1"), "stopped before training"
