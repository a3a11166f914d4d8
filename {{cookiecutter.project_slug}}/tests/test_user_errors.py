"""A user's bug reads as the user's bug: one line naming their function (and their line), on the rank where it
happened, within seconds; the traceback once; torchrun's summary and launch() name that rank.

Each mistake is made in a copy of this project (its model.py or data.py with a few lines added at the end), or
against UserCode directly where no launch is needed to show it.
"""

import importlib
import re
import sys
import textwrap
import time

import pytest
import torch
from conftest import PACKAGE, QUICK, child_env, outputs, project, run, train_cmd

from {{ cookiecutter.project_slug }}.machinery.faults import BadUserValue
from {{ cookiecutter.project_slug }}.machinery.hooks import UserCode
from {{ cookiecutter.project_slug }}.machinery.settings import RunError

RECORD = re.compile(
    r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d (DEBUG|INFO|WARNING|ERROR|CRITICAL) \[rank (\d+)\] [\w.]+: (.*)$", re.M
)
SHORT = QUICK + ["--max-steps", "6", "--batch-size", "8", "--eval-every", "0", "--snapshot-every", "100"]


def records(text, level, rank=None):
    """The messages of the console records of `level` (from `rank`, or any)."""
    return [m.group(3) for m in RECORD.finditer(text) if m.group(1) == level and rank in (None, int(m.group(2)))]


def line_of(workspace, file, text):
    """The line number of `text` in the copy's `file`."""
    lines = (workspace / PACKAGE / file).read_text().splitlines()
    return next(number for number, line in enumerate(lines, 1) if text in line)


def train_in(workspace, tmp_path, args, nproc=None, torchrun_args=(), timeout=300):
    cmd = train_cmd(nproc, torchrun_args, script=str(workspace / "train.py")) + args + outputs(tmp_path)
    return run(cmd, env=child_env(PYTHONPATH=workspace), cwd=workspace, check=False, timeout=timeout)


# -- an exception in a hook, on one rank ---------------------------------------------------------------------------

RAISES_ON_RANK_1 = """
import os

calls = [0]


def compute_loss(model, batch):
    inputs, targets = batch
    calls[0] += 1
    if os.environ.get("RANK") == "1" and calls[0] == 3:
        targets = targets[:3]  # the user's bug: shapes that do not match
    return F.cross_entropy(model(inputs), targets)
"""


def test_a_hook_that_raises_on_one_rank_is_one_line_there_and_torchruns_root_cause(tmp_path):
    workspace = project(tmp_path, model=RAISES_ON_RANK_1)
    line = line_of(workspace, "model.py", "return F.cross_entropy(model(inputs), targets)")
    result = train_in(workspace, tmp_path, SHORT, nproc=2, torchrun_args=["--max-restarts=0"])
    out = result.stdout
    assert result.returncode != 0, out[-4000:]
    (error,) = records(out, "ERROR", rank=1)
    assert "compute_loss in model.py raised ValueError" in error and f"model.py:{line}" in error, error
    assert not records(out, "ERROR", rank=0), "rank 0 only lost rank 1:\n" + out[-4000:]
    assert any("rank 1 failed" in warning for warning in records(out, "WARNING", rank=0)), out[-4000:]
    # The traceback once: the user's frame appears in one traceback, not again in torchrun's summary.
    assert len(re.findall(rf'model\.py", line {line}, in compute_loss', out)) == 1, out[-6000:]
    root_cause = out.split("Root Cause")[1]
    assert re.search(r"rank\s*: 1 ", root_cause) and f"model.py:{line}" in root_cause, root_cause


# -- the same error on every rank ------------------------------------------------------------------------------------

FLOAT64_BATCHES = """
whole_collate = globals().get("collate", torch.utils.data.default_collate)


def as_float64(value):
    if isinstance(value, (tuple, list)):
        return type(value)(as_float64(each) for each in value)
    if isinstance(value, dict):
        return {key: as_float64(each) for key, each in value.items()}
    return value.double() if torch.is_tensor(value) and value.is_floating_point() else value


def collate(items):
    return as_float64(whole_collate(items))  # the user's bug: float64 batches for a model of float32 parameters
"""


