"""scripts/gpu-check.sh: its dry run goes through both halves on CPU and prints the one summary table."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu-check.sh"


def check(*args, timeout=240, **env):
    """Run the script as a user would, with this environment's python for both halves."""
    # Not the test pool (WARM_START_POOL): the script's runs use the prepared venv's interpreter, which it refuses.
    dropped = ("DEBUG_", "WANDB_", "PYTEST_", "WARM_")
    variables = {k: v for k, v in os.environ.items() if not k.startswith(dropped)}
    variables.update({"PYTHON": sys.executable, **env})
    return subprocess.run(
        [str(SCRIPT), *map(str, args)], cwd=ROOT, env=variables, capture_output=True, text=True, timeout=timeout
    )


def table_rows(text):
    """{check: [A, B, B/A, note]} of the markdown table in `text`."""
    rows = {}
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.startswith("| ") and len(cells) == 5 and cells[0] not in ("check", "---"):
            rows[cells[0]] = cells[1:]
    return rows


def test_dry_run_prepares_installs_tests_and_benchmarks_then_prints_one_table(tmp_path):
    result = check("--cpu", tmp_path / "gpu-check")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    summary = (tmp_path / "gpu-check" / "results" / "summary.md").read_text()
    assert result.stdout.count("| check | A | B | B/A | note |") == 1, "one table"
    assert summary in result.stdout, "the printed table is the one written to results/summary.md"
    assert "DRY RUN ON CPU" in summary, "a dry run says it has no GPU result"
    rows = table_rows(summary)
    assert rows["install from the prepared folder, no network"][1] == "ok"
    tests = rows["pytest -m gpu"][1]
    assert re.fullmatch(r"0 passed, [1-9]\d* skipped in \d+ s", tests), tests  # every gpu test skips, none fails
    steps = rows["steady-state steps/s: bare loop (A), baked train.py (B)"]
    assert float(steps[0]) > 0 and float(steps[1]) > 0, steps
    assert any(name.startswith("training-thread stall per snapshot") for name in rows), rows
    # The prepared folder stands alone: the script, the benchmark, the baked project with its own gpu tests.
    prepared = tmp_path / "gpu-check"
    assert (prepared / "gpu-check.sh").is_file() and (prepared / "bench" / "gpu_bench.py").is_file()
    assert (prepared / "project" / "ddp_project" / "tests" / "test_gpu.py").is_file()

    if not torch.cuda.is_available():  # the GPU half refuses a machine without CUDA, in one line
        refused = check("--run", prepared, timeout=60)
        assert refused.returncode == 1
        assert refused.stderr.strip().count("\n") == 0 and "no CUDA GPU" in refused.stderr, refused.stderr


@pytest.mark.parametrize("args", [[], ["--bogus"], ["--run"], ["--prepare", "a", "b"]])
def test_bad_arguments_are_refused_in_one_line(args):
    result = check(*args, timeout=30)
    assert result.returncode == 1
    assert result.stderr.startswith("gpu-check: ") and result.stderr.count("\n") == 1, result.stderr
