"""The seam on a model the project never shows: a causal transformer language model on a stream of token sequences.

The template tests copy this file, as tests/test_own_lm.py (its name here keeps the template's own pytest from
collecting it outside a bake), into a bake whose model.py and data.py are tests/own_lm's (dict batches padded by
the user's `collate`, a token-weighted `compute_loss`, an IterableDataset without `len()`, the user's optimizer
groups and schedule, blocks in an nn.ModuleList) and run it there. Four launches in all: an uninterrupted 2-rank
run and one SIGKILLed at a random rank and moment serve every ddp test below; the fsdp test has its own pair.
"""

import dataclasses
import importlib
import json

import pytest
import torch
from conftest import (
    EXACT,
    PACKAGE,
    assert_same_weights,
    default_config,
    default_datasets,
    final_model,
    metrics,
    sigkill_at_random_and_resume,
    summary,
)
from torch.distributed.tensor import DTensor

user_model = importlib.import_module(f"{PACKAGE}.model")
user_data = importlib.import_module(f"{PACKAGE}.data")

STEPS, BATCH, RANKS, WEIGHT_DECAY = 60, 8, 2, 0.1
# A nonzero weight decay: a resume that gave the no-decay group --weight-decay would change the weights' bits.
ARGS = EXACT + ["--max-steps", str(STEPS), "--batch-size", str(BATCH), "--eval-every", "20"]
ARGS += ["--weight-decay", str(WEIGHT_DECAY)]
# Kill after a logged step in this range: after the snapshot of step 10, and early enough that the run is still
# going when the kill lands (up to 0.3 s later: the last 40 steps of a tiny model are little more than that).
KILL_AFTER = (11, 20)


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory):
    """(folder, summary of the restarted run): an uninterrupted 2-rank run ("reference"), then one whose random
    rank is SIGKILLed at a random moment and restarted by torchrun ("run"). Both record the ids of every training
    batch, in order, one file per rank: the reference's lines first, then each attempt's (told apart by pid)."""
    tmp_path = tmp_path_factory.mktemp("own-lm")
    (tmp_path / "ids").mkdir()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OWN_LM_RECORD", str(tmp_path / "ids"))
        resumed = sigkill_at_random_and_resume(tmp_path, RANKS, ARGS, kill_after=KILL_AFTER)
    assert resumed["steps"] == STEPS and resumed["resumed_from"] >= 10, resumed
    return tmp_path, resumed


def recorded_batches(tmp_path, rank):
    """The id lists rank `rank` trained on, one list per process that rank ran in, in launch order."""
    processes = {}  # dicts keep insertion order: the order the processes started writing
    for line in (tmp_path / "ids" / f"rank-{rank}.jsonl").read_text().splitlines():
        entry = json.loads(line)
        processes.setdefault(entry["pid"], []).append(entry["ids"])
    return list(processes.values())


def fresh_model():
    return user_model.build_model(default_config(), default_datasets()[0])


def scheduled_lrs(total_steps):
    """The user's schedule: the lr of the first group after 0, 1, ..., total_steps scheduler steps."""
    optimizer = user_model.build_optimizer(default_config(), fresh_model())
    scheduler = user_model.build_scheduler(default_config(), optimizer, total_steps)
    lrs = [optimizer.param_groups[0]["lr"]]
    for _ in range(total_steps):
        optimizer.step()  # no gradients: changes nothing, and keeps the scheduler from warning about the order
        scheduler.step()
        lrs.append(optimizer.param_groups[0]["lr"])
    return lrs


@pytest.mark.slow
def test_sigkill_at_a_random_moment_ends_bitwise_equal_to_an_uninterrupted_run(killed_run):
    tmp_path, _ = killed_run
    reference, resumed = final_model(tmp_path / "reference-snapshots"), final_model(tmp_path / "run-snapshots")
    assert reference["step"] == STEPS
    assert_same_weights(reference["model"], resumed["model"])
    # model.py's extra part, the EMA of the weights, resumed as exactly: it moved away from the initial weights
    assert reference["ema"].pop("updates") == resumed["ema"].pop("updates") == STEPS
    assert_same_weights(reference["ema"], resumed["ema"])


@pytest.mark.slow
def test_each_rank_trains_on_its_exact_share_of_the_stream_and_a_restart_neither_repeats_nor_skips(killed_run):
    """Rank r takes items r, r+N, r+2N, ... of the stream, BATCH at a time, and so does the restarted job:
    the steps up to its snapshot from the killed attempt, the rest from the restart, which continues the stream."""
    tmp_path, resumed = killed_run
    done = resumed["resumed_from"]
    for rank in range(RANKS):
        share = [rank + RANKS * position for position in range(STEPS * BATCH)]
        processes = recorded_batches(tmp_path, rank)
        assert len(processes) == 3, f"rank {rank}: {len(processes)} processes, not reference, killed, restarted"
        reference, killed, restarted = processes
        assert all(len(batch) == BATCH for batch in reference + killed + restarted)
        assert sum(reference, []) == share, f"rank {rank} did not train on its share of the stream"
        assert len(killed) >= done and len(restarted) == STEPS - done, (rank, len(killed), len(restarted))
        assert sum(killed[:done] + restarted, []) == share, f"rank {rank}'s restart repeated or skipped samples"