def test_an_error_every_rank_meets_alike_is_one_line_per_rank_and_one_traceback(tmp_path):
    workspace = project(tmp_path, data=FLOAT64_BATCHES)
    result = train_in(workspace, tmp_path, SHORT, nproc=2, torchrun_args=["--max-restarts=0"])
    out = result.stdout
    assert result.returncode == 1, out[-4000:]
    errors = {rank: records(out, "ERROR", rank=rank) for rank in (0, 1)}
    assert all(len(lines) <= 1 for lines in errors.values()), out[-6000:]
    (first, *_) = [line for lines in errors.values() for line in lines]
    assert "model.py raised RuntimeError" in first, first  # torch's own error, named in the user's forward
    # One rank's traceback (the other's at DEBUG) and torchrun's own.
    assert out.count("Traceback (most recent call last)") == 2, out[-6000:]
    assert "RuntimeError" in out.split("Root Cause")[1], out[-3000:]


# -- a refusal on one rank, under launch() ---------------------------------------------------------------------------

FLOAT_ON_RANK_1 = """
import os


def compute_loss(model, batch):
    inputs, targets = batch
    loss = F.cross_entropy(model(inputs), targets)
    return loss.item() if os.environ.get("RANK") == "1" else loss
"""

LAUNCH = """
from {package}.launch import launch, TrainingFailed
try:
    launch(nproc_per_node=2, args={args!r})
except TrainingFailed as exc:
    print("raised:", exc.rank, exc.cause)
"""


def test_what_the_trainer_refuses_on_one_rank_is_that_ranks_error_under_launch(tmp_path):
    workspace = project(tmp_path, model=FLOAT_ON_RANK_1)
    script = LAUNCH.format(package=PACKAGE, args=SHORT + outputs(tmp_path))
    result = run([sys.executable, "-c", script], env=child_env(PYTHONPATH=workspace), cwd=workspace, check=False)
    out = result.stdout
    (raised,) = [line for line in out.splitlines() if line.startswith("raised:")]
    assert raised.startswith("raised: 1 compute_loss in model.py returned a float"), out[-4000:]
    (error,) = records(out, "ERROR", rank=1)
    assert "compute_loss in model.py returned a float" in error
    assert not records(out, "ERROR", rank=0), out[-4000:]
    assert any("rank 1" in warning for warning in records(out, "WARNING", rank=0)), out[-4000:]


# -- ranks that disagree on the step's kind --------------------------------------------------------------------------

DICT_ON_RANK_0 = """
import os


def compute_loss(model, batch):
    inputs, targets = batch
    loss = F.cross_entropy(model(inputs), targets, reduction="sum")
    if os.environ.get("RANK") == "0":
        return {"loss": loss, "count": len(targets)}
    return loss / len(targets)
"""


def test_ranks_that_disagree_on_the_kind_of_step_are_told_at_the_first_step_without_a_hang(tmp_path):
    workspace = project(tmp_path, model=DICT_ON_RANK_0)
    started = time.monotonic()
    result = train_in(workspace, tmp_path, SHORT + ["--dist-timeout", "300"], nproc=2, timeout=200)
    assert time.monotonic() - started < 90, "the ranks waited for each other in different collectives"
    out = result.stdout
    assert result.returncode != 0, out[-4000:]
    (error,) = records(out, "ERROR")
    assert "compute_loss" in error and "rank 0" in error and "rank 1" in error and "dict" in error, error
    assert out.count("Traceback (most recent call last)") == 1, "torchrun's own only:\n" + out[-4000:]


# -- map-style data split per rank ------------------------------------------------------------------------------------

SPLIT_PER_RANK = """
import os

whole_datasets = build_datasets


def build_datasets(cfg):
    train, val = whole_datasets(cfg)
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    share = list(range(rank, len(train), world_size))
    return torch.utils.data.Subset(train, share[: len(share) - rank]), val  # an odd-sized split: rank 1's is shorter
"""


def test_map_style_data_split_per_rank_is_refused_at_start_up_in_one_line(tmp_path):
    workspace = project(tmp_path, data=SPLIT_PER_RANK)
    result = train_in(workspace, tmp_path, SHORT, nproc=2, torchrun_args=["--max-restarts=0"])
    out = result.stdout
    assert result.returncode != 0, out[-4000:]
    (error,) = records(out, "ERROR")
    assert "build_datasets" in error and "rank 0" in error and "rank 1" in error, error
    assert out.count("Traceback (most recent call last)") == 1, "torchrun's own only:\n" + out[-4000:]
    assert not list(tmp_path.glob("run-snapshots/step-*"))


