"""Exact at any world size: a job SIGKILLed at a random moment ends bitwise-equal to an uninterrupted one with 4
ranks too (gloo's ring sums in another order from 3 ranks on), and a job resumed on another number of ranks keeps
the run's length and schedule in samples.
"""

from conftest import (
    EXACT,
    assert_same_weights,
    child_env,
    final_model,
    metrics,
    outputs,
    project,
    run,
    sigkill_at_random_and_resume,
    summary,
    train_cmd,
)

STEPS = 40
ARGS = EXACT + ["--max-steps", str(STEPS)]


def test_sigkill_at_a_random_moment_ends_bitwise_equal_with_4_ranks(tmp_path):
    """DDP's gradient buckets are settled before the first resumed step (gloo's ring sums in bucket order)."""
    resumed = sigkill_at_random_and_resume(tmp_path, 4, ARGS, kill_after=(12, 20))
    assert resumed["steps"] == STEPS and resumed["resumed_from"] >= 0, resumed
    reference = final_model(tmp_path / "reference-snapshots")
    assert_same_weights(reference["model"], final_model(tmp_path / "run-snapshots")["model"])


# Linear warmup, then cosine decay: two schedulers in a SequentialLR, as torch's documentation builds it.
WARMUP_THEN_COSINE = """
def build_scheduler(cfg, optimizer, total_steps):
    warmup = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.1, total_iters=10)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total_steps - 10)
    return torch.optim.lr_scheduler.SequentialLR(optimizer, [warmup, cosine], milestones=[10])
"""


def test_a_sequential_lr_schedule_of_your_own_ends_bitwise_equal_after_a_sigkill(tmp_path):
    """The kill comes after step 12 to 22: the restart resumes at the milestone (step 10) or inside the cosine."""
    workspace = project(tmp_path, model=WARMUP_THEN_COSINE)
    args = EXACT + ["--max-steps", "30"]
    resumed = sigkill_at_random_and_resume(tmp_path, 2, args, kill_after=(12, 22), workspace=workspace)
    assert resumed["steps"] == 30 and resumed["resumed_from"] >= 10, resumed
    reference = final_model(tmp_path / "reference-snapshots")
    assert_same_weights(reference["model"], final_model(tmp_path / "run-snapshots")["model"])
    assert reference["scheduler"]["last_epoch"] == 30  # the user's schedule, not the default one


def test_world_size_1_then_2_then_1_keeps_the_run_length_and_schedule_in_samples(tmp_path):
    """30 steps of 32 samples on one process, interrupted twice and continued on 2 ranks in between."""
    from {{ cookiecutter.project_slug }} import config

    batch = config.parse_args([]).batch_size
    steps = 30
    args = EXACT + ["--max-steps", str(steps), "--snapshot-every", "5"]  # the last of a repeated flag counts
    fault = train_cmd(script="tests/fault_injection.py")
    killed = run(
        fault + args + outputs(tmp_path),
        check=False,
        env=child_env(FAULT="kill_after_commit", FAULT_STEP=10, FAULT_ONCE=tmp_path / "first"),
    )
    assert killed.returncode != 0 and final_model(tmp_path / "run-snapshots")["step"] == 10
    # 10 x 32 samples done: on 2 ranks a step takes 64; stopped again after 5 of them.
    killed = run(
        train_cmd(2, script="tests/fault_injection.py") + args + outputs(tmp_path),
        check=False,
        env=child_env(FAULT="kill_after_commit", FAULT_STEP=15, FAULT_ONCE=tmp_path / "second"),
    )
    assert killed.returncode != 0 and final_model(tmp_path / "run-snapshots")["step"] == 15
    run(train_cmd() + args + outputs(tmp_path))

    done = summary(tmp_path)
    assert done["samples_seen"] == steps * batch, "the same amount of data as 30 steps on one process"
    assert (done["steps"], done["resumed_from"]) == (10 + 5 + 10, 15)
    run(train_cmd() + args + outputs(tmp_path, "uninterrupted"))
    last_lr = [record["lr"] for record in metrics(tmp_path)][-1]
    reference = [record["lr"] for record in metrics(tmp_path, "uninterrupted")][-1]
    assert last_lr == reference, "the schedule ends where the uninterrupted run's ends"
