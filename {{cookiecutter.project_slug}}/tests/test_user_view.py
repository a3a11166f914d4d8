"""What a user sees: a peer's death on the surviving rank, the loss curve, VSCode's rank picker and GPU choice."""

import json
import os
import re
import signal
import sys

import pytest
from conftest import PACKAGE, ROOT, finish, outputs, run, start, train_cmd, wait_for, worker_pids
from jsonc import load_jsonc
from test_debug import configuration, launch_json, resolve

from {{ cookiecutter.project_slug }}.machinery import baked, plot
from {{ cookiecutter.project_slug }}.machinery.snapshot import load_latest

# A console record as logs.py formats it: date, time, level, [rank N].
RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d (DEBUG|INFO|WARNING|ERROR|CRITICAL) \[rank (\d+)\] ", re.M)


def records(text, level, rank):
    return [m for m in RECORD.finditer(text) if m.group(1) == level and m.group(2) == str(rank)]


# A peer's death.


def test_a_killed_peer_is_one_warning_on_the_surviving_rank(tmp_path):
    """Rank 1 is SIGKILLed mid-training: rank 0 says so in one warning, with no traceback, and the job fails."""
    rank_logs = tmp_path / "torchrun"  # torchrun's copy of each rank's own console output
    snapshots = tmp_path / "run-snapshots"
    cmd = (
        train_cmd(2, ["--max-restarts=0", "--tee=3", f"--log-dir={rank_logs}"])
        + outputs(tmp_path)
        + [
            "--wandb",
            "disabled",
            "--max-steps",
            "1000000",
            "--snapshot-every",
            "5",
            "--log-file",
            str(tmp_path / "rank{rank}.log"),
        ]
    )
    job = start(cmd)
    try:
        pids = wait_for(lambda: len(worker_pids(job.pid)) == 2 and worker_pids(job.pid), what="two workers")
        # A snapshot: every rank is inside the training loop, exchanging gradients.
        wait_for(lambda: load_latest(str(snapshots)) is not None, timeout=180, interval=0.5, what="a snapshot")
        os.kill(pids[1], signal.SIGKILL)
        code, out = finish(job, timeout=180)
    finally:
        for pid in worker_pids(job.pid).values():
            os.kill(pid, signal.SIGKILL)
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()

    assert code != 0, out[-4000:]
    (survivor_file,) = rank_logs.glob("*/attempt_0/0/stderr.log")
    survivor = survivor_file.read_text(errors="replace")
    assert "Traceback" not in survivor, survivor[-4000:]
    assert len(records(survivor, "WARNING", 0)) == 1, survivor[-4000:]
    assert not records(survivor, "ERROR", 0), "the healthy rank must not look guilty:\n" + survivor[-4000:]
    # The traceback is not lost: a per-rank log file keeps it, for whoever digs.
    assert "Traceback" in (tmp_path / "rank0.log").read_text()


# The loss curve.


def write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines[:-1]) + lines[-1])  # the last one cut mid-write
    return path


def test_metrics_reader_skips_a_cut_line_and_keeps_the_newest_record_of_a_redone_step(tmp_path):
    metrics = write_lines(
        tmp_path / "metrics.jsonl",
        [
            json.dumps({"step": 10, "loss": 2.0, "lr": 0.1}),
            json.dumps({"step": 20, "loss": 1.5}),
            "[1, 2]",  # valid JSON, not a record
            json.dumps({"step": 20, "loss": 1.25, "val_loss": 1.5, "val_accuracy": 0.5}),  # redone after a resume
            json.dumps({"step": 30, "loss": float("nan")}),
            '{"step": 40, "loss": 0.',
        ],
    )
    records_read = plot.read_metrics(metrics)
    assert [r["step"] for r in records_read] == [10, 20, 30]
    assert plot.curves(records_read) == {"loss": ([10, 20], [2.0, 1.25]), "val_loss": ([20], [1.5])}


def test_plot_draws_the_curves_of_a_real_run(tmp_path):
    pytest.importorskip("matplotlib")
    from matplotlib.image import imread

    metrics, png = tmp_path / "metrics.jsonl", tmp_path / "plots" / "loss.png"
    run(
        train_cmd(2)
        + outputs(tmp_path)
        + [
            "--wandb",
            "disabled",
            "--max-steps",
            "40",
            "--log-every",
            "5",
            "--eval-every",
            "20",
            "--metrics-file",
            str(metrics),
        ]
    )
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    train_steps = [r["step"] for r in lines if "loss" in r]
    val_steps = [r["step"] for r in lines if "val_loss" in r]
    assert len(train_steps) >= 8 and val_steps, lines

    result = run([sys.executable, "-m", f"{PACKAGE}.machinery.plot", "--metrics-file", str(metrics), "--out", str(png)])
    assert str(png) in result.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = imread(png)
    assert image.shape[0] >= 200 and image.shape[1] >= 300
    assert len({tuple(pixel) for row in image[::7] for pixel in row[::7]}) > 10, "a blank image"

    drawn = plot.curves(plot.read_metrics(metrics))
    assert drawn["loss"][0] == sorted(set(train_steps)) and drawn["val_loss"][0] == sorted(set(val_steps))