# -- prepare_data: once per machine, before build_datasets, however long it takes ------------------------------------

PREPARE_DATA = """
import os
import time
from pathlib import Path

PREPARED = Path(os.environ["PREPARED_DIR"])
whole_datasets = build_datasets


def prepare_data(cfg):
    with open(PREPARED / "calls", "a") as calls:
        calls.write(os.environ.get("RANK", "0") + "\\n")
    if os.environ.get("PREPARE_FAILS"):
        raise ValueError("no such dataset on the hub")
    time.sleep(4)  # longer than --dist-timeout: the other rank must wait anyway
    (PREPARED / "cache").write_text(str(cfg.seed))


def build_datasets(cfg):
    with open(PREPARED / "built", "a") as built:
        built.write(os.environ.get("RANK", "0") + "\\n")
    assert int((PREPARED / "cache").read_text()) == cfg.seed  # what prepare_data wrote, read on every rank
    return whole_datasets(cfg)
"""


@pytest.mark.parametrize("fails", [False, True], ids=["prepares", "raises"])
def test_prepare_data_runs_once_per_machine_before_build_datasets_and_its_error_stops_every_rank(tmp_path, fails):
    workspace = project(tmp_path, data=PREPARE_DATA)
    line = line_of(workspace, "data.py", 'raise ValueError("no such dataset')
    env = child_env(PYTHONPATH=workspace, PREPARED_DIR=tmp_path, **({"PREPARE_FAILS": "1"} if fails else {}))
    started = time.monotonic()
    cmd = train_cmd(2, ["--max-restarts=0"], script=str(workspace / "train.py"))
    result = run(cmd + SHORT + ["--dist-timeout", "2"] + outputs(tmp_path), env=env, cwd=workspace, check=False)
    out = result.stdout
    assert (tmp_path / "calls").read_text().split() == ["0"], out[-4000:]  # local rank 0 only, once
    if not fails:
        assert result.returncode == 0, out[-4000:]
        assert sorted((tmp_path / "built").read_text().split()) == ["0", "1"]  # each after the cache was written
        return
    assert time.monotonic() - started < 90, "a rank waited for prepare_data after it failed"
    assert result.returncode == 1, out[-4000:]
    (error,) = records(out, "ERROR")
    assert error.startswith("prepare_data in data.py raised ValueError: no such dataset on the hub"), error
    assert f"data.py:{line}" in error, error
    # rank 1's warning, or torchrun's summary: the store's word that rank 0 failed in it, or rank 0's own line
    stopped = [line for line in out.splitlines() if "stopped because rank 0 failed" in line]
    assert any("prepare_data" in line for line in stopped), out[-4000:]
    assert not (tmp_path / "built").exists()  # no rank went on to build_datasets


# -- a hook that raises in a DataLoader worker -----------------------------------------------------------------------

COLLATE_RAISES = """
batches = [0]  # in the worker process that calls it


def collate(items):
    batches[0] += 1
    if batches[0] > 2:
        raise ValueError("this batch is not what collate expected")
    return torch.utils.data.default_collate(items)
"""


def test_collate_raising_in_a_dataloader_worker_is_one_line_naming_collate_and_its_line(tmp_path):
    workspace = project(tmp_path, data=COLLATE_RAISES)
    line = line_of(workspace, "data.py", 'raise ValueError("this batch')
    result = train_in(workspace, tmp_path, SHORT + ["--num-workers", "1"])
    out = result.stdout
    assert result.returncode == 1, out[-4000:]
    (error,) = records(out, "ERROR")
    assert error.startswith("collate in data.py raised ValueError: this batch is not what collate expected"), error
    assert f"data.py:{line}" in error, error


# -- a count of 0 for the whole validation set, and compute_loss beside val_metrics ------------------------------------

ZERO_COUNT = """
def compute_loss(model, batch):
    inputs, targets = batch
    loss = F.cross_entropy(model(inputs), targets, reduction="sum")
    return {"loss": loss, "count": len(targets) if model.training else 0}
"""


