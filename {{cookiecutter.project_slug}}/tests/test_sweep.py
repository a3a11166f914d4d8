"""Sweeps (`python -m {{ cookiecutter.project_slug }}.sweep SPACE.toml`): Optuna studies whose trials are 2-rank runs,
each in a folder of its own, on a SQLite file; pruned on every rank; a study stopped and started again."""

import json
import os
import signal
import sys

import pytest
from conftest import (
    EXACT,
    ROOT,
    assert_same_weights,
    child_env,
    final_model,
    finish,
    outputs,
    processes_naming,
    run,
    start,
    train_cmd,
    wait_for,
)

from {{ cookiecutter.project_slug }}.machinery.settings import RunError
from {{ cookiecutter.project_slug }}.machinery.sweeps import read_space

# Each trial: 20 steps, its train loss (logged every 5 steps) the objective; a snapshot every 5 steps.
TRIAL_ARGS = [*EXACT, "--max-steps", "20", "--snapshot-every", "5", "--eval-every", "0"]


def study_dir(tmp_path):
    return tmp_path / "sweeps" / "lr-sweep"


def space_file(tmp_path, lrs, trials=None, args=TRIAL_ARGS, **study):
    """A SPACE.toml searching --lr over `lrs` in that order (sampler grid), its objective the train loss."""
    settings = {"name": "lr-sweep", "trials": trials or len(lrs), "metric": "loss", "nproc_per_node": 2}
    settings.update({"sampler": "grid", "pruner_startup_trials": 1, "args": list(args), **study})
    lines = ["[study]", *(f"{key} = {json.dumps(value)}" for key, value in settings.items())]
    lines += ["[space]", "lr = { choices = " + json.dumps(lrs) + " }"]
    path = tmp_path / "space.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def sweep_cmd(tmp_path, space, *more):
    return [sys.executable, "-m", "{{ cookiecutter.project_slug }}.sweep", str(space), "--dir", str(tmp_path / "sweeps"), *more]


def trials(tmp_path, space):
    """The study's rows, as `sweep(..., show_only=True)` gives them (and draws trials.png)."""
    from {{ cookiecutter.project_slug }}.sweep import sweep

    return sweep(str(space), show_only=True, directory=str(tmp_path / "sweeps"))


def trial_summary(tmp_path, number):
    return json.loads((study_dir(tmp_path) / f"trial-{number}" / "export" / "summary.json").read_text())


