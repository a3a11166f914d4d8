"""The snapshot folder in one process: atomic writes, commit marker, checks, fallback, pruning, start-up errors."""

import json
import os
import sys

import pytest
import torch

from conftest import ROOT

sys.path.insert(0, str(ROOT))

from {{ cookiecutter.project_slug }}.distributed import DistEnv  # noqa: E402
from {{ cookiecutter.project_slug }}.snapshot import (  # noqa: E402
    MANIFEST, SHARED, SnapshotError, Snapshots, load_latest, rank_file, step_name, write_atomic,
)


def save_steps(folder, steps, keep=10):
    snapshots = Snapshots(folder, DistEnv(), keep=keep)
    snapshots.prepare(estimated_bytes=1)
    for step in steps:
        weights = torch.full((64,), float(step))
        snapshots.save(step, {"model": {"w": weights}, "step": step}, {"rng": torch.arange(step)}, blocking=True)
    return snapshots


def flip_one_bit(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


def test_round_trip_and_manifest(tmp_path):
    save_steps(tmp_path, [10, 20])
    state = load_latest(str(tmp_path), rank=0)
    assert state["step"] == 20 and torch.equal(state["model"]["w"], torch.full((64,), 20.0))
    assert torch.equal(state["rank_state"]["rng"], torch.arange(20))
    manifest = json.loads((tmp_path / step_name(20) / MANIFEST).read_text())
    assert manifest["world_size"] == 1 and set(manifest["files"]) == {SHARED, rank_file(0)}
    assert all(len(entry["sha256"]) == 64 for entry in manifest["files"].values())


def test_empty_folder_has_no_snapshot(tmp_path):
    assert load_latest(str(tmp_path / "nothing-here")) is None


@pytest.mark.parametrize("damage, reason", [
    (lambda p: p.write_bytes(p.read_bytes()[: len(p.read_bytes()) // 2]), "truncated"),
    (lambda p: p.write_bytes(b""), "empty"),
    (flip_one_bit, "checksum mismatch"),
    (os.remove, "missing"),
])
def test_damaged_newest_snapshot_falls_back_with_a_warning(tmp_path, caplog, damage, reason):
    save_steps(tmp_path, [10, 20])
    damaged = tmp_path / step_name(20) / SHARED
    damage(damaged)
    state = load_latest(str(tmp_path))
    assert state["step"] == 10
    warning = next(r.getMessage() for r in caplog.records if r.levelname == "WARNING")
    assert str(damaged) in warning and reason in warning


def test_every_snapshot_damaged_is_an_error_not_a_fresh_start(tmp_path):
    save_steps(tmp_path, [10, 20])
    for step in (10, 20):
        (tmp_path / step_name(step) / rank_file(0)).write_bytes(b"")
    with pytest.raises(SnapshotError, match="no usable snapshot in .*empty"):
        load_latest(str(tmp_path))


def test_bit_flip_is_caught_although_torch_load_would_accept_it(tmp_path):
    save_steps(tmp_path, [10])
    shared = tmp_path / step_name(10) / SHARED
    flip_one_bit(shared)
    torch.load(shared, weights_only=True)  # the damage is silent without a checksum
    with pytest.raises(SnapshotError, match="checksum mismatch"):
        load_latest(str(tmp_path))


def test_interrupted_save_is_ignored_then_cleaned_at_start(tmp_path):
    save_steps(tmp_path, [10])
    partial = tmp_path / step_name(20)
    partial.mkdir()
    (partial / f"{SHARED}.tmp-123").write_bytes(b"\0" * 100)
    (tmp_path / step_name(10) / "rank-00000.pt.tmp-99").write_bytes(b"junk")
    assert load_latest(str(tmp_path))["step"] == 10
    Snapshots(tmp_path, DistEnv(), keep=3).prepare(estimated_bytes=1)
    assert not partial.exists()
    assert not list((tmp_path / step_name(10)).glob("*.tmp-*"))


def test_keeps_the_newest_snapshots_only(tmp_path):
    save_steps(tmp_path, [10, 20, 30, 40], keep=2)
    assert sorted(p.name for p in tmp_path.glob("step-*")) == [step_name(30), step_name(40)]


def test_failed_write_leaves_no_file_behind(tmp_path):
    target = tmp_path / "file.pt"

    def explode(handle):
        handle.write(b"partial")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        write_atomic(str(target), explode)
    assert list(tmp_path.iterdir()) == []


def test_save_copies_state_before_fence_returns(tmp_path):
    snapshots = Snapshots(tmp_path, DistEnv(), keep=3)
    snapshots.prepare(estimated_bytes=1)
    weights = torch.zeros(1_000_000)
    snapshots.save(5, {"model": {"w": weights}, "step": 5}, {})
    snapshots.fence()
    weights.add_(1)  # training changes the weights as soon as fence() returns
    snapshots.wait()
    assert torch.equal(load_latest(str(tmp_path))["model"]["w"], torch.zeros(1_000_000))


def test_unwritable_folder_fails_at_start_up(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(SnapshotError, match=f"cannot write snapshots to {blocker}/snapshots"):
        Snapshots(blocker / "snapshots", DistEnv(), keep=3).prepare(estimated_bytes=1)


def test_folder_without_room_fails_at_start_up(tmp_path):
    with pytest.raises(SnapshotError, match="not enough room for a snapshot"):
        Snapshots(tmp_path, DistEnv(), keep=3).prepare(estimated_bytes=2**60)


def test_run_id_survives_restarts(tmp_path):
    first = Snapshots(tmp_path, DistEnv(), keep=3).prepare(estimated_bytes=1)
    second = Snapshots(tmp_path, DistEnv(), keep=3).prepare(estimated_bytes=1)
    assert first == second and len(first) == 8
