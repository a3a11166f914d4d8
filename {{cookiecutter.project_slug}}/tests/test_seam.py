"""The seam a user fills (data.py, model.py) and what the trainer promises around it, whatever the model:
the data position and the schedule, exact evaluation, export, resume control, and a run that diverges.

Nothing here names the demo's settings or classes: these tests pass unchanged with your own model and data.
"""

import math
import re
import sys

import pytest
import torch
from conftest import QUICK, ROOT, child_env, metrics, outputs, run, summary, train_cmd

sys.path.insert(0, str(ROOT))

from {{ cookiecutter.project_slug }} import config, model
from {{ cookiecutter.project_slug }}.data import build_datasets
from {{ cookiecutter.project_slug }}.machinery.batches import Batches, Progress, RunLength
from {{ cookiecutter.project_slug }}.machinery.distributed import DistEnv
from {{ cookiecutter.project_slug }}.machinery.optim import OptimizerPart, SampleSchedule, SchedulerPart
from {{ cookiecutter.project_slug }}.machinery.snapshot import Snapshots, capture_rng, load_latest
from {{ cookiecutter.project_slug }}.machinery.state import ModelPart, RngPart, TrainState

FAST = ["--wandb", "disabled", "--log-every", "5"]


def cfg_of(*args):
    return config.parse_args(["--wandb", "disabled", *args])


# The data position and the schedule, in process.


class Indices(torch.utils.data.Dataset):
    """A dataset whose items are their own indices, to see which samples a step takes."""

    def __init__(self, size):
        self.size = size

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        return torch.tensor(index), torch.tensor(0)


def steps_taken(dataset, cfg, world_size, progress, steps):
    """The sample indices each of `steps` optimizer steps takes on all ranks together, from `progress`."""
    taken = [[] for _ in range(steps)]
    for rank in range(world_size):
        rank_progress = Progress(**vars(progress))
        batches = Batches(dataset, cfg, DistEnv(rank=rank, world_size=world_size), rank_progress, None)
        for step in range(steps):
            taken[step] += [int(i) for inputs, _ in next(batches) for i in inputs]
    return taken, rank_progress


@pytest.mark.parametrize("world_size, grad_accum", [(1, 1), (2, 1), (3, 2)])
def test_k_steps_take_exactly_the_first_k_global_batches_of_the_epoch_order(world_size, grad_accum):
    cfg = cfg_of("--batch-size", "4", "--grad-accum", str(grad_accum))
    dataset, global_batch = Indices(101), world_size * 4 * grad_accum
    order = torch.randperm(101, generator=torch.Generator().manual_seed(cfg.seed)).tolist()
    per_epoch = 101 // global_batch
    taken, progress = steps_taken(dataset, cfg, world_size, Progress(), per_epoch + 2)
    for step in range(per_epoch):
        assert sorted(taken[step]) == sorted(order[step * global_batch : (step + 1) * global_batch])
    # The epoch's leftover (101 is no multiple of the global batch) is skipped; the next epoch has its own order.
    next_order = torch.randperm(101, generator=torch.Generator().manual_seed(cfg.seed + 1)).tolist()
    assert sorted(taken[per_epoch]) == sorted(next_order[:global_batch])
    assert (progress.epoch, progress.samples_in_epoch) == (1, 2 * global_batch)

    # Resuming from the position after 3 steps takes what the uninterrupted run took next.
    position = Progress(samples_in_epoch=3 * global_batch, samples_seen=3 * global_batch)
    resumed, _ = steps_taken(dataset, cfg, world_size, position, 2)
    assert resumed == taken[3:5]


