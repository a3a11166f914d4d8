"""--strategy fsdp for real: FSDP2 on gloo trains like DDP, its sharded snapshots (torch.distributed.checkpoint under
the project's receipts, checksums and commit marker) survive a SIGKILL bitwise at 3 ranks (uneven shards), a
damaged shard falls back to the previous snapshot, another number of ranks reshards, and the export is a plain
state dict.
"""

import shutil

import pytest
import torch
from conftest import (
    EXACT,
    assert_same_weights,
    default_config,
    default_datasets,
    outputs,
    run,
    sigkill_at_random_and_resume,
    summary,
    train_cmd,
)

from {{ cookiecutter.project_slug }}.model import build_model

STEPS = 40
ARGS = EXACT + ["--max-steps", str(STEPS)]
FSDP = ["--strategy", "fsdp"]


def exported(tmp_path, name="run"):
    return torch.load(tmp_path / f"{name}-export" / "model.pt", weights_only=True)


def test_fsdp_trains_like_ddp_and_exports_weights_that_load_into_a_plain_model(tmp_path):
    run(train_cmd(2) + ARGS + outputs(tmp_path, "ddp"))
    run(train_cmd(2) + ARGS + FSDP + outputs(tmp_path, "fsdp"))
    ddp, fsdp = summary(tmp_path, "ddp"), summary(tmp_path, "fsdp")
    assert fsdp["steps"] == ddp["steps"] == STEPS
    # The same seed, data and steps: only the order of the gradient sums differs (reduce-scatter vs all-reduce).
    assert fsdp["last_loss"] == pytest.approx(ddp["last_loss"], rel=1e-4), (fsdp, ddp)
    if ddp.get("val_loss") is not None:
        assert fsdp["val_loss"] == pytest.approx(ddp["val_loss"], rel=1e-4), (fsdp, ddp)
    weights, reference = exported(tmp_path, "fsdp"), exported(tmp_path, "ddp")
    assert weights.keys() == reference.keys()
    for name, value in reference.items():
        assert torch.allclose(weights[name], value, rtol=1e-3, atol=1e-5), name
    # One process, no torch.distributed: the full, unsharded weights load into the plain model, strictly.
    train, _ = default_datasets()
    build_model(default_config(), train).load_state_dict(weights)


def test_fsdp_sigkill_at_a_random_moment_ends_bitwise_equal_with_3_ranks(tmp_path):
    resumed = sigkill_at_random_and_resume(tmp_path, 3, ARGS + FSDP, kill_after=(11, 30))
    assert resumed["steps"] == STEPS and resumed["resumed_from"] >= 10, resumed
    assert_same_weights(exported(tmp_path, "reference"), exported(tmp_path))


def test_fsdp_damaged_shard_falls_back_and_one_rank_reshards_the_snapshot(tmp_path):
    args = EXACT + ["--max-steps", "20"] + FSDP  # a snapshot every 10 steps: at 10 and 20
    run(train_cmd(2) + args + outputs(tmp_path))
    reference = exported(tmp_path)
    snapshots = tmp_path / "run-snapshots"
    shutil.copytree(snapshots, tmp_path / "one-snapshots")
    shutil.rmtree(tmp_path / "one-snapshots" / "step-00000020")

    # One flipped bit in rank 1's shard of the newest snapshot: it is skipped and the job resumes from the one
    # before, ending bitwise-equal to the run that never had the damage.
    shard = snapshots / "step-00000020" / "sharded" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    run(train_cmd(2) + args + outputs(tmp_path))
    done = summary(tmp_path)
    assert (done["resumed_from"], done["steps"]) == (10, 20), done
    assert_same_weights(reference, exported(tmp_path))
    assert len(list(snapshots.glob("step-00000020.damaged-*"))) == 1, "the damaged snapshot is kept aside"

    # The 2-rank snapshot of step 10 on one rank: DCP reshards it, and the run keeps its length in samples
    # (10 more steps of 2 ranks are 20 steps of one).
    run(train_cmd(1) + args + outputs(tmp_path, "one"))
    one = summary(tmp_path, "one")
    assert (one["world_size"], one["resumed_from"], one["steps"]) == (1, 10, 30), one
    train, _ = default_datasets()
    build_model(default_config(), train).load_state_dict(exported(tmp_path, "one"))
