"""--break-at-step, --profile-steps, --check-replicas, --resume-from and the non-finite line (docs/debugging.md, "Find
a bug"): what a launch must show on a real 2-rank job, the rest in this process on one rank.
"""

import dataclasses
import gzip
import json
import logging
import os
import re

import breakpoint_probe
import pytest
import torch
from conftest import (
    EXACT,
    QUICK,
    ROOT,
    assert_same_weights,
    child_env,
    default_config,
    default_datasets,
    logged_steps,
    outputs,
    run,
    summary,
    train_cmd,
)
from test_debug import configuration, launch_json, resolve

import train
from {{ cookiecutter.project_slug }} import config
from {{ cookiecutter.project_slug }}.machinery import debugflags
from {{ cookiecutter.project_slug }}.machinery.batches import Batches
from {{ cookiecutter.project_slug }}.machinery.hooks import UserCode
from {{ cookiecutter.project_slug }}.machinery.step import Stepper

BREAK_AT = 5
HOLD_S = 3  # how long the stand-in debugger holds its rank: longer than --dist-timeout, so the others must wait
# tests/breakpoint_probe.py answers breakpoint(): it saves the frame's model and what its batch holds, then returns.
STAND_IN_DEBUGGER = {
    "PYTHONBREAKPOINT": "breakpoint_probe.record",
    "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}",
    "BREAK_HOLD_S": HOLD_S,
}


@pytest.mark.parametrize("value", ["3", "4:2", "0:2", "a:b", "1:2:3", "-1:4", " : "])
def test_a_bad_profile_range_is_one_line_before_torch_loads(capsys, value):
    with pytest.raises(SystemExit) as stopped:
        config.parse_args([f"--profile-steps={value}"])
    assert stopped.value.code == 2
    last_line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--profile-steps" in last_line and repr(value) in last_line


def test_a_good_profile_range_is_accepted():
    assert config.parse_args(["--profile-steps", "3:3"]).profile_steps == "3:3"
    assert config.parse_args([]).profile_steps == ""


def test_launch_json_breaks_at_the_step_it_asks_for(tmp_path):
    spec = configuration("Break at step...")
    resolved = resolve(spec, tmp_path, launch_json()["inputs"], choose=lambda asked: "42")
    assert (spec["module"], spec["subProcess"]) == ("torch.distributed.run", True)  # every rank under the debugger
    train_args = resolved["args"][resolved["args"].index(str(tmp_path / "train.py")) + 1 :]
    assert config.parse_args(train_args).break_at_step == 42


# In this process, single-rank: pytest's stdin is no terminal, as in a batch job.

DEBUGGER_VARIABLES = ("PYTHONBREAKPOINT", "DEBUG_RANK", "DEBUGPY_RUNNING", "DEBUG_POSTMORTEM")


@pytest.fixture
def no_debugger(monkeypatch):
    for name in DEBUGGER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def refused_at_start(tmp_path, args, name="run"):
    """train.main(args) in this process, which must stop before its first step: its exit code."""
    logged = logged_steps(tmp_path, name)
    with pytest.raises(SystemExit) as stopped:
        train.main(QUICK + ["--log-every", "1"] + args + outputs(tmp_path, name))
    assert logged_steps(tmp_path, name) == logged, "refused before the first step"
    return stopped.value.code


@pytest.mark.parametrize(
    "args",
    [
        ["--max-steps", "4", "--break-at-step", "5"],  # past the last step: the run would never stop
        ["--max-steps", "4", "--profile-steps", "5:6"],  # past the last step: the run would end with no trace
    ],
)
def test_a_step_past_the_end_of_the_run_is_refused_at_start_up(tmp_path, no_debugger, args):
    no_debugger.setenv("PYTHONBREAKPOINT", "0")
    assert refused_at_start(tmp_path, args) == 2


def test_pdb_without_a_terminal_is_refused_at_start_up_and_a_debugger_that_needs_none_is_not(tmp_path, no_debugger):
    assert refused_at_start(tmp_path, ["--max-steps", "2", "--break-at-step", "1"]) == 2
    no_debugger.setenv("PYTHONBREAKPOINT", "breakpoint_probe.record")
    no_debugger.setenv("BREAK_RECORD_DIR", str(tmp_path))
    train.main(QUICK + ["--max-steps", "2", "--break-at-step", "1"] + outputs(tmp_path, "probed"))
    assert json.loads((tmp_path / "rank0.json").read_text())["step"] == 1


