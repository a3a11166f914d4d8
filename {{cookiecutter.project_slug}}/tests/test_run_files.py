"""What a run writes beside its snapshots belongs to that run: the metrics file, the export folder, config.toml, the
log file; and every path flag is checked before training."""

import json
import os
import signal
import sys

import pytest
from conftest import QUICK, child_env, default_datasets, finish, run, start, train_cmd, wait_for

# train.py with the validation data or val_metrics of model.py replaced, chosen by environment variables.
WRAPPER = """
import os
import sys

import torch

import train
from {{ cookiecutter.project_slug }} import data, model

if os.environ.get("NO_VALIDATION"):
    build_datasets = data.build_datasets
    data.build_datasets = lambda cfg: (build_datasets(cfg)[0], None)
if os.environ.get("VECTOR_VAL_METRIC"):
    model.val_metrics = lambda outputs, targets: dict(per_class=torch.ones(3))
train.warmstart.run_and_exit(lambda: train.main(sys.argv[1:]))  # as train.py ends
"""
FEW = QUICK + ["--log-every", "2"]


@pytest.fixture
def wrapper(tmp_path):
    script = tmp_path / "wrapped_train.py"
    script.write_text(WRAPPER)
    return [sys.executable, str(script)]


def records(path):
    """The records of a metrics file (its lines that are JSON)."""
    found = []
    for line in path.read_bytes().splitlines():
        try:
            found.append(json.loads(line))
        except ValueError:
            continue
    return found


def run_of(path):
    """(run ids, steps) of a metrics file's records."""
    found = records(path)
    return {r["run_id"] for r in found}, [r["step"] for r in found]


def errors_of(result):
    return [line for line in result.stdout.splitlines() if " ERROR " in line]


def test_path_flags_are_checked_before_training(tmp_path):
    a_file, a_folder = tmp_path / "a-file", tmp_path / "a-folder"
    a_file.write_text("not a folder")
    a_folder.mkdir()
    (a_folder / "kept.txt").write_text("kept")
    bad = {
        "--snapshot-dir": str(a_file / "snapshots"),  # under a file: it cannot be made
        "--export-dir": str(a_file),  # a file, not a folder
        "--metrics-file": str(a_folder),
        "--log-file": str(a_folder / "kept.txt" / "train.log"),
    }
    result = run(train_cmd() + QUICK + ["--max-steps", "3"] + [x for item in bad.items() for x in item], check=False)
    assert result.returncode == 2, result.stdout[-3000:]
    (error,) = errors_of(result)
    assert all(name in error for name in bad), error
    assert "Traceback" not in result.stdout
    assert [p.name for p in a_folder.iterdir()] == ["kept.txt"] and (a_folder / "kept.txt").read_text() == "kept"


def test_a_url_whose_store_package_is_missing_is_refused_and_makes_no_local_folder(tmp_path, monkeypatch):
    """`--snapshot-dir gs://bucket/run` written as a path would be a local folder `gs:/bucket/run`: a job whose
    snapshots no other machine sees. Without the store's package it is refused in one line naming the flag and
    the extra to install, and nothing is made."""
    import importlib.util

    from {{ cookiecutter.project_slug }}.config import Config
    from {{ cookiecutter.project_slug }}.machinery import outputs
    from {{ cookiecutter.project_slug }}.machinery.distributed import DistEnv
    from {{ cookiecutter.project_slug }}.machinery.settings import RunError

    if importlib.util.find_spec("gcsfs"):
        pytest.skip("gcsfs is installed")
    monkeypatch.chdir(tmp_path)
    for name, url in [("snapshot_dir", "gs://bucket/run"), ("export_dir", "gs://bucket/export")]:
        cfg = Config(**{name: url})
        with pytest.raises(RunError) as refused:
            outputs.check_paths(cfg, DistEnv())
        assert f"--{name.replace('_', '-')}" in str(refused.value) and url in str(refused.value)
        assert "'.[gcs]'" in str(refused.value)
    assert list(tmp_path.iterdir()) == []


