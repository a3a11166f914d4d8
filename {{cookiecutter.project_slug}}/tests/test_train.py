"""Training runs for real: one process, torchrun on gloo, logging per rank, wandb offline, resume."""

import collections
import json
import logging
import math
import os
import re
import sys

import pytest
import torch
from conftest import (
    QUICK,
    ROOT,
    assert_same_weights,
    child_env,
    default_datasets,
    final_model,
    metrics,
    outputs,
    run,
    summary,
    train_cmd,
)

INFO_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d INFO \[rank (\d+)\] (.*)$", re.M)


def test_single_process_trains_and_summarizes(tmp_path):
    result = run(train_cmd() + QUICK + ["--max-steps", "30", "--snapshot-every", "10"] + outputs(tmp_path))
    done = summary(tmp_path)
    assert (done["world_size"], done["steps"], done["total_steps"], done["resumed_from"]) == (1, 30, 30, -1)
    assert done["last_loss"] < done["first_loss"], done
    assert not done["already_complete"] and done["stop_signal"] == 0
    assert sorted(p.name for p in (tmp_path / "run-snapshots").glob("step-*")) == [
        "step-00000010",
        "step-00000020",
        "step-00000030",
    ]
    # One metrics record per logged step; evaluation at the end joins the last one when there is validation data.
    records = metrics(tmp_path)
    assert [r["step"] for r in records] == [5, 10, 15, 20, 25, 30]
    assert all({"loss", "lr", "samples_per_s", "epoch"} <= r.keys() for r in records), records[0]
    # Each logged step's peak memory (one rank: its own); each part of the run's step time, in the summary
    assert all(r["peak_memory_mib"] > 0 and r["peak_memory_rank"] == 0 for r in records), records[0]
    (step_times,) = done["step_times"]
    assert step_times["steps"] == 30 and step_times["compute"] > 0 and step_times["data"] > 0, step_times
    assert {"optimizer", "wait", "snapshot"} <= step_times.keys() and done["straggler"] is None
    assert records[-1]["loss"] == done["last_loss"] and records[0]["loss"] == done["first_loss"]
    _, val = default_datasets()
    if val is not None:
        assert math.isfinite(records[-1]["val_loss"]) and records[-1]["val_loss"] == done["val_loss"]
    # The exported weights are the final model, as a plain state dict.
    exported = torch.load(tmp_path / "run-export" / "model.pt", weights_only=True)
    assert_same_weights(exported, final_model(tmp_path / "run-snapshots")["model"])
    # The log file holds what rank 0 printed.
    console = INFO_LINE.findall(result.stdout)
    assert console and INFO_LINE.findall((tmp_path / "run.log").read_text()) == console


# One 2-rank run serves the tests below it: main() runs in a script that, once main() has returned, writes down
# the threads each rank still has.
LEFT_THREADS = """
import os, sys
import train
train.main(sys.argv[1:])
if os.path.isdir("/proc/self/task"):
    names = sorted(open(f"/proc/self/task/{task}/comm").read().strip() for task in os.listdir("/proc/self/task"))
    with open(os.path.join(os.environ["THREADS_OUT"], f"rank{os.environ['RANK']}.txt"), "w") as handle:
        handle.write(" ".join(names))
"""


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory):
    """(console output, folder) of a finished 2-rank run of 20 steps."""
    tmp_path = tmp_path_factory.mktemp("two-ranks")
    script = tmp_path / "run_main.py"
    script.write_text(LEFT_THREADS)
    cmd = train_cmd(nproc=2)[:-1] + [str(script)]
    result = run(cmd + QUICK + ["--max-steps", "20"] + outputs(tmp_path), env=child_env(THREADS_OUT=tmp_path))
    return result.stdout, tmp_path


def test_two_ranks_log_each_info_record_once(two_rank_run):
    console, tmp_path = two_rank_run
    records = INFO_LINE.findall(console)
    assert records, console
    assert {rank for rank, _ in records} == {"0"}, "INFO records must come from rank 0 only"
    counts = collections.Counter(message for _, message in records)
    assert max(counts.values()) == 1, f"repeated records: {[m for m, n in counts.items() if n > 1]}"
    done = summary(tmp_path)
    assert (done["world_size"], done["steps"]) == (2, 20)
    assert [each["steps"] for each in done["step_times"]] == [20, 20], done["step_times"]
    assert all(r["peak_memory_rank"] in (0, 1) and r["peak_memory_mib"] > 0 for r in metrics(tmp_path))