def test_a_validation_count_of_zero_is_one_line_and_an_unused_val_metrics_is_named(tmp_path):
    workspace = project(tmp_path, model=ZERO_COUNT)
    result = train_in(workspace, tmp_path, QUICK + ["--max-steps", "2", "--batch-size", "8", "--eval-every", "2"])
    out = result.stdout
    assert result.returncode == 2, out[-4000:]
    (error,) = records(out, "ERROR")
    assert "compute_loss" in error and "count" in error and "valid" in error, error
    assert "Traceback" not in out, out[-4000:]
    assert any("val_metrics" in warning and "not used" in warning for warning in records(out, "WARNING")), out


# -- torchrun's root cause after a warm restart ------------------------------------------------------------------------


def test_torchruns_root_cause_after_a_warm_restart_is_the_rank_that_failed(tmp_path):
    """Rank 1 fails at its 3rd step in every attempt; the restart runs in a fork of the job's zygote (the first
    attempt starts cold, as a user's does). The rank that only lost its peer exits first there, and torchrun breaks
    a tie of whole-second timestamps by exit order."""
    starts = tmp_path / "starts"
    env = child_env(FAULT="raise_at_step", FAULT_RANK=1, FAULT_STEP=3, RECORD_STARTS=starts, WARM_START_POOL="")
    cmd = train_cmd(2, ["--max-restarts=1"], script="tests/fault_injection.py") + SHORT + outputs(tmp_path)
    out = run(cmd, env=env, check=False).stdout
    assert (starts / "start-rank1-attempt1").read_text() == "warm", out[-4000:]
    root_cause = out.split("Root Cause")[1]
    assert re.search(r"rank\s*: 1 ", root_cause) and "injected failure on rank 1" in root_cause, root_cause
    stopped = out.split("Root Cause")[0].split("Failures:")[1]
    assert "stopped because rank 1 failed" in stopped, stopped


# -- two launch() calls at once, and a bad args --------------------------------------------------------------------

TWO_LAUNCHES = """
import threading, time
from {package}.launch import launch
from {package}.machinery import launcher

try:
    launch(args=123)
except TypeError as exc:
    print("args:", exc)
first = threading.Thread(target=launch, kwargs=dict(nproc_per_node=1, args={args!r}))
first.start()
while not launcher._RUNNING.locked():
    time.sleep(0.01)
started = time.monotonic()
try:
    launch(nproc_per_node=1, args={args!r})
except Exception as exc:
    print("second:", type(exc).__name__, round(time.monotonic() - started), exc)
first.join()
print("first done")
"""


def test_a_second_launch_while_one_runs_is_refused_in_one_line_and_args_must_be_flags(tmp_path):
    script = TWO_LAUNCHES.format(package=PACKAGE, args=QUICK + ["--max-steps", "3"] + outputs(tmp_path))
    result = run([sys.executable, "-c", script], env=child_env(), cwd=tmp_path)
    out = result.stdout
    (args,) = [line for line in out.splitlines() if line.startswith("args:")]
    assert "args" in args[5:] and "int" in args and "list" in args, args
    (second,) = [line for line in out.splitlines() if line.startswith("second:")]
    assert second.startswith("second: RunError 0 ") and "already running" in second, out[-4000:]
    assert "first done" in out


# -- what the hooks return, checked where it is made (in process) ----------------------------------------------------

MODEL = """
import torch
import torch.nn.functional as F


def build_model(cfg, train):
    return torch.nn.Linear(4, 3)


def loss_fn(outputs, targets):
    return F.cross_entropy(outputs, targets)
"""
DATA = """
import torch


def build_datasets(cfg):
    return [(torch.randn(4), torch.tensor(0)) for _ in range(8)], None
"""


@pytest.fixture
def user_code(tmp_path, monkeypatch):
    """UserCode of a package made of MODEL and DATA plus the given lines."""
    monkeypatch.syspath_prepend(str(tmp_path))
    made = []

    def make(model="", data=""):
        package = tmp_path / f"userpkg{len(made)}"
        package.mkdir()
        (package / "__init__.py").write_text("")
        (package / "model.py").write_text(MODEL + textwrap.dedent(model))
        (package / "data.py").write_text(DATA + textwrap.dedent(data))
        made.append(package.name)
        importlib.invalidate_caches()
        return UserCode(package.name)

    yield make
    for name in [m for m in sys.modules if m.startswith("userpkg")]:
        del sys.modules[name]  # the next test's packages have the same names