@pytest.mark.parametrize("rebound, accumulate", [("batch", 1), ("micro_batches", 2)])
def test_the_step_trains_on_the_batch_rebound_in_the_debugger(tmp_path, no_debugger, rebound, accumulate):
    """breakpoint_probe.rebind fills the frame's `batch` (or `micro_batches`) with NaN at step 3, as a user at the
    prompt would: that step's loss is NaN, so the run stops at its log, with steps 1 and 2 logged only."""
    no_debugger.setenv("PYTHONBREAKPOINT", "breakpoint_probe.rebind")
    no_debugger.setenv("BREAK_REBIND", rebound)
    args = ["--max-steps", "4", "--log-every", "1", "--grad-accum", str(accumulate), "--break-at-step", "3"]
    with pytest.raises(SystemExit) as stopped:
        train.main(QUICK + args + outputs(tmp_path))
    assert stopped.value.code == 2
    assert logged_steps(tmp_path) == [1, 2]


def test_a_break_or_profile_the_run_resumes_past_is_said_at_start_up(tmp_path, no_debugger, caplog):
    """Resumed after step 4: --break-at-step 3 and --profile-steps 2:3 are warned about and the run trains on, also
    with pdb to answer breakpoint() and no terminal (a batch job relaunched with the command that broke at step 3:
    no debugger is needed); with --resume-from 4, which can only replay steps 5 on, refused. First, on the same run
    (one run for both checks): a replay of step 5 logs to its own file and warns that --max-steps changes the
    schedule."""
    train.main(QUICK + ["--max-steps", "4", "--snapshot-every", "2"] + outputs(tmp_path))
    run_log = (tmp_path / "run.log").read_bytes()
    caplog.clear()
    train.main(QUICK + ["--max-steps", "5", "--resume-from", "4"] + outputs(tmp_path))
    assert (tmp_path / "run.log").read_bytes() == run_log
    assert (tmp_path / "run.replay-4.log").stat().st_size > 0
    warned = [
        r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "--max-steps" in r.getMessage()
    ]
    assert len(warned) == 1, [r.getMessage() for r in caplog.records]
    caplog.clear()
    train.main(QUICK + ["--max-steps", "6", "--break-at-step", "3", "--profile-steps", "2:3"] + outputs(tmp_path))
    warned = [r for r in caplog.records if r.name == debugflags.__name__ and r.levelno == logging.WARNING]
    assert len(warned) == 2 and summary(tmp_path)["steps"] == 6, [r.getMessage() for r in caplog.records]
    assert refused_at_start(tmp_path, ["--max-steps", "6", "--resume-from", "4", "--break-at-step", "3"]) == 2


def test_replica_checksums_tell_permuted_rows_apart():
    model = torch.nn.Linear(4, 3)
    names, before = debugflags.checksums(model)
    with torch.no_grad():
        model.weight.copy_(model.weight[[2, 0, 1]])  # the same rows, in another order
    _, after = debugflags.checksums(model)
    changed = {names[index] for index in (before != after).any(dim=1).nonzero().flatten().tolist()}
    assert changed == {"weight"}


@pytest.mark.slow
@pytest.mark.parametrize("debug_rank, stopped", [(None, {0, 1}), ("1", {1})])
def test_break_at_step_stops_the_chosen_ranks_right_before_that_steps_forward(tmp_path, debug_rank, stopped):
    records = tmp_path / "breaks"
    records.mkdir()
    extra = dict(STAND_IN_DEBUGGER, BREAK_RECORD_DIR=records)
    if debug_rank is not None:
        extra["DEBUG_RANK"] = debug_rank  # with --break-at-step: the ranks that stop, and no debugpy at start-up
    args = ["--max-steps", "6", "--snapshot-every", "4", "--break-at-step", str(BREAK_AT), "--dist-timeout", "1"]
    run(train_cmd(2) + QUICK + args + outputs(tmp_path), env=child_env(**extra))

    assert {int(path.stem[4:]) for path in records.glob("rank*.json")} == stopped
    # Step N is the one that makes the step count N: the frame's model holds the weights after step N - 1.
    after_step_4 = torch.load(tmp_path / "run-snapshots" / "step-00000004" / "shared.pt", weights_only=True)["model"]
    for rank in stopped:
        record = json.loads((records / f"rank{rank}.json").read_text())
        assert record["step"] == BREAK_AT
        assert record["batch_tensors"] >= 1 and record["batch_devices"] == ["cpu"]
        parameters = torch.load(records / f"model-rank{rank}.pt", weights_only=True)
        assert parameters and set(parameters) <= set(after_step_4)
        assert_same_weights(parameters, {name: after_step_4[name] for name in parameters})
    assert summary(tmp_path)["steps"] == 6  # every rank went on after the stop, past a hold longer than the timeout