def test_runs_one_after_another_keep_their_own_files(tmp_path, wrapper):
    """Run A, then run B started afresh (--resume never) on the same symlinked snapshot folder, export folder and
    metrics file, without validation data; then A resumed from its config.toml."""
    disk = tmp_path / "disk"
    (disk / "real").mkdir(parents=True)
    link = tmp_path / "snapshots"
    link.symlink_to(disk / "real")
    export, metrics_file = tmp_path / "export", tmp_path / "metrics.jsonl"
    paths = ["--export-dir", str(export), "--metrics-file", str(metrics_file)]
    in_link = ["--snapshot-dir", str(link), "--log-file", str(link / "train.log")]
    no_validation = child_env(NO_VALIDATION=1)

    evaluates = default_datasets()[1] is not None  # A has the project's validation data, if it has any
    run(train_cmd() + FEW + ["--max-steps", "4", "--resume", "never"] + paths + in_link)
    run_a = json.loads((link / "run.json").read_text())["run_id"]
    assert json.loads((export / "summary.json").read_text())["run_id"] == run_a
    assert (export / "best.pt").is_file() == evaluates
    log_of_a = (disk / "real" / "train.log").read_bytes()

    # B: a fresh run into the same places.
    run(wrapper + FEW + ["--max-steps", "4", "--resume", "never"] + paths + in_link, env=no_validation)
    assert link.is_symlink() and os.readlink(link) == str(disk / "real"), "the link stays where it was"
    (aside,) = disk.glob("real.set-aside-*")
    assert json.loads((aside / "run.json").read_text())["run_id"] == run_a
    assert (aside / "train.log").read_bytes() == log_of_a, "the set-aside folder keeps A's log, and only A's"
    assert (disk / "real" / "step-00000004" / "manifest.json").is_file(), "B's snapshots are on the linked disk"
    assert (disk / "real" / "train.log").stat().st_size, "B's log is in B's folder"
    run_b = json.loads((link / "run.json").read_text())["run_id"]
    done = json.loads((export / "summary.json").read_text())
    assert run_b != run_a and (done["run_id"], done["resumed_from"], done["best_val_loss"]) == (run_b, -1, None)
    assert (export / "model.pt").is_file() and not (export / "best.pt").exists(), "no best.pt: B never evaluated"
    assert sorted(p.name for p in tmp_path.glob("export.*")) == [f"export.{run_a}"]
    assert json.loads((tmp_path / f"export.{run_a}" / "summary.json").read_text())["run_id"] == run_a
    assert (tmp_path / f"export.{run_a}" / "best.pt").is_file() == evaluates
    assert run_of(metrics_file) == ({run_b}, [2, 4])
    assert run_of(tmp_path / f"metrics.{run_a}.jsonl") == ({run_a}, [2, 4])

    # A resumes from the config.toml it wrote (started with --resume never, it reads back as "continue"): its files
    # come back and B's go aside; lines of A's metrics that are not records are skipped.
    with open(tmp_path / f"metrics.{run_a}.jsonl", "ab") as handle:
        handle.write(b'\xff\xfe not utf-8\n{"step": 1e400}\n[[[\n')
    a_again = ["--config", str(aside / "config.toml"), "--snapshot-dir", str(aside), "--log-file", ""]
    run(wrapper + a_again + ["--max-steps", "6"], env=no_validation)
    done = json.loads((export / "summary.json").read_text())
    assert (done["run_id"], done["resumed_from"], done["steps"]) == (run_a, 4, 6)
    assert not list(disk.glob("real.set-aside-*.set-aside-*")), "A's folder was not set aside again"
    assert run_of(metrics_file) == ({run_a}, [2, 4, 6])
    assert run_of(tmp_path / f"metrics.{run_b}.jsonl") == ({run_b}, [2, 4])
    assert (export / "best.pt").is_file() == evaluates, "A's best.pt is back"
    assert sorted(p.name for p in tmp_path.glob("export.*")) == [f"export.{run_b}"]
    assert not (tmp_path / f"export.{run_b}" / "best.pt").exists()

    # Plotting a metrics file with bytes that are no records draws what is there.
    from {{ cookiecutter.project_slug }}.machinery import plot

    with open(metrics_file, "ab") as handle:
        handle.write(b"\x80\x81 garbage\n")
    assert plot.main(["--metrics-file", str(metrics_file), "--out", str(tmp_path / "loss.png")]) == 0
    assert (tmp_path / "loss.png").stat().st_size > 0