def test_a_study_runs_each_trial_in_its_folder_prunes_one_on_every_rank_and_draws_its_trials(tmp_path):
    """Four trials; the one whose learning rate learns nothing is pruned at its first report after the first
    trial's, stopping every rank at the same step with a snapshot; each trial is one offline wandb run from rank 0,
    grouped by study; --show prints the table and draws trials.png."""
    offline = [a if a != "disabled" else "offline" for a in TRIAL_ARGS]
    space = space_file(tmp_path, [1e-2, 1e-12, 2e-2, 5e-3], args=offline)
    result = run(sweep_cmd(tmp_path, space), env=child_env(WANDB_DIR=tmp_path, WANDB_SILENT="true"), timeout=600)
    found = {row["trial"]: row for row in trials(tmp_path, space)}
    assert sorted(found) == [0, 1, 2, 3], result.stdout[-3000:]
    assert found[0]["state"] == "complete" and found[1]["state"] == "pruned", found
    assert found[1]["lr"] == 1e-12 and found[1]["steps"] < 20, found
    pruned = trial_summary(tmp_path, 1)
    assert pruned["pruned"] and pruned["steps"] == found[1]["steps"] and pruned["stop_signal"] == 0, pruned
    folder = study_dir(tmp_path) / "trial-1"
    assert final_model(folder / "snapshots")["step"] == pruned["steps"]  # every rank stopped there, with a snapshot
    assert not (folder / "export" / "model.pt").exists()  # a pruned trial exports no final weights
    for number in found:  # each trial's files in its folder, its settings in its config.toml
        folder = study_dir(tmp_path) / f"trial-{number}"
        assert (folder / "logs" / "metrics.jsonl").is_file() and (folder / "logs" / "train.log").is_file()
        assert f"lr = {found[number]['lr']!r}" in (folder / "snapshots" / "config.toml").read_text()
    assert (tmp_path / "sweeps" / "lr-sweep.db").is_file() and (study_dir(tmp_path) / "trials.png").is_file()
    # wandb: one run per trial (rank 0 only), grouped by the study, named after the trial
    runs = sorted((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 4, runs
    for number in found:
        run_id = json.loads((study_dir(tmp_path) / f"trial-{number}" / "snapshots" / "run.json").read_text())
        (record,) = [r for r in runs if r.name.endswith(run_id["run_id"])]
        data = next(record.glob("*.wandb")).read_bytes()  # the run's records: its name and group among them
        assert f"trial-{number}".encode() in data and b"lr-sweep" in data
    shown = run(sweep_cmd(tmp_path, space, "--show")).stdout
    assert "pruned" in shown and "complete" in shown


def test_a_study_killed_mid_trial_keeps_finished_trials_and_resumes_the_interrupted_one_bitwise(tmp_path):
    """The whole study SIGKILLed (driver, torchrun and ranks) in the middle of its second trial; started again, it
    does not rerun the first, and the second continues from its own snapshot to the weights of an uninterrupted run
    with the same settings."""
    args = [*TRIAL_ARGS[: TRIAL_ARGS.index("--max-steps")], "--max-steps", "40", "--snapshot-every", "5"]
    space = space_file(tmp_path, [1e-2, 2e-2], args=args, pruner="none")
    proc = start(sweep_cmd(tmp_path, space))
    second = study_dir(tmp_path) / "trial-1" / "logs" / "metrics.jsonl"

    def reached():
        lines = second.read_text().splitlines() if second.is_file() else []
        return any(json.loads(line)["step"] >= 15 for line in lines if line.endswith("}"))

    wait_for(reached, timeout=300, interval=0.01, what="step 15 of the second trial")
    os.killpg(proc.pid, signal.SIGKILL)  # every process of the study at once, as a lost machine
    finish(proc)
    wait_for(lambda: not processes_naming(str(tmp_path / "sweeps")), timeout=60, what="no process of the study left")
    first = trial_summary(tmp_path, 0)

    again = run(sweep_cmd(tmp_path, space), timeout=600).stdout
    assert trial_summary(tmp_path, 0) == first, "the finished trial ran again"
    rows = {row["trial"]: row for row in trials(tmp_path, space)}
    assert [row["state"] for row in rows.values()].count("complete") == 1, again[-3000:]
    resumed = trial_summary(tmp_path, 1)
    assert resumed["steps"] == 40 and resumed["resumed_from"] >= 10, resumed
    assert rows[1]["state"] == "interrupted" and rows[2]["state"] == "complete (continues 1)", rows
    # An uninterrupted run with the trial's settings ends with the same weights
    run(train_cmd(2) + args + ["--lr", "0.02"] + outputs(tmp_path, "reference"))
    interrupted = final_model(study_dir(tmp_path) / "trial-1" / "snapshots")
    assert_same_weights(final_model(tmp_path / "reference-snapshots")["model"], interrupted["model"])


def test_two_workers_of_one_study_share_its_trials(tmp_path):
    """Two workers started at once on one SQLite study run its two trials between them: none twice."""
    space = space_file(tmp_path, [1e-2, 2e-2], args=[*TRIAL_ARGS[:-4], "--max-steps", "10"], pruner="none")
    workers = [start(sweep_cmd(tmp_path, space)) for _ in range(2)]
    outs = [finish(worker, timeout=600) for worker in workers]
    assert [code for code, _ in outs] == [0, 0], [out[-2000:] for _, out in outs]
    rows = trials(tmp_path, space)
    assert sorted((row["trial"], row["state"]) for row in rows) == [(0, "complete"), (1, "complete")], rows
    for number in (0, 1):  # each trial ran once: one launch, one run in its metrics
        records = (study_dir(tmp_path) / f"trial-{number}" / "logs" / "metrics.jsonl").read_text().splitlines()
        assert len({json.loads(line)["run_id"] for line in records}) == 1
        assert trial_summary(tmp_path, number)["resumed_from"] == -1


@pytest.mark.parametrize(
    ("space", "named"),
    [
        ("[study]\nname='s'\ntrials=2\n[space]\nno_such_setting={ low=1, high=2 }\n", "no_such_setting"),
        ("[study]\nname='s'\ntrials=2\n[space]\nlr={ low=-1.0, high=0.1 }\n", "lr"),
        ("[study]\nname='s'\ntrials=2\n[space]\n", "[space]"),
        ("[study]\nname='s'\ntrials=2\nsampler='annealing'\n[space]\nlr={ choices=[0.1] }\n", "sampler"),
        ("[study]\nname='s'\ntrials=2\n[space]\nsnapshot_dir={ choices=['a', 'b'] }\n", "snapshot_dir"),
        ("[study]\nname='s'\ntrials=2\n[space]\nbatch_size={ low=1.5, high=8.0 }\n", "batch_size"),
        ("[study]\nname='s'\ntrials=2\nargs=['--max-steps', '-3']\n[space]\nlr={ choices=[0.1] }\n", "--max-steps"),
        ("[study]\nname='s s'\ntrials=2\n[space]\nlr={ choices=[0.1] }\n", "name"),
    ],
)
def test_a_bad_space_is_one_line_naming_what_is_wrong(tmp_path, space, named):
    path = tmp_path / "space.toml"
    path.write_text(space)
    with pytest.raises(RunError) as refused:
        read_space(path, tmp_path / "sweeps")
    assert named in str(refused.value) and "\n" not in str(refused.value)
    assert not (tmp_path / "sweeps").exists()  # refused before anything ran or was written


def test_wandb_sweep_config_starts_torchrun_with_the_runs_settings_in_a_folder_of_its_own(tmp_path):
    """scripts/wandb-sweep.yaml as `wandb agent` expands it (wandb's own functions): its command starts torchrun on
    train.py with the run's settings, which train.py accepts, and folders named after the agent's run id."""
    import subprocess

    import yaml
    from wandb.sdk.launch.sweeps import utils as sweep_utils

    spec = yaml.safe_load((ROOT / "scripts" / "wandb-sweep.yaml").read_text())
    chosen = {name: {"value": 0.001 if name == "lr" else 20} for name in spec["parameters"]}
    values = sweep_utils.create_sweep_command_args({"args": chosen})
    command = []
    for chunk in sweep_utils.create_sweep_command(list(spec["command"])):  # the agent's own expansion of ${...}
        chunk = str(chunk)
        command += values.get(chunk[2:-1], []) if chunk.startswith("${") else [chunk]
    # torchrun's place on PATH: a stand-in that writes down the command line it was given
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "torchrun").write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {tmp_path / "torchrun-args"}\n')
    (bin_dir / "torchrun").chmod(0o755)
    env = {**child_env(), "PATH": f"{bin_dir}:{os.environ['PATH']}", "WANDB_RUN_ID": "r1", "WANDB_SWEEP_ID": "s1"}
    subprocess.run(command, cwd=ROOT, env=env, check=True, timeout=60)
    args = (tmp_path / "torchrun-args").read_text().splitlines()
    assert "--standalone" in args and "train.py" in args, args
    from {{ cookiecutter.project_slug }} import config

    cfg = config.parse_args(args[args.index("train.py") + 1 :])
    assert cfg.lr == 0.001 and cfg.snapshot_dir.endswith("s1/r1/snapshots"), cfg
    assert all(getattr(cfg, name.replace("-", "_")) == value["value"] for name, value in chosen.items())
