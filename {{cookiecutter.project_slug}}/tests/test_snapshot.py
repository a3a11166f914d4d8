"""The snapshot folder in one process: atomic writes, commit marker, checks, fallback, pruning, start-up errors."""

import errno
import hashlib
import json
import os
import re
import shutil
import sys
import threading

import pytest
import torch
from conftest import ROOT

sys.path.insert(0, str(ROOT))

from {{ cookiecutter.project_slug }}.machinery import tracking
from {{ cookiecutter.project_slug }}.machinery.distributed import DistEnv
from {{ cookiecutter.project_slug }}.machinery.snapshot import (
    MANIFEST,
    RUN_FILE,
    SHARED,
    SnapshotError,
    Snapshots,
    load_latest,
    manifest_digest,
    rank_file,
    step_name,
    write_atomic,
    writer,
)


@pytest.fixture(autouse=True)
def outside_torchrun(monkeypatch):
    """These tests play `python train.py`: no torchrun job id unless a test sets one."""
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)


def save_steps(folder, steps, keep=10):
    snapshots = Snapshots(folder, DistEnv(), keep=keep)
    snapshots.prepare(estimated_bytes=1)
    tracking.run_id(DistEnv(), str(folder))  # as a run does: its id beside the snapshots
    for step in steps:
        weights = torch.full((64,), float(step))
        snapshots.save(step, {"model": {"w": weights}, "step": step}, {"rng": torch.arange(step)}, blocking=True)
    snapshots.close()
    return snapshots


def resume(folder):
    snapshots = Snapshots(folder, DistEnv(), keep=10)
    snapshots.prepare(estimated_bytes=1)
    try:
        return snapshots.resume()
    finally:
        snapshots.close()


def file_digests(folder):
    """{relative path: sha256} of every file under folder."""
    return {
        str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    }


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