def inside(event, other):
    """Whether trace event `event` lies within `other` (another event of the same thread)."""
    start, end = event["ts"], event["ts"] + event["dur"]
    return other is not event and other["ts"] <= start and end <= other["ts"] + other["dur"]


def read_trace(path):
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt") as handle:
        return json.load(handle)


@pytest.mark.slow
def test_profile_steps_traces_each_rank_and_check_replicas_passes_a_healthy_run(tmp_path):
    """A healthy run whose model has a running statistic of the user's own (tests/fault_injection.py's
    RUNNING_MEAN, which differs across ranks after each forward by design): 4 checks, none of them a false alarm."""
    # A range past the run's end: the steps it took are traced, and the table names them.
    args = ["--max-steps", "8", "--profile-steps", "7:9", "--check-replicas", "2"]
    script = train_cmd(2, script="tests/fault_injection.py")
    result = run(script + QUICK + args + outputs(tmp_path), env=child_env(RUNNING_MEAN=1))

    traces = [path for path in (tmp_path / "profile").iterdir() if path.name.endswith((".json", ".json.gz"))]
    for rank in (0, 1):
        mine = [path for path in traces if f"rank{rank}" in path.name]
        assert len(mine) == 1, traces
        events = read_trace(mine[0])["traceEvents"]
        # Steps 7 and 8 only: two optimizer steps in the trace (torch names each Optimizer.step#<class>.step; the
        # steps of several optimizers that build_optimizer returned are inside the one of all of them).
        optimizer_steps = [e for e in events if e.get("ph") == "X" and e["name"].startswith("Optimizer.step#")]
        outermost = [e for e in optimizer_steps if not any(inside(e, other) for other in optimizer_steps)]
        assert len(outermost) == 2, [e["name"] for e in optimizer_steps]
    assert result.stdout.count("Self CPU time total") == 1, "rank 0 prints torch's table of the top operators"
    (heading,) = [line for line in result.stdout.splitlines() if "top operators" in line]
    assert re.search(r"\b7-8\b", heading), heading


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["parameter", "buffer"])
def test_check_replicas_stops_a_run_whose_replicas_drift_apart(tmp_path, kind):
    """Rank 1's copy of a tensor gets the same values in another order (its elements rolled by one) after step 8,
    a check step: the check that follows at once must see it. The tensor is a parameter, or a buffer that no forward
    changes, beside a running statistic that every forward changes (and that differs between ranks by design)."""
    model = UserCode("{{ cookiecutter.project_slug }}").build_model(default_config(), default_datasets()[0])
    tensor = [name for name, _ in model.named_parameters()][-1] if kind == "parameter" else "input_scale"
    fault = child_env(FAULT="desync_at_step", FAULT_RANK=1, FAULT_STEP=8, FAULT_TENSOR=tensor, RUNNING_MEAN=1)
    args = ["--max-steps", "30", "--check-replicas", "4", "--snapshot-every", "100"]
    cmd = train_cmd(2, script="tests/fault_injection.py") + QUICK + args + outputs(tmp_path)
    result = run(cmd, env=fault, check=False)

    assert result.returncode != 0 and re.search(r"exitcode\s*:\s*2\b", result.stdout), result.stdout[-4000:]
    named = [line for line in result.stdout.splitlines() if "ERROR" in line and tensor in line]
    assert len(named) == 1 and re.search(r"\b1\b", named[0].split(tensor, 1)[1]), result.stdout[-4000:]
    assert max(logged_steps(tmp_path)) == 5, "the run stops at the check of step 8, not at a later one"
    assert not (tmp_path / "run-export" / "model.pt").exists()