def test_plot_without_matplotlib_says_how_to_get_it(tmp_path):
    metrics = write_lines(tmp_path / "metrics.jsonl", [json.dumps({"step": 1, "loss": 1.0}), ""])
    hide_matplotlib = (
        "import sys; sys.modules['matplotlib'] = None; "
        f"from {PACKAGE}.machinery import plot; sys.exit(plot.main(sys.argv[1:]))"
    )
    result = run(
        [sys.executable, "-c", hide_matplotlib, "--metrics-file", str(metrics), "--out", str(tmp_path / "loss.png")],
        check=False,
    )
    assert result.returncode == 1
    assert "pip install matplotlib" in result.stdout and "Traceback" not in result.stdout
    assert len(result.stdout.strip().splitlines()) == 1, result.stdout
    assert not (tmp_path / "loss.png").exists()


def test_plot_names_a_missing_metrics_file(tmp_path):
    pytest.importorskip("matplotlib")
    missing = tmp_path / "nowhere" / "metrics.jsonl"
    result = run([sys.executable, "-m", f"{PACKAGE}.machinery.plot", "--metrics-file", str(missing)], check=False)
    assert result.returncode == 1
    assert str(missing) in result.stdout and "Traceback" not in result.stdout


# VSCode: the rank picker and the GPUs of a debug run.


def shown_by_vscode(option):
    """How VSCode's quick pick shows a pickString option: "label: value", or the value alone (VSCode's
    baseConfigurationResolverService.showUserInput)."""
    if isinstance(option, str):
        return option
    return f"{option['label']}: {option['value']}" if option.get("label") else option["value"]


def test_rank_picker_shows_each_rank_and_its_port_once(tmp_path):
    (picker,) = [spec for spec in launch_json()["inputs"] if spec["id"] == "rankPort"]
    shown = [shown_by_vscode(option) for option in picker["options"]]
    assert len(shown) == baked.NPROC_PER_NODE and len(set(shown)) == len(shown)
    for rank, text in enumerate(shown):
        port = str(baked.DEBUG_PORT + rank)
        assert re.search(rf"\brank {rank}\b", text), text
        assert text.count(port) == 1, f"{text!r} shows port {port} {text.count(port)} times"
        assert len(re.findall(r"\b\d{4,5}\b", text)) == 1, f"{text!r} shows more than one port"

    def choose_rank(rank):
        return lambda spec: next(o["value"] for o in spec["options"] if re.search(rf"\brank {rank}\b", o["label"]))

    attach = configuration("Attach to rank N")
    for rank in range(baked.NPROC_PER_NODE):
        connect = resolve(attach, tmp_path, launch_json()["inputs"], choose_rank(rank))["connect"]
        assert int(connect["port"]) == baked.DEBUG_PORT + rank


def uncomment(text, key):
    """The file with the commented-out `"key": ...` lines turned on, as a user does to use them."""
    pattern = re.compile(rf'^(\s*)// ("{re.escape(key)}":)', re.M)
    assert pattern.search(text), f"no commented {key} line"
    return pattern.sub(r"\1\2", text)


@pytest.mark.parametrize("file", ["launch.json", "tasks.json"])
def test_gpus_of_a_debug_run_are_one_uncommented_line_away(tmp_path, file):
    source = ROOT / ".vscode" / file
    edited = tmp_path / file
    edited.write_text(uncomment(source.read_text(), "CUDA_VISIBLE_DEVICES"))
    parsed = load_jsonc(edited)
    if file == "launch.json":
        envs = [c["env"] for c in parsed["configurations"] if c.get("module") == "torch.distributed.run"]
    else:
        envs = [t["options"]["env"] for t in parsed["tasks"] if "torch.distributed.run" in t.get("args", [])]
    assert envs
    for env in envs:
        gpus = env["CUDA_VISIBLE_DEVICES"].split(",")
        assert gpus and all(gpu.strip().isdigit() for gpu in gpus), env
    # Left as shipped, the GPUs are torchrun's choice.
    original = load_jsonc(source)
    assert "CUDA_VISIBLE_DEVICES" not in json.dumps(original)
