"""launch(): training from a notebook (a real Jupyter kernel, driven by nbclient) and from a plain script.

The same guarantees as torchrun: a rank SIGKILLed from outside restarts the job from its newest snapshot and the
final weights equal an uninterrupted launch's bit for bit; the stop button stops every rank with a snapshot;
rank 0's lines appear once in the cell; a bad flag is one exception in the cell.
"""

import json
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import EXACT, QUICK, ROOT, assert_same_weights, child_env, final_model, rank_pids, run, wait_for

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

PACKAGE = "{{ cookiecutter.project_slug }}"
ARGS = EXACT + ["--max-steps", "60"]  # compared bit for bit with an uninterrupted launch
LONG = QUICK + ["--max-steps", "3000", "--snapshot-every", "1000"]  # runs until it is stopped


def folders(tmp_path, name):
    run_dir = tmp_path / name
    return [
        *("--snapshot-dir", f"{run_dir}/snapshots"),
        *("--export-dir", f"{run_dir}/export"),
        *("--metrics-file", f"{run_dir}/metrics.jsonl"),
        *("--log-file", f"{run_dir}/train.log"),
    ]


def _steps(path):
    """The steps logged in a metrics file so far (a line being written now left out)."""
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.endswith("}")]


def execute(cells, tmp_path, timeout=300, notebook=None):
    """Run code cells in a fresh kernel (the kernel's folder: notebooks/, as VSCode starts it); the notebook."""
    nb = notebook or nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source) for source in cells])
    client = nbclient.NotebookClient(
        nb,
        timeout=timeout,
        kernel_name="python3",
        allow_errors=True,
        resources={"metadata": {"path": str(ROOT / "notebooks")}},
    )
    client.execute(env=child_env())
    return nb


def errors(cell):
    return [out for out in cell.get("outputs", []) if out.output_type == "error"]


def streamed(cell, name=None):
    outputs = cell.get("outputs", [])
    return "".join(out.text for out in outputs if out.output_type == "stream" and name in (None, out.name))


def workers_of(run_dir):
    """{rank: pid} of the training processes whose command line names run_dir (whatever started them)."""
    return rank_pids(lambda pid, parent, cmdline, env: str(run_dir).encode() in cmdline)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """launch() from a plain script (no `if __name__ == "__main__":` guard) with ARGS on 2 ranks, uninterrupted:
    (the summary it returned, the run's folder)."""
    folder = tmp_path_factory.mktemp("uninterrupted")
    script = folder / "train_two_ranks.py"
    script.write_text(
        f"import json, sys\nsys.path.insert(0, {str(ROOT)!r})\nfrom {PACKAGE}.launch import launch\n"
        f"summary = launch(nproc_per_node=2, args={ARGS + folders(folder, 'run')!r})\n"
        f"print('SUMMARY ' + json.dumps(summary))\n"
    )
    out = run([sys.executable, str(script)], cwd=folder).stdout
    return json.loads(out.split("SUMMARY ", 1)[1].splitlines()[0]), folder / "run"


def test_launch_from_a_plain_script_returns_rank_0s_summary(uninterrupted):
    returned, run_dir = uninterrupted
    assert returned == json.loads((run_dir / "export" / "summary.json").read_text())
    assert returned["world_size"] == 2 and returned["steps"] == 60 and returned["resumed_from"] == -1
    assert final_model(run_dir / "snapshots")["step"] == 60


def test_the_shipped_notebook_trains_shows_rank_0_once_and_refuses_bad_flags_in_one_line(tmp_path):
    notebook = nbformat.read(ROOT / "notebooks" / "train.ipynb", as_version=4)
    (parameters,) = [cell for cell in notebook.cells if "parameters" in cell.metadata.get("tags", [])]
    parameters.source += f"\nRUN_DIR = {str(tmp_path / 'demo')!r}\nFLAGS = FLAGS + ['--wandb', 'disabled']\n"
    shipped = len(notebook.cells)
    (tmp_path / "a-file").write_text("")
    notebook.cells += [
        nbformat.v4.new_code_cell(f"launch(nproc_per_node=2, args={['--lr', '-1'] + LONG!r})"),  # refused here
        nbformat.v4.new_code_cell(  # refused by the ranks, after they started
            f"launch(nproc_per_node=2, args={LONG + ['--snapshot-dir', str(tmp_path / 'a-file')]!r})"
        ),
    ]
    nb = execute(None, tmp_path, notebook=notebook)

    for cell in nb.cells[:shipped]:
        assert not errors(cell), errors(cell)[0].traceback[-3:]
    (train_cell,) = [cell for cell in nb.cells[:shipped] if cell.cell_type == "code" and "launch(" in cell.source]
    returned = [out for out in train_cell.outputs if out.output_type == "execute_result"]
    assert returned and "'steps'" in returned[0].data["text/plain"], train_cell.outputs
    shown = streamed(train_cell).splitlines()
    steps = _steps(tmp_path / "demo" / "metrics.jsonl")
    assert steps, "the run logged steps"
    for step in steps:  # rank 0's line of each logged step, once; no other rank's INFO lines
        assert len([line for line in shown if f" step {step}/" in line]) == 1, (step, shown[-20:])
    assert not [line for line in shown if " INFO [rank 1]" in line]
    outputs = [out for cell in nb.cells[:shipped] for out in cell.get("outputs", [])]
    pictures = [out for out in outputs if "image/png" in out.get("data", {})]
    assert pictures, "the loss curves are drawn"

    for cell in nb.cells[shipped:]:
        (error,) = errors(cell)
        assert error.ename == "RunError", (error.ename, error.evalue)
        assert "\n" not in error.evalue.strip()
    assert "--lr" in nb.cells[shipped].outputs[-1].evalue
    assert "a-file" in nb.cells[shipped + 1].outputs[-1].evalue
    assert not (tmp_path / "demo" / "snapshots" / "step-00000000").exists()