@pytest.mark.parametrize(
    "returned, words",
    [
        ("None", ["build_optimizer", "None"]),
        ("[torch.optim.SGD(model.parameters(), lr=0.1), 'adam']", ["build_optimizer", "list"]),
        ("model.parameters()", ["build_optimizer", "generator"]),
    ],
)
def test_build_optimizer_returning_no_optimizer_is_one_line(user_code, returned, words):
    user = user_code(f"\ndef build_optimizer(cfg, model):\n    return {returned}\n")
    with pytest.raises(RunError) as refused:
        user.build_optimizer(None, torch.nn.Linear(2, 2))
    assert all(word in str(refused.value) for word in words), refused.value
    both = user_code("\ndef build_optimizer(cfg, model):\n    return [torch.optim.SGD(model.parameters(), lr=0.1)]\n")
    assert isinstance(both.build_optimizer(None, torch.nn.Linear(2, 2)), list)  # a list of optimizers is allowed


@pytest.mark.parametrize(
    "returned, words",
    [
        ("torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)", ["build_scheduler", "ReduceLROnPlateau"]),
        ("None", ["build_scheduler", "None"]),
        ("optimizer", ["build_scheduler", "SGD"]),
        ("[torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)]", ["build_scheduler", "list"]),
    ],
)
def test_build_scheduler_returning_what_the_loop_cannot_step_is_one_line(user_code, returned, words):
    user = user_code(f"\ndef build_scheduler(cfg, optimizer, total_steps):\n    return {returned}\n")
    optimizer = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(RunError) as refused:
        user.build_scheduler(None, optimizer, 10)
    assert all(word in str(refused.value) for word in words), refused.value


def test_a_stream_as_validation_data_is_refused_at_start_up(user_code):
    user = user_code(
        data="""
        class Stream(torch.utils.data.IterableDataset):
            def __iter__(self):
                return iter([])


        def build_datasets(cfg):
            return [(torch.randn(4), torch.tensor(0))] * 8, Stream()
        """
    )
    with pytest.raises(RunError, match="build_datasets.*IterableDataset"):
        user.build_datasets(None)


@pytest.mark.parametrize("which", ["train", "val"])
def test_a_map_style_dataset_without_len_is_refused_at_start_up(user_code, which):
    user = user_code(
        data=f"""
        class NoLength(torch.utils.data.Dataset):
            def __getitem__(self, index):
                return torch.randn(4), torch.tensor(0)


        def build_datasets(cfg):
            items = [(torch.randn(4), torch.tensor(0))] * 8
            return {"NoLength(), items" if which == "train" else "items, NoLength()"}
        """
    )
    with pytest.raises(RunError, match="build_datasets.*NoLength.*len"):
        user.build_datasets(None)


def test_items_of_different_sizes_with_the_default_collate_ask_for_collate_in_data_py(user_code):
    user = user_code()
    with pytest.raises(BadUserValue, match=r"collate\(items\) in data\.py"):
        user.collate([torch.zeros(3), torch.zeros(5)])
    assert user.collate([torch.zeros(3), torch.zeros(3)]).shape == (2, 3)


def test_a_loss_without_grad_and_an_empty_batch_are_named_before_backward(user_code):
    detached = user_code(
        """
        def compute_loss(model, batch):
            inputs, targets = batch
            with torch.no_grad():
                return F.cross_entropy(model(inputs), targets)
        """
    )
    model = torch.nn.Linear(4, 3)
    batch = (torch.randn(2, 4), torch.tensor([0, 1]))
    with pytest.raises(BadUserValue, match="compute_loss.*does not require grad"):
        detached.step(model, batch)
    model.eval()
    assert detached.step(model, batch).loss.shape == ()  # evaluation needs no grad
    model.train()
    with pytest.raises(BadUserValue, match="0 items"):
        user_code().step(model, (torch.randn(0, 4), torch.zeros(0, dtype=torch.long)))