def test_the_run_length_and_the_schedule_are_kept_in_samples_across_world_sizes():
    cfg = cfg_of("--max-steps", "60", "--warmup-steps", "10", "--lr", "0.01")
    length = RunLength(cfg, step_samples=32, train_size=10_000)
    assert length.lr(0) == pytest.approx(0.001) and length.lr(9 * 32) == pytest.approx(0.01)
    assert length.lr(10 * 32) == pytest.approx(0.01) and length.lr(60 * 32) == pytest.approx(0.001)
    assert all(length.lr(a) >= length.lr(b) for a, b in zip(range(320, 1920, 32), range(352, 1952, 32), strict=True))
    # 20 steps of 32 samples done; on 2 ranks the 40 steps of 32 left are 20 steps of 64.
    assert length.steps(Progress(step=20, samples_seen=640), global_batch=64) == 40
    assert length.steps(Progress(step=30, samples_seen=1280), global_batch=32) == 50
    epochs = RunLength(cfg_of("--epochs", "2"), step_samples=32, train_size=1000)
    assert epochs.samples == 2 * (1000 // 32) * 32


def test_the_default_schedule_keeps_a_group_built_with_lr_0_at_0_and_moves_the_others():
    cfg = cfg_of("--max-steps", "20", "--warmup-steps", "4", "--lr", "0.01")
    length, progress = RunLength(cfg, step_samples=32, train_size=None), Progress()
    weights = [torch.nn.Parameter(torch.ones(2)) for _ in range(3)]
    groups = [{"params": [weights[0]], "lr": 0.0}, {"params": [weights[1]]}, {"params": [weights[2]], "lr": 0.005}]
    optimizer = torch.optim.SGD(groups, lr=0.01)
    schedule = SampleSchedule(optimizer, length, progress)
    for _ in range(20):
        lrs = [group["lr"] for group in optimizer.param_groups]
        assert lrs == pytest.approx([0.0, length.lr(progress.samples_seen), length.lr(progress.samples_seen) / 2])
        for weight in weights:
            weight.grad = torch.ones(2)
        optimizer.step()
        progress.samples_seen += 32
        schedule.step()
    assert torch.equal(weights[0], torch.ones(2)) and not torch.equal(weights[1], torch.ones(2))


# Evaluation and export, for real.


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("seam")
    run(
        train_cmd(2)
        + FAST
        + ["--max-steps", "30", "--eval-every", "10", "--snapshot-every", "10", "--clip-grad", "5"]
        + outputs(tmp_path)
    )
    return tmp_path


def evaluate_in_one_process(weights):
    """val_loss and the val metrics of `weights`, computed by one process over the whole validation set."""
    train, val = build_datasets(cfg_of())
    net = model.build_model(cfg_of(), train)
    net.load_state_dict(weights)
    net.eval()
    inputs, targets = torch.utils.data.default_collate([val[i] for i in range(len(val))])
    with torch.no_grad():
        outputs = net(inputs)
    results = {"val_loss": model.loss_fn(outputs, targets).item()}
    for name, value in getattr(model, "val_metrics", lambda o, t: {})(outputs, targets).items():
        results[f"val_{name}"] = float(value) / len(val)
    return results


def test_two_rank_evaluation_equals_one_process_on_the_same_weights(two_rank_run):
    if build_datasets(cfg_of())[1] is None:
        pytest.skip("build_datasets returns no validation set")
    last = metrics(two_rank_run)[-1]
    assert last["step"] == 30 and "val_loss" in last
    weights = torch.load(two_rank_run / "run-export" / "model.pt", weights_only=True)
    expected = evaluate_in_one_process(weights)
    assert {k for k in last if k.startswith("val_")} == set(expected)
    for name, value in expected.items():
        assert last[name] == pytest.approx(value, rel=1e-6, abs=1e-9), name
    assert summary(two_rank_run)["val_loss"] == last["val_loss"]


def test_export_loads_into_a_fresh_model_without_the_training_code(two_rank_run):
    export = two_rank_run / "run-export"
    weights = torch.load(export / "model.pt", weights_only=True)
    final = load_latest(str(two_rank_run / "run-snapshots"))
    assert final["step"] == 30
    assert weights.keys() == final["model"].keys()
    assert all(torch.equal(weights[k], final["model"][k]) for k in weights), "model.pt holds the final weights"
    net = model.build_model(cfg_of(), build_datasets(cfg_of())[0])
    net.load_state_dict(weights)  # a plain state dict: no "module." prefix, nothing but tensors
    if build_datasets(cfg_of())[1] is not None:
        best = summary(two_rank_run)
        records = {r["step"]: r for r in metrics(two_rank_run) if "val_loss" in r}
        assert best["best_val_loss"] == min(r["val_loss"] for r in records.values())
        assert records[best["best_step"]]["val_loss"] == best["best_val_loss"]
        best_weights = torch.load(export / "best.pt", weights_only=True)
        assert evaluate_in_one_process(best_weights)["val_loss"] == pytest.approx(best["best_val_loss"], rel=1e-6)


def test_metrics_file_has_one_record_per_logged_step(two_rank_run):
    records = metrics(two_rank_run)
    steps = [r["step"] for r in records]
    assert steps == sorted(set(steps)) == [1, 5, 10, 15, 20, 25, 30] or steps == [5, 10, 15, 20, 25, 30]
    assert all(math.isfinite(r["loss"]) and r["lr"] > 0 and r["samples_per_s"] > 0 for r in records)
    assert all(r["grad_norm"] > 0 for r in records), "--clip-grad logs the gradient norm before clipping"


# Resume control.


def test_changed_lr_and_weight_decay_apply_on_resume(tmp_path):
    run(train_cmd() + FAST + ["--max-steps", "20", "--snapshot-every", "10"] + outputs(tmp_path, "a"))
    changed = ["--max-steps", "30", "--lr", "0.001", "--weight-decay", "0.05"]
    run(train_cmd() + FAST + changed + outputs(tmp_path, "a"))
    run(train_cmd() + FAST + changed + outputs(tmp_path, "fresh"))
    resumed_lr = {r["step"]: r["lr"] for r in metrics(tmp_path, "a")}
    fresh_lr = {r["step"]: r["lr"] for r in metrics(tmp_path, "fresh")}
    assert resumed_lr[25] == fresh_lr[25] and resumed_lr[30] == fresh_lr[30], "the new schedule, rescaled"
    # Each group's weight decay is build_optimizer's with the new settings (a no-decay group stays no-decay).
    resumed, fresh = (
        [
            group["weight_decay"]
            for group in load_latest(str(tmp_path / f"{name}-snapshots"))["optimizer"]["param_groups"]
        ]
        for name in ("a", "fresh")
    )
    assert resumed == fresh and 0.05 in resumed


def write_snapshot_of_another_model(folder):
    snapshots = Snapshots(folder, DistEnv(), keep=3)
    snapshots.prepare(estimated_bytes=1)
    state = {
        "model": {"some_other_layer.weight": torch.zeros(3, 3)},
        "optimizer": {},
        "scaler": {},
        "step": 5,
        "progress": {"step": 5},
        "config": {},
        "run_id": "x",
    }
    snapshots.save(5, state, {"rng": capture_rng()}, blocking=True)
    snapshots.close()


def test_a_snapshot_of_another_model_stops_with_one_line_and_resume_never_sets_it_aside(tmp_path):
    snapshot_dir = tmp_path / "run-snapshots"
    write_snapshot_of_another_model(snapshot_dir)
    cmd = train_cmd(2) + FAST + ["--max-steps", "6"] + outputs(tmp_path)
    result = run(cmd, check=False)
    assert result.returncode != 0
    errors = [line for line in result.stdout.splitlines() if " ERROR " in line]
    assert len(errors) == 1, result.stdout[-4000:]
    assert str(snapshot_dir / "step-00000005") in errors[0] and "--resume never" in errors[0]
    assert "Traceback" not in (tmp_path / "run.log").read_text()  # the job's own log: no traceback

    run(cmd + ["--resume", "never"])
    assert summary(tmp_path)["resumed_from"] == -1 and summary(tmp_path)["steps"] == 6
    (aside,) = tmp_path.glob("run-snapshots.set-aside-*")
    assert (aside / "step-00000005" / "manifest.json").is_file(), "the old snapshots are kept, set aside"
    # The next launch in auto mode continues the new run, not the set-aside one.
    run(train_cmd() + FAST + ["--max-steps", "8"] + outputs(tmp_path))
    assert summary(tmp_path)["resumed_from"] == 6


def test_resume_never_without_snapshots_just_trains(tmp_path):
    run(train_cmd() + FAST + ["--max-steps", "3", "--resume", "never"] + outputs(tmp_path))
    assert summary(tmp_path)["resumed_from"] == -1
    assert not list(tmp_path.glob("run-snapshots.set-aside-*"))


# A run that diverges.

NAN_AFTER = """
import sys
sys.path.insert(0, {root!r})
import train
from {package} import model

original, calls = model.loss_fn, [0]


def loss_fn(outputs, targets):
    calls[0] += 1
    loss = original(outputs, targets)
    return loss * float("nan") if calls[0] > {after} else loss


model.loss_fn = loss_fn
train.warmstart.run_and_exit(lambda: train.main(sys.argv[1:]))  # as train.py ends
"""


def test_a_loss_that_turns_nan_stops_the_run_before_a_snapshot_of_it(tmp_path):
    script = tmp_path / "nan_after.py"
    script.write_text(NAN_AFTER.format(root=str(ROOT), package="{{ cookiecutter.project_slug }}", after=23))
    cmd = [
        sys.executable,
        str(script),
        "--wandb",
        "disabled",
        "--max-steps",
        "40",
        "--log-every",
        "10",
        "--snapshot-every",
        "5",
        "--eval-every",
        "0",
    ] + outputs(tmp_path)
    result = run(cmd, check=False)
    assert result.returncode == 2, result.stdout[-3000:]
    assert "Traceback" not in result.stdout
    newest = load_latest(str(tmp_path / "run-snapshots"))
    assert newest["step"] == 20, "the snapshot of step 25 would hold NaN weights"
    assert all(torch.isfinite(t).all() for t in newest["model"].values() if t.is_floating_point())


def first_names():
    """(the first parameter's name, the last module with parameters of its own): where tests/fault_injection.py's
    nan_grad_at_step and nan_output_at_step put their NaN."""
    network = model.build_model(config.parse_args([]), build_datasets(config.parse_args([]))[0])
    owners = [name for name, m in network.named_modules() if any(True for _ in m.parameters(recurse=False))]
    return next(name for name, _ in network.named_parameters()), owners[-1]


def test_nan_gradients_with_a_finite_loss_never_reach_a_snapshot_and_a_rerun_resumes_before_them(tmp_path):
    """Rank 1's gradient turns NaN at step 20, a snapshot step, its loss finite: the run stops naming step 20, the
    first parameter whose gradient was NaN on rank 1 (found by replaying step 20 from the snapshot of step 10) and
    the command that replays it; the newest snapshot is step 10's and finite, and running the same command again
    (the fault fixed) resumes from it."""
    args = QUICK + ["--max-steps", "30", "--snapshot-every", "10", "--eval-every", "0"] + outputs(tmp_path)
    cmd = train_cmd(2, script="tests/fault_injection.py") + args
    fault = {"FAULT": "nan_grad_at_step", "FAULT_RANK": 1, "FAULT_STEP": 20, "FAULT_ONCE": tmp_path / "fired"}
    result = run(cmd, env=child_env(**fault), check=False)
    assert result.returncode != 0 and (tmp_path / "fired").exists(), result.stdout[-3000:]
    (line,) = {line for line in result.stdout.splitlines() if "ERROR" in line and re.search(r"\bstep 20\b", line)}
    assert f"{first_names()[0]!r} on rank 1" in line and "--resume-from 10 --break-at-step 20" in line, line
    newest = load_latest(str(tmp_path / "run-snapshots"))
    assert newest["step"] == 10, "the snapshot of step 20 would hold NaN weights"
    assert all(torch.isfinite(t).all() for t in newest["model"].values() if t.is_floating_point())
    run(cmd, env=child_env(**fault))  # the same command again: the fault fires once only
    done = summary(tmp_path)
    assert done["resumed_from"] == 10 and done["steps"] == 30
    weights = load_latest(str(tmp_path / "run-snapshots"))["model"]
    assert all(torch.isfinite(t).all() for t in weights.values() if t.is_floating_point())


def test_a_nan_output_is_traced_to_its_module_and_rank(tmp_path):
    """Rank 0's last module with parameters outputs NaN at step 17: the ERROR line names step 17, rank 0 and that
    module (the replay from the snapshot of step 10 finds it), and the replay command."""
    args = QUICK + ["--max-steps", "30", "--snapshot-every", "10", "--eval-every", "0"] + outputs(tmp_path)
    fault = {"FAULT": "nan_output_at_step", "FAULT_RANK": 0, "FAULT_STEP": 17}
    result = run(train_cmd(2, script="tests/fault_injection.py") + args, env=child_env(**fault), check=False)
    assert result.returncode != 0, result.stdout[-3000:]
    (line,) = {line for line in result.stdout.splitlines() if "ERROR" in line and re.search(r"\bstep 17\b", line)}
    assert "rank 0" in line and f"{first_names()[1]!r} on rank 0" in line, line
    assert "--resume-from 10 --break-at-step 17" in line, line


# torch.compile: the wiring, with dynamo's eager backend (inductor's kernel compiler takes minutes on a small CPU).

EAGER_COMPILE = """
import functools
import sys
sys.path.insert(0, {root!r})
import torch
torch.compile = functools.partial(torch.compile, backend="eager")
import train
train.warmstart.run_and_exit(lambda: train.main(sys.argv[1:]))  # as train.py ends
"""


def test_compile_trains_and_snapshots_keep_the_unwrapped_names(tmp_path):
    script = tmp_path / "eager_compile.py"
    script.write_text(EAGER_COMPILE.format(root=str(ROOT)))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(script),
        *FAST,
        "--compile",
        "--snapshot-every",
        "6",
    ] + outputs(tmp_path)
    run(cmd + ["--max-steps", "6"])
    run(cmd + ["--max-steps", "12"])
    done = summary(tmp_path)
    assert (done["steps"], done["resumed_from"]) == (12, 6)
    names = set(model.build_model(cfg_of(), build_datasets(cfg_of())[0]).state_dict())
    assert set(load_latest(str(tmp_path / "run-snapshots"))["model"]) == names
    assert set(torch.load(tmp_path / "run-export" / "model.pt", weights_only=True)) == names