def files_and_bytes(folder):
    return {str(path.relative_to(folder)): path.read_bytes() for path in sorted(folder.rglob("*")) if path.is_file()}


@pytest.mark.slow
def test_resume_from_replays_a_kept_step_bit_for_bit_and_leaves_the_original_run_alone(tmp_path):
    command = train_cmd(2) + EXACT + ["--max-steps", "20"] + outputs(tmp_path)
    run(command)
    original = {name: files_and_bytes(tmp_path / name) for name in ("run-snapshots", "run-export")}
    metrics_before = (tmp_path / "run-metrics.jsonl").read_bytes()

    run(command + ["--resume-from", "10"])  # the run's own command, its metrics file included

    assert {name: files_and_bytes(tmp_path / name) for name in original} == original
    assert (tmp_path / "run-metrics.jsonl").read_bytes() == metrics_before
    replay_summary = json.loads((tmp_path / "run-snapshots.replay-10" / "export" / "summary.json").read_text())
    assert (replay_summary["resumed_from"], replay_summary["steps"]) == (10, 20)
    replayed, ended = (
        torch.load(tmp_path / folder / "step-00000020" / "shared.pt", weights_only=True)["model"]
        for folder in ("run-snapshots.replay-10", "run-snapshots")
    )
    assert_same_weights(replayed, ended)

    missing = run(train_cmd() + QUICK + ["--resume-from", "7"] + outputs(tmp_path), check=False)
    assert missing.returncode == 2 and "--resume-from" in missing.stdout.strip().splitlines()[-1], missing.stdout


# Where a NaN came from (machinery/nonfinite.py), in this process, with the NaN put in by the test.


def nan_at(monkeypatch, where, bad_step):
    """From step `bad_step` on (each time this process trains it, a replay too): the step's batch arrives with NaN
    inputs, or the loss of its finite outputs is NaN."""
    if where == "batch":
        draw = Batches.__next__

        def drawn_with_nan(self):
            micro_batches = draw(self)
            if self.progress.step + 1 == bad_step:
                micro_batches = [breakpoint_probe.nan_filled(batch) for batch in micro_batches]
            return micro_batches

        monkeypatch.setattr(Batches, "__next__", drawn_with_nan)
        return
    training = []  # the step being trained
    forward_backward, user_step = Stepper.forward_backward, UserCode._step

    def remember_step(self, micro_batches):
        training[:] = [self.progress.step + 1]
        return forward_backward(self, micro_batches)

    def nan_loss(self, model, batch):
        result = user_step(self, model, batch)
        if model.training and training == [bad_step]:
            result = dataclasses.replace(result, loss=result.loss * float("nan"))
        return result

    monkeypatch.setattr(Stepper, "forward_backward", remember_step)
    monkeypatch.setattr(UserCode, "_step", nan_loss)


def stopped_on_nan(tmp_path, caplog, args):
    with pytest.raises(SystemExit) as stopped:
        train.main(QUICK + ["--log-every", "1", "--eval-every", "0"] + args + outputs(tmp_path))
    assert stopped.value.code == 2
    (error,) = [record.getMessage() for record in caplog.records if record.levelno == logging.ERROR]
    return error


@pytest.mark.parametrize(
    "where, said",
    [("batch", "the batch of step 7 on rank 0 holds NaN"), ("loss", "every module's output was finite")],
)
def test_a_nan_in_the_batch_or_the_loss_alone_is_named_as_such(tmp_path, no_debugger, caplog, where, said):
    nan_at(no_debugger, where, 7)
    error = stopped_on_nan(tmp_path, caplog, ["--max-steps", "8", "--snapshot-every", "5"])
    assert said in error and "module '" not in error and "parameter '" not in error, error
    assert "--resume-from 5 --break-at-step 7" in error, error


def test_a_nan_before_any_snapshot_says_a_rerun_starts_from_scratch(tmp_path, no_debugger, caplog):
    nan_at(no_debugger, "batch", 3)
    error = stopped_on_nan(tmp_path, caplog, ["--max-steps", "8", "--snapshot-every", "5"])
    assert "None" not in error and "--resume-from" not in error and "scratch" in error, error