def test_quiet_ranks_stay_quiet_without_debug_all_ranks(two_rank_run):
    console, _ = two_rank_run
    assert "[rank 1]" not in console


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads the threads of a process from /proc")
def test_a_finished_run_ends_the_process_group_before_the_interpreter_exits(two_rank_run):
    """No gloo or store thread is left when main() returns: none can run into interpreter shutdown and abort
    a process whose run succeeded."""
    _, tmp_path = two_rank_run
    left = {path.stem: path.read_text().split() for path in tmp_path.glob("rank*.txt")}
    assert left.keys() == {"rank0", "rank1"}, left
    for rank, names in left.items():
        stray = [name for name in names if name.startswith(("gloo", "pt_gloo", "pt_tcpstore"))]
        assert not stray, f"{rank} still runs {stray} after main() returned"


def test_error_on_rank_1_reaches_console_tagged_and_torchrun_summary(tmp_path):
    cmd = train_cmd(nproc=2, script="tests/fault_injection.py") + QUICK + ["--max-steps", "30"] + outputs(tmp_path)
    result = run(cmd, env=child_env(FAULT="raise_at_step", FAULT_RANK=1, FAULT_STEP=5), check=False)
    assert result.returncode != 0
    assert re.search(r"ERROR \[rank 1\] ", result.stdout), result.stdout[-4000:]
    assert "Traceback" in result.stdout
    assert "RuntimeError: injected failure on rank 1 at step 5" in result.stdout
    # torchrun's failure summary names the rank and its exception (from @record's error file).
    torchrun_summary = result.stdout[result.stdout.find("Root Cause") :]
    assert "rank      : 1" in torchrun_summary and "injected failure on rank 1" in torchrun_summary, torchrun_summary
    assert "[rank 1]" in (tmp_path / "run.log").read_text(), "other ranks' errors must reach the log file too"
    assert not (tmp_path / "run-export" / "summary.json").exists(), "a failed run does not summarize"


def test_debug_all_ranks_and_per_rank_log_files(tmp_path):
    log_file = str(tmp_path / "rank{rank}.log")
    cmd = train_cmd(nproc=2) + QUICK + ["--max-steps", "5"] + outputs(tmp_path) + ["--log-file", log_file]
    result = run(cmd, env=child_env(DEBUG_ALL_RANKS=1))
    assert re.search(r"DEBUG \[rank 1\] ", result.stdout)
    assert re.search(r"INFO \[rank 1\]", result.stdout), "DEBUG_ALL_RANKS=1 puts every rank's records on the console"
    rank1 = (tmp_path / "rank1.log").read_text()
    assert "DEBUG [rank 1]" in rank1 and "[rank 0]" not in rank1


def test_logging_setup_twice_adds_no_duplicate_handlers(capfd):
    sys.path.insert(0, str(ROOT))
    from {{ cookiecutter.project_slug }}.machinery import logs

    logs.setup(0)
    logs.setup(0)
    logging.getLogger("{{ cookiecutter.project_slug }}.test").info("hello once")
    assert capfd.readouterr().err.count("hello once") == 1