@pytest.mark.parametrize(
    "damage, reason",
    [
        (lambda p: p.write_bytes(p.read_bytes()[: len(p.read_bytes()) // 2]), "truncated"),
        (lambda p: p.write_bytes(b""), "empty"),
        (flip_one_bit, "checksum mismatch"),
        (os.remove, "missing"),
    ],
)
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


def test_a_ranks_own_part_is_on_disk_when_save_returns(tmp_path, monkeypatch):
    """Rank 1's random streams and data position, with its receipt, are written before its next step can start: a
    SIGKILL from then on leaves its part of the snapshot whole (the background write is held back here)."""
    held = threading.Event()
    monkeypatch.setattr(Snapshots, "_write", lambda self, *args: held.wait(30))
    snapshots = Snapshots(tmp_path, DistEnv(rank=1, world_size=2), keep=3)
    snapshots.save(20, None, {"rng": torch.arange(5), "data": {"consumed_items": 40}})
    folder = tmp_path / step_name(20)
    assert torch.load(folder / rank_file(1), weights_only=True)["data"] == {"consumed_items": 40}
    receipt = json.loads((folder / "rank-00001.json").read_text())
    assert receipt["files"][rank_file(1)]["sha256"] == hashlib.sha256((folder / rank_file(1)).read_bytes()).hexdigest()
    held.set()
    snapshots.wait()


@pytest.mark.parametrize("lost", ["nothing", "a receipt", "a damaged file"])
def test_a_save_whose_every_part_was_written_is_committed_at_the_next_start(tmp_path, lost):
    """The job ended after every rank wrote its part of step 20 but before rank 0 committed it (no manifest): the
    next start commits it and resumes from it, unless a part is missing or fails its checksum."""
    save_steps(tmp_path, [10, 20])
    folder = tmp_path / step_name(20)
    (folder / MANIFEST).unlink()
    if lost == "a receipt":
        (folder / "rank-00000.json").unlink()
    elif lost == "a damaged file":
        flip_one_bit(folder / SHARED)
    assert resume(tmp_path)["step"] == (20 if lost == "nothing" else 10)
    assert folder.exists() == (lost == "nothing")


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


def test_unwritable_folder_fails_at_start_up(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(SnapshotError, match=f"cannot write snapshots to {blocker}/snapshots"):
        Snapshots(blocker / "snapshots", DistEnv(), keep=3).prepare(estimated_bytes=1)


def test_folder_without_room_fails_at_start_up(tmp_path):
    with pytest.raises(SnapshotError, match="not enough room for a snapshot"):
        Snapshots(tmp_path, DistEnv(), keep=3).prepare(estimated_bytes=2**60)


def start_up(folder, fresh_start=False):
    """What a run does first: take the snapshot folder, then read (or create) the run id kept in it."""
    snapshots = Snapshots(folder, DistEnv(), keep=3)
    snapshots.prepare(estimated_bytes=1, fresh_start=fresh_start)
    return snapshots, tracking.run_id(DistEnv(), str(folder))


def test_run_id_survives_restarts(tmp_path):
    first, first_id = start_up(tmp_path)
    first.close()
    _, second_id = start_up(tmp_path)
    assert first_id == second_id and len(first_id) == 8


# -- the manifest: its whole shape and its own checksum ------------------------------------------------------------


def edit_manifest(path, change, reseal):
    manifest = json.loads(path.read_text())
    change(manifest)
    if reseal:  # a consistent checksum: only the shape check can catch the damage
        manifest["manifest_sha256"] = manifest_digest(manifest)
    path.write_text(json.dumps(manifest, indent=1, sort_keys=True))


def set_field(key, value):
    return lambda manifest: manifest.__setitem__(key, value)


def set_entry(name, value):
    return lambda manifest: manifest["files"].__setitem__(name, value)


def size_as_text(manifest):
    manifest["files"][SHARED]["size"] = str(manifest["files"][SHARED]["size"])


def two_ranks(manifest):  # an edit by hand that keeps the shape: only the checksum catches it
    manifest["world_size"] = 2
    manifest["files"][rank_file(1)] = manifest["files"][rank_file(0)]


def flip_key(path):
    path.write_text(path.read_text().replace('"sha256"', '"sha257"', 1))


def huge_world_size(path):
    path.write_text(re.sub(r'"world_size": \d+', '"world_size": 1e999', path.read_text()))


MANIFEST_DAMAGE = {
    "key flipped sha256 -> sha257": flip_key,
    "an entry that is an int": lambda p: edit_manifest(p, set_entry(SHARED, 5), reseal=True),
    "size as a string": lambda p: edit_manifest(p, size_as_text, reseal=True),
    "world_size 1e999": huge_world_size,
    "world_size edited by hand": lambda p: edit_manifest(p, two_ranks, reseal=False),
    "format of another version": lambda p: edit_manifest(p, set_field("format", 99), reseal=True),
    "step of another folder": lambda p: edit_manifest(p, set_field("step", 10), reseal=True),
    "step negative": lambda p: edit_manifest(p, set_field("step", -20), reseal=True),
    "world_size zero": lambda p: edit_manifest(p, set_field("world_size", 0), reseal=True),
    "a file more than the ranks": lambda p: edit_manifest(
        p, set_entry("rank-00007.pt", {"size": 1, "sha256": "0" * 64}), reseal=True
    ),
    "sha256 not hex": lambda p: edit_manifest(
        p, lambda m: m["files"][SHARED].__setitem__("sha256", "z" * 64), reseal=True
    ),
    "job not a string": lambda p: edit_manifest(p, set_field("job", 7), reseal=True),
    "no checksum": lambda p: edit_manifest(p, lambda m: m.pop("manifest_sha256"), reseal=False),
    "a list, not an object": lambda p: p.write_text("[1, 2]"),
    "files a list": lambda p: edit_manifest(p, set_field("files", [SHARED]), reseal=True),
}


@pytest.mark.parametrize("damage", MANIFEST_DAMAGE.values(), ids=MANIFEST_DAMAGE.keys())
def test_malformed_manifest_falls_back_to_the_older_snapshot(tmp_path, caplog, damage):
    save_steps(tmp_path, [10, 20])
    manifest = tmp_path / step_name(20) / MANIFEST
    damage(manifest)
    state = load_latest(str(tmp_path), rank=0)
    assert state["step"] == 10 and torch.equal(state["model"]["w"], torch.full((64,), 10.0))
    state = resume(tmp_path)
    assert state["step"] == 10 and state["world_size"] == 1
    assert torch.equal(state["rank_state"]["rng"], torch.arange(10))
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any(str(manifest) in warning for warning in warnings), warnings


def test_manifest_checksums_itself_and_names_the_job(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-7")
    save_steps(tmp_path, [10])
    manifest = json.loads((tmp_path / step_name(10) / MANIFEST).read_text())
    assert manifest["job"] == "job-7" and manifest["manifest_sha256"] == manifest_digest(manifest)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    save_steps(tmp_path / "plain", [10])
    assert json.loads((tmp_path / "plain" / step_name(10) / MANIFEST).read_text())["job"] == ""


# -- odd things in the folder ---------------------------------------------------------------------------------------


def test_folder_with_nine_digits_is_not_a_snapshot(tmp_path):
    save_steps(tmp_path, [10, 20])
    impostor = tmp_path / "step-000000040"  # 9 digits: step_name(40) is step-00000040
    shutil.copytree(tmp_path / step_name(20), impostor)
    edit_manifest(impostor / MANIFEST, set_field("step", 40), reseal=True)
    unfinished = tmp_path / "step-000000050"  # no manifest: it would look like an interrupted save
    unfinished.mkdir()
    assert load_latest(str(tmp_path))["step"] == 20
    assert resume(tmp_path)["step"] == 20
    assert impostor.is_dir() and unfinished.is_dir(), "a folder that is not a snapshot is left alone"


def test_start_up_removes_what_interrupted_start_ups_left(tmp_path):
    save_steps(tmp_path, [10])
    run_id = json.loads((tmp_path / RUN_FILE).read_text())["run_id"]
    leftovers = [tmp_path / ".probe-0123456789ab", tmp_path / f"{RUN_FILE}.tmp-4242"]
    for path in leftovers:
        path.write_text("{}")
    (tmp_path / "notes.txt").write_text("mine")
    assert start_up(tmp_path)[1] == run_id
    assert not any(path.exists() for path in leftovers)
    assert (tmp_path / "notes.txt").read_text() == "mine" and load_latest(str(tmp_path))["step"] == 10


@pytest.mark.parametrize(
    "make",
    [
        lambda path: path.write_text('["abc"]'),
        lambda path: path.write_text('{"run_id": 12345}'),
        lambda path: path.write_text('{"other": "abc"}'),
        lambda path: path.write_text('{"run_id": "a/b"}'),
        lambda path: path.write_text("{not json"),
        lambda path: path.mkdir(),
    ],
    ids=["a list", "run_id not a string", "no run_id", "run_id wandb refuses", "not JSON", "a folder"],
)
def test_odd_run_file_is_one_clear_error(tmp_path, make):
    make(tmp_path / RUN_FILE)
    with pytest.raises(SnapshotError, match=f"^{re.escape(str(tmp_path / RUN_FILE))} .*: delete it") as info:
        start_up(tmp_path)
    assert "\n" not in str(info.value)


def test_disk_full_during_a_save_says_so(tmp_path, monkeypatch):
    """torch.save turns the OSError of a full disk into a RuntimeError ("unexpected pos"): the cause is found."""
    original = writer.write_atomic

    class FullDisk:
        def __init__(self, handle):
            self.handle, self.room = handle, 1000

        def write(self, data):
            if len(data) > self.room:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            self.room -= len(data)
            return self.handle.write(data)

        def flush(self):
            self.handle.flush()

    def write_to_full_disk(path, write):  # the disk fills up during the large file, written in the background
        return original(path, lambda handle: write(FullDisk(handle)) if path.endswith(SHARED) else write(handle))

    save_steps(tmp_path, [10])
    monkeypatch.setattr(writer, "write_atomic", write_to_full_disk)
    snapshots = Snapshots(tmp_path, DistEnv(), keep=3)
    snapshots.prepare(estimated_bytes=1)
    snapshots.save(20, {"model": {"w": torch.zeros(10_000)}, "step": 20}, {}, blocking=False)
    with pytest.raises(SnapshotError, match=f"no space left on {re.escape(str(tmp_path))}") as info:
        snapshots.wait()
    assert isinstance(info.value.__cause__, RuntimeError), "the OSError came wrapped, as torch.save wraps it"
    snapshots.close()
    assert not (tmp_path / step_name(20) / MANIFEST).exists()
    assert not list((tmp_path / step_name(20)).glob("*.tmp-*")), "no partial file left behind"
    assert load_latest(str(tmp_path))["step"] == 10


# -- a fresh start (--resume never) --------------------------------------------------------------------------------


def test_fresh_start_moves_the_old_snapshots_aside_intact(tmp_path, caplog):
    folder = tmp_path / "snapshots"
    save_steps(folder, [10, 20])
    before = file_digests(folder)
    old_run_id = json.loads((folder / RUN_FILE).read_text())["run_id"]
    snapshots, run_id = start_up(folder, fresh_start=True)
    assert snapshots.resume() is None and load_latest(str(folder)) is None
    assert run_id != old_run_id, "a fresh start is a new run"
    aside = [path for path in tmp_path.iterdir() if path.name.startswith("snapshots.set-aside-")]
    assert len(aside) == 1 and file_digests(aside[0]) == before
    assert load_latest(str(aside[0]))["step"] == 20
    assert any(str(aside[0]) in r.getMessage() for r in caplog.records if r.levelname == "WARNING")
    snapshots.save(5, {"model": {"w": torch.zeros(3)}, "step": 5}, {}, blocking=True)
    snapshots.close()
    # Again within the same second: a second set-aside folder, the first one untouched.
    second = Snapshots(folder, DistEnv(), keep=3)
    second.prepare(estimated_bytes=1, fresh_start=True)
    second.close()
    aside_now = sorted(path for path in tmp_path.iterdir() if path.name.startswith("snapshots.set-aside-"))
    assert len(aside_now) == 2 and file_digests(aside[0]) == before
    assert {load_latest(str(path))["step"] for path in aside_now} == {20, 5}


def test_fresh_start_in_a_folder_without_snapshots_moves_nothing(tmp_path):
    folder = tmp_path / "snapshots"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    Snapshots(folder, DistEnv(), keep=3).prepare(estimated_bytes=1, fresh_start=True)
    assert [path.name for path in tmp_path.iterdir()] == ["snapshots"]
    assert (folder / "notes.txt").read_text() == "mine"


def test_fresh_start_of_a_restarted_job_resumes_its_own_snapshots(tmp_path, monkeypatch):
    folder = tmp_path / "snapshots"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-1")
    save_steps(folder, [10, 20])
    run_id = json.loads((folder / RUN_FILE).read_text())["run_id"]
    before = file_digests(folder)
    snapshots, restarted_id = start_up(folder, fresh_start=True)  # the same torchrun job, restarted
    assert restarted_id == run_id
    assert snapshots.resume()["step"] == 20
    snapshots.close()
    assert [path.name for path in tmp_path.iterdir()] == ["snapshots"] and file_digests(folder) == before
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-2")  # another job: it starts afresh
    snapshots, new_id = start_up(folder, fresh_start=True)
    assert new_id != run_id
    assert snapshots.resume() is None
    snapshots.close()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # a save in one process, without a group: meant
def test_a_sharded_snapshots_extra_part_is_read_back_whole_with_its_nesting(tmp_path):
    """load_latest reads an fsdp snapshot's parts from torch.distributed.checkpoint's files: a part of model.py's
    extra_state whose state_dict nests dicts comes back with every entry, as the part saved it."""
    import torch.distributed.checkpoint as dcp

    from {{ cookiecutter.project_slug }}.machinery.snapshot.format import read_sharded_model

    ema = {"shadow": {"layer.weight": torch.arange(6.0).reshape(2, 3), "layer.bias": torch.ones(2)}, "updates": 7}
    model = {"layer.weight": torch.zeros(2, 3)}
    dcp.save({"ema": ema, "model": model}, storage_writer=dcp.FileSystemWriter(str(tmp_path)), no_dist=True)
    read = read_sharded_model(str(tmp_path), "ema")
    assert read.keys() == {"shadow", "updates"} and read["updates"] == 7
    assert read["shadow"].keys() == ema["shadow"].keys()
    assert all(torch.equal(read["shadow"][name], ema["shadow"][name]) for name in ema["shadow"])
    assert read_sharded_model(str(tmp_path)).keys() == {"layer.weight"}


class RunningStatistic:
    """A part of extra_state that compute_loss changes in place at every forward: a count and a history."""

    def __init__(self):
        self.count, self.history = torch.zeros(()), []

    def forward(self):
        self.count.add_(1)
        self.history.append(float(self.count))

    def state_dict(self):
        return {"count": self.count, "history": self.history}

    def load_state_dict(self, state):
        self.count.copy_(state["count"])
        self.history[:] = state["history"]


def test_an_extra_part_is_saved_as_it_was_at_the_snapshot_step(tmp_path):
    """The writer thread copies a snapshot while the next step's forward runs (the model and the optimizer do not
    change before the next optimizer step, which waits for that copy). A part of extra_state that the forward
    changes is saved as it was at the snapshot step, not torn by the next step."""
    from {{ cookiecutter.project_slug }}.machinery.optim import OptimizerPart
    from {{ cookiecutter.project_slug }}.machinery.state import ModelPart, RngPart, TrainState

    model, statistic = torch.nn.Linear(2, 2), RunningStatistic()
    state = TrainState(DistEnv(), sharded=False)
    state.add("model", ModelPart(model))
    state.add("optimizer", OptimizerPart(torch.optim.SGD(model.parameters(), lr=0.1)))
    state.add("rng", RngPart(), per_rank=True)
    state.add("statistic", statistic, extra=True)
    for _ in range(5):
        statistic.forward()
    shared, rank_state, _ = state.capture()  # the snapshot of step 5
    shared.update(step=5, config={}, run_id="x", torch_version=str(torch.__version__))
    statistic.forward()  # the next step's forward, before the writer thread has copied the snapshot
    snapshots = Snapshots(tmp_path, DistEnv(), keep=3)
    snapshots.prepare(estimated_bytes=1)
    snapshots.save(5, shared, rank_state, blocking=True)
    snapshots.close()
    saved = load_latest(str(tmp_path))["statistic"]
    assert float(saved["count"]) == 5 and saved["history"] == [1.0, 2.0, 3.0, 4.0, 5.0]


# Frozen parameters (requires_grad=False) written once: the snapshots that leave them out, and their checksums.


def save_adapter_run(folder, saves, keep):
    """Saves of a model whose "base" is frozen: (step, frozen_in) each; a save whose own step is its frozen_in holds
    the base (as it is at that step), the others only the "adapter". Returns {step: (base, adapter)} as saved."""
    snapshots = Snapshots(folder, DistEnv(), keep=keep)
    snapshots.prepare(estimated_bytes=1)
    saved = {}
    for step, frozen_in in saves:
        base, adapter = torch.arange(8.0) + frozen_in, torch.full((2,), float(step))
        model = {"base": base, "adapter": adapter} if frozen_in == step else {"adapter": adapter}
        snapshots.save(step, {"model": model, "step": step}, {}, blocking=True, frozen_in=frozen_in)
        saved[step] = base, adapter
    snapshots.close()
    return saved


def test_snapshots_without_the_frozen_parameters_load_them_from_the_one_that_holds_them_and_keep_it(tmp_path):
    saved = save_adapter_run(tmp_path, [(10, 10), (20, 10), (30, 10), (40, 10)], keep=2)
    # 20 goes; 10 stays as long as a kept snapshot refers to it
    assert sorted(p.name for p in tmp_path.glob("step-*")) == [step_name(10), step_name(30), step_name(40)]
    assert (tmp_path / step_name(40) / SHARED).stat().st_size < (tmp_path / step_name(10) / SHARED).stat().st_size
    base, adapter = saved[40]
    for state in (load_latest(str(tmp_path)), resume(tmp_path)):
        assert state["step"] == 40 and state["model"].keys() == {"base", "adapter"}
        assert torch.equal(state["model"]["base"], base) and torch.equal(state["model"]["adapter"], adapter)
    # Once the newest ones hold the base themselves (it changed), the old holder goes.
    save_adapter_run(tmp_path, [(50, 50), (60, 50)], keep=2)
    assert sorted(p.name for p in tmp_path.glob("step-*")) == [step_name(50), step_name(60)]
    assert torch.equal(load_latest(str(tmp_path))["model"]["base"], torch.arange(8.0) + 50)


def test_a_damaged_holder_of_the_frozen_parameters_makes_the_snapshots_that_refer_to_it_unusable(tmp_path):
    save_adapter_run(tmp_path, [(10, 10), (20, 10)], keep=3)
    flip_one_bit(tmp_path / step_name(10) / SHARED)
    with pytest.raises(SnapshotError, match=f"{step_name(20)}.*frozen parameters are in .*{step_name(10)}"):
        load_latest(str(tmp_path))


def test_a_frozen_parameter_that_changed_is_said_and_its_next_snapshot_holds_it_again(caplog):
    from {{ cookiecutter.project_slug }}.machinery.frozen import FrozenWeights

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    model[0].requires_grad_(False)
    frozen = FrozenWeights(model, DistEnv(), sharded=False)
    assert frozen.names == {"0.weight", "0.bias"}
    assert frozen.held_by(10) == 10  # the first save holds them
    with torch.no_grad():
        model[1].weight.add_(1.0)  # training changes what trains
    assert frozen.held_by(20) == 10 and not caplog.records
    with torch.no_grad():
        model[0].weight[[0, 1]] = model[0].weight[[1, 0]].clone()  # the same values, two rows swapped
    assert frozen.held_by(30) == 30
    (warning,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert "0.weight" in warning and "0.bias" not in warning
    assert frozen.held_by(40) == 30


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.int8, torch.bool])
def test_the_frozen_checksum_sees_one_changed_element_of_any_dtype(dtype):
    from {{ cookiecutter.project_slug }}.machinery.frozen import checksum

    tensor = (torch.arange(1000) % 7).to(dtype)
    changed = tensor.clone()
    changed[497] = 1  # 497 % 7 == 0
    assert checksum(tensor) == checksum(tensor.clone())
    assert checksum(changed) != checksum(tensor)


def test_a_replay_copies_the_snapshot_that_holds_the_frozen_parameters_too(tmp_path):
    from {{ cookiecutter.project_slug }} import config
    from {{ cookiecutter.project_slug }}.machinery.debugflags import replay_settings

    folder = tmp_path / "snapshots"
    saved = save_adapter_run(folder, [(10, 10), (20, 10)], keep=3)
    cfg = config.parse_args(["--wandb", "disabled", "--snapshot-dir", str(folder), "--resume-from", "20"])
    replay = replay_settings(cfg, DistEnv())
    assert sorted(p.name for p in (tmp_path / "snapshots.replay-20").glob("step-*")) == [step_name(10), step_name(20)]
    assert torch.equal(load_latest(replay.snapshot_dir)["model"]["base"], saved[20][0])


def resident_mib():
    """(this process's resident memory now, its peak since the last reset), MiB; the peak is reset to now."""
    fields = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines() if ":" in line)
    now, peak = (int(fields[key].split()[0]) / 1024 for key in ("VmRSS", "VmHWM"))
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")
    return now, peak


# Tensors over 32 MiB: glibc maps each one of its own and unmaps it when freed, so the resident memory follows them.
BIG = 3 * 2**20


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="reads the peak resident memory of Linux")
def test_the_export_writes_the_weights_without_a_second_copy_of_them(tmp_path):
    from {{ cookiecutter.project_slug }}.machinery import report

    model = torch.nn.Sequential(torch.nn.Linear(BIG, 3, bias=False), torch.nn.Linear(3, BIG, bias=False))
    size_mib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    before, _ = resident_mib()
    report.export(model, False, DistEnv(), str(tmp_path), "model.pt")
    _, peak = resident_mib()
    assert peak - before < size_mib / 2, f"the export held {peak - before:.0f} MiB more, the weights are {size_mib:.0f}"
    exported = torch.load(tmp_path / "model.pt", weights_only=True)
    assert all(torch.equal(exported[name], value) for name, value in model.state_dict().items())


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="reads the resident memory of Linux")
@pytest.mark.parametrize("copy", [True, False], ids=["copy", "no copy"])
def test_a_save_holds_the_state_of_its_step_with_a_copy_of_it_or_without_one(tmp_path, copy):
    """With a copy, wait_until_copied() returns once the state is copied (training goes on while it is written); without
    one (--no-snapshot-copy), once the state itself is written: no memory beyond the state, the same snapshot. A
    tensor named twice (tied weights) is copied once."""
    snapshots = Snapshots(tmp_path, DistEnv(), keep=3, copy=copy)
    snapshots.prepare(estimated_bytes=1)
    weights = torch.zeros(BIG, 4)
    size_mib = weights.numel() * weights.element_size() / 2**20
    before, _ = resident_mib()
    snapshots.save(5, {"model": {"w": weights, "tied": weights}, "step": 5}, {"rng": torch.arange(3)})
    snapshots.wait_until_copied()
    weights.add_(1)  # training changes the weights as soon as wait_until_copied() returns
    snapshots.wait()
    _, peak = resident_mib()
    snapshots.close()
    saved = load_latest(str(tmp_path))["model"]
    assert torch.equal(saved["w"], torch.zeros(BIG, 4)) and saved["tied"].data_ptr() == saved["w"].data_ptr()
    if copy:
        assert 0.8 * size_mib < peak - before < 1.5 * size_mib, f"the save held {peak - before:.0f} MiB"
    else:
        assert peak - before < 0.2 * size_mib, f"the save held {peak - before:.0f} MiB, the state is {size_mib:.0f}"


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="reads the resident memory of Linux")
def test_the_staging_copy_of_the_state_goes_once_the_run_saves_no_more(tmp_path):
    snapshots = Snapshots(tmp_path, DistEnv(), keep=3)
    snapshots.prepare(estimated_bytes=1)
    state = {"model": {"w": torch.ones(BIG, 4)}}
    snapshots.save(1, state, {"rng": torch.arange(3)}, blocking=True)
    snapshots.save(2, state, {"rng": torch.arange(3)}, blocking=True)  # into the staging buffers of the first
    holding, _ = resident_mib()
    snapshots.release_buffers()
    released, _ = resident_mib()
    snapshots.close()
    assert holding - released > 0.8 * 4 * BIG * 4 / 2**20
    assert torch.equal(load_latest(tmp_path)["model"]["w"], state["model"]["w"])