def test_a_live_job_keeps_its_files_and_a_stopped_run_keeps_no_other_runs_model(tmp_path, wrapper):
    export, metrics_file = tmp_path / "export", tmp_path / "metrics.jsonl"
    export.mkdir()
    earlier = {"model.pt": b"earlier weights", "best.pt": b"earlier best"}
    for name, content in earlier.items():
        (export / name).write_bytes(content)
    (export / "summary.json").write_text(json.dumps({"run_id": "earlier", "steps": 9}))
    shared = QUICK + ["--log-every", "1", "--export-dir", str(export), "--metrics-file", str(metrics_file)]

    job_a = start(
        wrapper + shared + ["--max-steps", "100000", "--snapshot-dir", str(tmp_path / "a"), "--log-file", ""],
        env=child_env(NO_VALIDATION=1),
    )
    try:
        wait_for(lambda: metrics_file.exists() and records(metrics_file), timeout=120, what="job A's first record")
        run(train_cmd() + shared + ["--max-steps", "4", "--snapshot-dir", str(tmp_path / "b"), "--log-file", ""])
        run_b = json.loads((tmp_path / "b" / "run.json").read_text())["run_id"]
        b_export = tmp_path / f"export.{run_b}"
        done_b = json.loads((b_export / "summary.json").read_text())
        assert done_b["run_id"] == run_b and done_b["export_dir"] == str(b_export)
        assert done_b["metrics_file"] == str(tmp_path / f"metrics.{run_b}.jsonl")
        assert run_of(tmp_path / f"metrics.{run_b}.jsonl") == ({run_b}, [1, 2, 3, 4])
        written = len(records(metrics_file))
        wait_for(lambda: len(records(metrics_file)) > written + 2, timeout=120, what="job A writing on")
    finally:
        os.killpg(job_a.pid, signal.SIGTERM)
    code, out = finish(job_a)
    assert code == 128 + signal.SIGTERM, out[-3000:]
    run_a = json.loads((tmp_path / "a" / "run.json").read_text())["run_id"]
    ids, steps = run_of(metrics_file)
    assert ids == {run_a} and steps == list(range(1, steps[-1] + 1)), "every step of A, and only A's"
    done_a = json.loads((export / "summary.json").read_text())
    assert (done_a["run_id"], done_a["stop_signal"]) == (run_a, signal.SIGTERM)
    assert not (export / "model.pt").exists() and not (export / "best.pt").exists(), "A stopped and never evaluated"
    kept = tmp_path / "export.earlier"
    assert {name: (kept / name).read_bytes() for name in earlier} == earlier
    assert json.loads((kept / "summary.json").read_text())["run_id"] == "earlier"


def test_a_val_metrics_value_that_is_not_a_number_is_refused_in_one_line(tmp_path, wrapper):
    from {{ cookiecutter.project_slug }} import model

    if hasattr(model, "compute_loss"):
        pytest.skip("model.py defines compute_loss: val_metrics is not called")
    paths = ["--snapshot-dir", str(tmp_path / "s"), "--log-file", "", "--export-dir", str(tmp_path / "e")]
    result = run(
        wrapper + QUICK + ["--max-steps", "2", "--metrics-file", ""] + paths,
        env=child_env(VECTOR_VAL_METRIC=1),
        check=False,
    )
    assert result.returncode == 2, result.stdout[-3000:]
    (error,) = errors_of(result)
    assert "val_metrics" in error and "per_class" in error
    assert "Traceback" not in result.stdout
    assert not (tmp_path / "e" / "model.pt").exists(), "the run stopped before exporting anything"