def test_wandb_offline_makes_one_run_on_rank_0_and_keeps_its_id_on_relaunch(tmp_path):
    env = child_env(WANDB_DIR=tmp_path, WANDB_SILENT="true")
    args = ["--wandb", "offline", "--snapshot-every", "10"] + outputs(tmp_path)
    run(train_cmd(nproc=2) + args + ["--max-steps", "10"], env=env)
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, runs
    run_id = json.loads((tmp_path / "run-snapshots" / "run.json").read_text())["run_id"]
    assert runs[0].name.endswith(run_id)
    # the run's history holds what the metrics file does (the history's keys are plain strings in its records)
    history = b"".join(path.read_bytes() for path in runs[0].glob("*.wandb"))
    assert all(key in history for key in (b"samples_per_s", b"peak_memory_mib", b"peak_memory_rank")), runs

    run(train_cmd(nproc=2) + args + ["--max-steps", "20"], env=env)
    assert (summary(tmp_path)["resumed_from"], summary(tmp_path)["steps"]) == (10, 20)
    runs = sorted((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(r.name.endswith(run_id) for r in runs), runs


def test_wandb_online_without_an_api_key_is_one_line_naming_offline_and_exits_2(tmp_path):
    # No key anywhere (no WANDB_API_KEY, an empty home: no netrc, no wandb settings) and wandb's own telemetry off:
    # wandb refuses before it opens a connection; a server on this machine stands in for wandb's in case it would not.
    home = tmp_path / "home"
    env = child_env(
        HOME=home,
        XDG_CONFIG_HOME=home / ".config",
        NETRC=home / ".netrc",
        WANDB_DIR=tmp_path,
        WANDB_ERROR_REPORTING="false",
        WANDB_BASE_URL="http://127.0.0.1:9",
    )
    result = run(train_cmd() + ["--wandb", "online", "--max-steps", "5"] + outputs(tmp_path), env=env, check=False)
    assert result.returncode == 2, result.stdout[-4000:]
    errors = [line for line in result.stdout.splitlines() if " ERROR " in line or line.startswith("error")]
    assert len(errors) == 1 and "--wandb offline" in errors[0], result.stdout[-4000:]
    assert "Traceback" not in result.stdout, result.stdout[-4000:]


def test_second_launch_resumes_from_the_snapshot(tmp_path):
    base = train_cmd(nproc=2) + QUICK + ["--snapshot-every", "10"] + outputs(tmp_path)
    run(base + ["--max-steps", "20"])
    first = summary(tmp_path)
    assert (first["resumed_from"], first["steps"]) == (-1, 20)
    run(base + ["--max-steps", "30"])
    second = summary(tmp_path)
    assert (second["resumed_from"], second["steps"], second["total_steps"]) == (20, 30, 30)
    assert second["first_loss"] == first["first_loss"], "the run's first loss is kept across launches"
    assert [r["step"] for r in metrics(tmp_path)] == [5, 10, 15, 20, 25, 30]

    # The same command once more: nothing left to train. It succeeds and reports the real last loss.
    run(base + ["--max-steps", "30"])
    again = summary(tmp_path)
    assert again["already_complete"] is True
    assert (again["resumed_from"], again["steps"]) == (30, 30)
    assert again["last_loss"] is not None and math.isfinite(again["last_loss"])
    assert again["last_loss"] == second["last_loss"]
    assert [r["step"] for r in metrics(tmp_path)] == [5, 10, 15, 20, 25, 30]
    exported = torch.load(tmp_path / "run-export" / "model.pt", weights_only=True)
    assert_same_weights(exported, final_model(tmp_path / "run-snapshots")["model"])


def test_gradient_accumulation_skips_the_all_reduce_on_early_micro_steps(tmp_path):
    cmd = (
        train_cmd(nproc=2, script="tests/fault_injection.py") + QUICK + ["--max-steps", "6", "--snapshot-every", "100"]
    )
    counts = {}
    for accum in (1, 4):
        result = run(
            cmd + ["--grad-accum", str(accum)] + outputs(tmp_path, f"accum{accum}"), env=child_env(COUNT_ALLREDUCE=1)
        )
        counts[accum] = int(re.search(r"gradient all-reduces: (\d+)", result.stdout).group(1))
    assert counts[1] > 0 and counts[4] == counts[1], counts


def test_mixed_precision_bf16_trains(tmp_path):
    run(train_cmd(nproc=2) + QUICK + ["--max-steps", "30", "--amp", "bf16", "--grad-accum", "2"] + outputs(tmp_path))
    done = summary(tmp_path)
    assert done["steps"] == 30 and done["last_loss"] < done["first_loss"], done


def test_a_damaged_run_file_is_one_error_and_the_run_gives_the_folder_up(tmp_path):
    folder = tmp_path / "run-snapshots"
    folder.mkdir()
    (folder / "run.json").write_text("{not json")
    result = run(train_cmd() + QUICK + ["--max-steps", "5"] + outputs(tmp_path), check=False)
    assert result.returncode == 2, result.stdout[-3000:]
    errors = [line for line in result.stdout.splitlines() if " ERROR [rank 0] " in line]
    assert len(errors) == 1 and str(folder / "run.json") in errors[0], result.stdout[-3000:]
    assert not (folder / "job.lock").exists(), "a failed start-up gives the folder up"
    assert not metrics(tmp_path), "nothing was trained"


def test_progress_bar_on_rank_0_only(tmp_path):
    """On a terminal, tqdm draws one bar (rank 0's), not one per rank."""
    import fcntl
    import os
    import pty
    import struct
    import termios

    cmd = train_cmd(nproc=2) + QUICK + ["--max-steps", "20", "--log-every", "100"] + outputs(tmp_path)
    pid, fd = pty.fork()
    if pid == 0:  # the child: torchrun with a terminal as its console (tqdm draws nothing 0 columns wide)
        fcntl.ioctl(0, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
        os.chdir(ROOT)
        os.execve(cmd[0], cmd, child_env())
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    _, status = os.waitpid(pid, 0)
    screen = b"".join(chunks).decode(errors="replace")
    assert os.waitstatus_to_exitcode(status) == 0, screen[-3000:]
    bars_started = re.findall(r"\| 0/20 \[", screen)
    assert len(bars_started) == 1, screen[-3000:]