@pytest.mark.slow
def test_token_weighted_val_loss_of_3_ranks_equals_one_process_over_the_whole_val_set(killed_run):
    """53 validation sequences of 6 to 16 tokens over 2 ranks: the loss is the sum over every next-token target
    over their count, not a mean of per-rank or per-batch means."""
    tmp_path, _ = killed_run
    net = fresh_model()
    net.load_state_dict(torch.load(tmp_path / "reference-export" / "model.pt", weights_only=True))
    net.double().eval()  # float64: the expected values carry no rounding of their own
    _, val = default_datasets()
    totals = {"loss": 0.0, "count": 0.0, "correct": 0.0}
    with torch.no_grad():
        for start in range(0, len(val), 10):  # batches of their own padding, as a user evaluating would make them
            batch = user_data.collate([val[index] for index in range(start, min(start + 10, len(val)))])
            for name, value in user_model.compute_loss(net, batch).items():
                totals[name] += float(value)
    last = [record for record in metrics(tmp_path, "reference") if "val_loss" in record][-1]
    assert last["step"] == STEPS
    assert last["val_loss"] == pytest.approx(totals["loss"] / totals["count"], rel=1e-6)
    assert last["val_correct"] == pytest.approx(totals["correct"] / totals["count"], rel=1e-6)
    assert summary(tmp_path, "reference")["val_loss"] == last["val_loss"]


@pytest.mark.slow
def test_the_no_decay_group_stays_no_decay_across_a_restart(killed_run):
    """The restarted job's optimizer keeps build_optimizer's groups, each with its own weight decay. (Had the
    restart given every group --weight-decay, AdamW would also have decayed the biases and norms after it, and
    the bitwise test above would fail as well.)"""
    tmp_path, _ = killed_run
    cfg = dataclasses.replace(default_config(), weight_decay=WEIGHT_DECAY)
    expected = user_model.build_optimizer(cfg, fresh_model()).state_dict()["param_groups"]
    assert [group["weight_decay"] for group in expected] == [WEIGHT_DECAY, 0.0] and expected[1]["params"]
    saved = final_model(tmp_path / "run-snapshots")["optimizer"]["param_groups"]
    # Group by group: how many parameters, and their weight decay (parameter ids may be indices or names).
    assert [(len(g["params"]), g["weight_decay"]) for g in saved] == [
        (len(g["params"]), g["weight_decay"]) for g in expected
    ]


@pytest.mark.slow
def test_the_logged_lr_follows_the_users_schedule_also_after_a_restart(killed_run):
    """The logged lr of step s is the schedule's after s - 1 scheduler steps (the lr step s used) or after s (the
    lr the next step uses): one of the two for every record, of both runs, also those logged after the restart."""
    tmp_path, resumed = killed_run
    lrs = scheduled_lrs(STEPS)
    records = metrics(tmp_path, "reference") + metrics(tmp_path)
    assert any(record["step"] > resumed["resumed_from"] for record in metrics(tmp_path))
    matches = [
        shift
        for shift in (1, 0)
        if all(record["lr"] == pytest.approx(lrs[record["step"] - shift], rel=1e-12) for record in records)
    ]
    logged = [(record["step"], record["lr"]) for record in records]
    assert matches, f"logged (step, lr): {logged}\nthe schedule after 0, 1, ... steps: {lrs}"


@pytest.mark.slow
def test_fsdp_without_shard_units_resumes_bitwise_and_snapshots_hold_the_full_weights(tmp_path):
    """model.py names no shard_units: the default units must look inside the nn.ModuleList of blocks (a
    container without forward is no unit), and load_latest must give back whole tensors, not shards."""
    assert not hasattr(user_model, "shard_units")
    resumed = sigkill_at_random_and_resume(tmp_path, 2, ARGS + ["--strategy", "fsdp"], kill_after=KILL_AFTER)
    assert resumed["steps"] == STEPS and resumed["resumed_from"] >= 10, resumed
    reference = final_model(tmp_path / "reference-snapshots")["model"]
    weights = final_model(tmp_path / "run-snapshots")["model"]
    assert_same_weights(reference, weights)
    assert not [name for name, value in weights.items() if isinstance(value, DTensor)]
    # model.py's EMA, written with the model's shards: whole again, and resumed as exactly
    reference_ema, ema = (
        final_model(tmp_path / "reference-snapshots")["ema"],
        final_model(tmp_path / "run-snapshots")["ema"],
    )
    assert reference_ema.pop("updates") == ema.pop("updates") == STEPS
    assert_same_weights(reference_ema, ema)
    shapes = {name: value.shape for name, value in weights.items() if name != "head.weight"}  # tied: one tensor
    assert {name: value.shape for name, value in ema.items()} == shapes
    expected = fresh_model().state_dict()
    assert {name: value.shape for name, value in weights.items()} == {k: v.shape for k, v in expected.items()}
    fresh_model().load_state_dict(weights)  # one process, no process group: whole tensors load strictly