# Your optimizer and schedule, resumed: in process, through the snapshot parts and a snapshot folder.


def built(make_optimizer, make_scheduler, lr=1.0):
    """A small model, its optimizer and schedule, and the parts a snapshot holds, added in start-up's order."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizer = make_optimizer(net, lr)
    scheduler = make_scheduler(optimizer)
    state = TrainState(DistEnv(), sharded=False)
    state.add("model", ModelPart(net))
    state.add("optimizer", OptimizerPart(optimizer))
    state.add("scheduler", SchedulerPart(scheduler))
    state.add("rng", RngPart(), per_rank=True)
    return net, optimizer, scheduler, state


def train_steps(net, optimizer, scheduler, steps, first):
    """`steps` optimizer steps from step `first`; the learning rate of each."""
    lrs = []
    for step in range(first, first + steps):
        inputs = torch.randn(16, 4, generator=torch.Generator().manual_seed(step))
        optimizer.zero_grad()
        net(inputs).square().mean().backward()
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


def save_and_resume(folder, state, step, rebuilt_state):
    """Snapshot `state` at `step` into `folder` (a snapshot folder, as a run writes it) and restore it into
    `rebuilt_state`, as a restarted run does."""
    snapshots = Snapshots(folder, DistEnv(), keep=3)
    snapshots.prepare(estimated_bytes=1)
    shared, rank_state, _ = state.capture()
    shared.update(step=step, config={}, run_id="x", torch_version=str(torch.__version__))
    snapshots.save(step, shared, rank_state, blocking=True)
    resumed = snapshots.resume()
    snapshots.close()
    rebuilt_state.restore(resumed, str(folder))


SGD_MOMENTUM = lambda net, lr: torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)  # noqa: E731
ADAMW = lambda net, lr: torch.optim.AdamW(net.parameters(), lr=lr)  # noqa: E731
SCHEDULES = {
    "OneCycleLR, AdamW's betas": (ADAMW, lambda o: torch.optim.lr_scheduler.OneCycleLR(o, o.defaults["lr"], 12)),
    "OneCycleLR, SGD's momentum": (
        SGD_MOMENTUM,
        lambda o: torch.optim.lr_scheduler.OneCycleLR(o, o.defaults["lr"], 12),
    ),
    "warmup then cosine, SequentialLR": (
        ADAMW,
        lambda o: torch.optim.lr_scheduler.SequentialLR(
            o,
            [
                torch.optim.lr_scheduler.LinearLR(o, start_factor=0.1, total_iters=3),
                torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=9),
            ],
            milestones=[3],
        ),
    ),
    "ChainedScheduler": (
        SGD_MOMENTUM,
        lambda o: torch.optim.lr_scheduler.ChainedScheduler(
            [
                torch.optim.lr_scheduler.LinearLR(o, start_factor=0.1, total_iters=3),
                torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.9),
            ]
        ),
    ),
}


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_schedule_of_your_own_resumes_bitwise_and_takes_a_new_lr(tmp_path, schedule):
    """Resumed at step 5 of 12 with the same settings, the weights end bitwise equal to an uninterrupted run's:
    what the scheduler drives (OneCycleLR's betas or momentum, each scheduler inside a SequentialLR or
    ChainedScheduler) continues where it was. Resumed with half the learning rate, every scheduler inside takes the
    new base rate: the learning rates from then on are those of a run started with it."""
    make_optimizer, make_scheduler = SCHEDULES[schedule]
    net, optimizer, scheduler, _ = built(make_optimizer, make_scheduler)
    train_steps(net, optimizer, scheduler, 12, 0)
    uninterrupted = {name: value.clone() for name, value in net.state_dict().items()}

    net, optimizer, scheduler, state = built(make_optimizer, make_scheduler)
    train_steps(net, optimizer, scheduler, 5, 0)
    net, optimizer, scheduler, restored = built(make_optimizer, make_scheduler)
    save_and_resume(tmp_path / "same", state, 5, restored)
    train_steps(net, optimizer, scheduler, 7, 5)
    different = [name for name, value in net.state_dict().items() if not torch.equal(value, uninterrupted[name])]
    assert not different, f"weights differ in {different}"

    half, optimizer, scheduler, restored = built(make_optimizer, make_scheduler, lr=0.5)
    save_and_resume(tmp_path / "half", state, 5, restored)
    resumed_lrs = train_steps(half, optimizer, scheduler, 7, 5)
    fresh = built(make_optimizer, make_scheduler, lr=0.5)[:3]
    fresh_lrs = train_steps(*fresh, 12, 0)[5:]
    assert resumed_lrs == pytest.approx(fresh_lrs, rel=1e-6)