def test_compute_loss_beside_val_metrics_is_named_as_unused(user_code):
    user = user_code(
        """
        def compute_loss(model, batch):
            return model(batch[0]).mean()


        def val_metrics(outputs, targets):
            return {}
        """
    )
    (line,) = user.unused()
    assert "val_metrics" in line and "compute_loss" in line
    assert user_code().unused() == []


# -- snapshot parts that do not fit ---------------------------------------------------------------------------------


class Counter:
    """A part of extra_state: a count, whose load_state_dict may refuse what it is given."""

    def __init__(self, refuse=False):
        self.count, self.refuse = torch.zeros(()), refuse

    def state_dict(self):
        return {"count": self.count}

    def load_state_dict(self, state):
        if self.refuse:
            raise ValueError("the counter wants a 'total'")
        self.count.copy_(state["count"])


@pytest.mark.parametrize("name", ["world_size", "sharded_dir", "rank_state", "step", "scheduler"])
def test_an_extra_part_named_as_an_entry_of_the_snapshot_is_refused(name):
    from {{ cookiecutter.project_slug }}.machinery.state import checked_parts

    with pytest.raises(RunError, match=f"extra_state.*{name!r}"):
        checked_parts({name: Counter()})
    assert list(checked_parts({"counter": Counter()})) == ["counter"]


def parts(sharded=False, optimizers=("SGD",), extra=None):
    """A TrainState of a small model, its optimizer(s) (by class name) and extra parts, as start-up adds them."""
    from {{ cookiecutter.project_slug }}.machinery.distributed import DistEnv
    from {{ cookiecutter.project_slug }}.machinery.optim import OptimizerPart, as_optimizer
    from {{ cookiecutter.project_slug }}.machinery.state import ModelPart, TrainState

    model = torch.nn.Linear(2, 2)
    optimizer = as_optimizer([getattr(torch.optim, name)(model.parameters(), lr=0.1) for name in optimizers])
    state = TrainState(DistEnv(), sharded=sharded)
    state.add("model", ModelPart(model))
    state.add("optimizer", OptimizerPart(optimizer))
    for name, part in (extra or {}).items():
        state.add(name, part, extra=True)
    return state


def saved(state):
    """What a ddp snapshot of `state` holds, as resume() gives it back."""
    shared, _, _ = state.capture()
    return {**shared, "rank_state": None, "world_size": 1, "sharded_dir": ""}


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # a save in one process, without a group: meant
def test_an_extra_part_added_since_the_snapshot_is_named_under_ddp_and_fsdp(tmp_path):
    import torch.distributed.checkpoint as dcp

    with pytest.raises(RunError, match="'ema'.*extra_state"):
        parts(extra={"ema": Counter()}).restore(saved(parts()), "step-00000010")
    # fsdp: the model's and optimizer's shards in torch.distributed.checkpoint's files, no part "ema" among them
    before = parts(sharded=True)
    shared, _, _ = before.capture()
    dcp.save({"model": torch.nn.Linear(2, 2).state_dict()}, checkpoint_id=str(tmp_path), no_dist=True)
    resumed = {**shared, "rank_state": None, "world_size": 2, "sharded_dir": str(tmp_path)}
    with pytest.raises(RunError, match="'ema'.*extra_state"):
        parts(sharded=True, extra={"ema": Counter()}).restore(resumed, "step-00000010")


def test_an_extra_part_whose_load_state_dict_raises_is_named_with_its_error():
    with pytest.raises(RunError, match="'counter'.*ValueError.*the counter wants a 'total'"):
        parts(extra={"counter": Counter(refuse=True)}).restore(saved(parts(extra={"counter": Counter()})), "there")


@pytest.mark.parametrize(
    "then, now",
    [
        (("SGD", "SGD"), ("SGD",)),
        (("SGD",), ("SGD", "SGD")),
        (("AdamW",), ("SGD",)),
        (("SGD", "AdamW"), ("SGD", "SGD")),
    ],
)
def test_a_snapshot_of_other_optimizers_says_what_it_holds_and_what_build_optimizer_returns(then, now):
    with pytest.raises(RunError) as refused:
        parts(optimizers=now).restore(saved(parts(optimizers=then)), "there")
    line = str(refused.value)
    assert ", ".join(then) in line and ", ".join(now) in line and "build_optimizer" in line, line