def test_a_notebook_launch_survives_a_sigkill_bitwise_and_the_stop_button_saves_a_snapshot(tmp_path, uninterrupted):
    kill = tmp_path / "killed"
    stop = tmp_path / "stopped"
    cells = [
        f"import sys; sys.path.insert(0, {str(ROOT)!r})\nfrom {PACKAGE}.launch import launch",
        f"summary = launch(nproc_per_node=2, args={ARGS + folders(tmp_path, 'killed')!r}, max_restarts=1)",
        f"launch(nproc_per_node=2, args={LONG + folders(tmp_path, 'stopped')!r}, max_restarts=1)",
        f"from {PACKAGE}.machinery.snapshot import load_latest\n"
        f"stopped_at = load_latest({str(stop / 'snapshots')!r})['step']\n"
        f"again = launch(nproc_per_node=2, args={QUICK + folders(tmp_path, 'stopped')!r} + "
        "['--max-steps', str(stopped_at + 10)])\n"
        "print('RESUMED', again['resumed_from'], stopped_at)",
    ]
    happened = {}

    def from_outside():
        try:
            kill_then_interrupt()
        except BaseException as problem:  # the test fails with it below
            happened["problem"] = repr(problem)

    def kill_then_interrupt():
        step = random.randint(12, 40)
        wait_for(lambda: any(s >= step for s in _steps(kill / "metrics.jsonl")), timeout=180, what=f"step {step}")
        time.sleep(random.uniform(0, 0.3))
        victim = random.randrange(2)
        workers = wait_for(lambda: len(found := workers_of(kill)) == 2 and found, timeout=60, what="both ranks")
        os.kill(workers[victim], signal.SIGKILL)
        happened["killed"] = (victim, step)
        wait_for(lambda: any(s >= 20 for s in _steps(stop / "metrics.jsonl")), timeout=180, what="step 20")
        rank_0 = wait_for(lambda: workers_of(stop).get(0), timeout=60, what="rank 0")
        kernel = int(Path(f"/proc/{rank_0}/stat").read_text().rsplit(")", 1)[1].split()[1])  # the agent's process
        assert os.getpgid(kernel) != os.getpgid(0), "the kernel runs in a process group of its own"
        os.killpg(os.getpgid(kernel), signal.SIGINT)  # what the stop button does (Jupyter's "signal" interrupt)
        happened["interrupted"] = True

    thread = threading.Thread(target=from_outside, daemon=True)
    thread.start()
    nb = execute(cells, tmp_path, timeout=400)
    thread.join(timeout=5)
    assert happened.get("interrupted"), happened

    assert not errors(nb.cells[1]), errors(nb.cells[1])
    assert_same_weights(final_model(uninterrupted[1] / "snapshots")["model"], final_model(kill / "snapshots")["model"])
    resumed = json.loads((kill / "export" / "summary.json").read_text())
    assert resumed["resumed_from"] >= 0, (happened, resumed)

    (error,) = errors(nb.cells[2])
    assert error.ename == "KeyboardInterrupt", "the stop button interrupts the cell"
    resumed_from, stopped_at = map(int, streamed(nb.cells[3], "stdout").split("RESUMED ", 1)[1].split()[:2])
    assert 20 <= stopped_at < 1000, "the stop saved a snapshot at the step it stopped at"
    assert resumed_from == stopped_at, "launching again resumes from the stop's snapshot"
    assert not workers_of(stop), "no rank outlives the run"
