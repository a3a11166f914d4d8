"""Sweeps: an Optuna study whose trials are full multi-rank runs of train.py (`python -m <package>.sweep SPACE.toml`).

Each trial is `torchrun --standalone` in a folder of its own, `sweeps/<study>/trial-<n>/` (snapshots, export,
metrics, config.toml, logs), with torchrun's restarts and the run's exactness. The study lives in a database (a
SQLite file by default, `sweeps/<study>.db`: nothing to start; any URL Optuna takes, for workers on several
machines). Rank 0 of a trial reports each value of the metric to the study and its pruner (trialreport.py); a pruned
trial stops on every rank with a snapshot. A study started again never reruns a finished trial: a trial whose worker
is gone (its process dead on this machine, or no heartbeat from another one) is taken over, once, by the next worker
that starts, and resumes from that trial's newest snapshot in the same folder.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import io
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from .identity import boot_id, process_alive, process_start
from .settings import RunError, flag, settings, short_repr
from .trialreport import METRIC, PRUNER, PRUNER_KEYS, STORAGE, STUDY, TRIAL, engine_options, make_pruner

PACKAGE = __name__.rsplit(".", 2)[0]
PROJECT_ROOT = Path(__file__).resolve().parents[2]  # train.py sits beside the package
STUDY_KEYS: dict[str, tuple[type, Any]] = {  # [study] of SPACE.toml: the key, its type and its default (None: required)
    "name": (str, None),
    "trials": (int, None),
    "metric": (str, "val_loss"),
    "direction": (str, "minimize"),
    "nproc_per_node": (int, 1),
    "max_restarts": (int, 0),
    "args": (list, []),
    "storage": (str, ""),
    "sampler": (str, "tpe"),
    "seed": (int, 0),
    "pruner": (str, "median"),
    "pruner_startup_trials": (int, 5),
    "pruner_warmup_steps": (int, 0),
    "max_failures": (int, 3),
    "heartbeat_s": (int, 30),
}
CHOICES = {"direction": ("minimize", "maximize"), "sampler": ("tpe", "random", "grid"), "pruner": ("median", "none")}
# Settings a sweep gives each trial itself: its folder's paths
OWN_SETTINGS = ("snapshot_dir", "export_dir", "metrics_file", "log_file", "resume", "resume_from")
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}")
# Attributes a trial keeps in the study: the worker running it (host, boot, pid, start time), the trial whose folder
# it continues (an interrupted one), what ended it
WORKER, CONTINUES, REPLACES, ERROR, STEPS = "worker", "continues", "replaces", "error", "steps"
READY = "ready"  # a study attribute: the worker that made the study has enqueued what it enqueues
INTERRUPTED = "interrupted: its worker stopped or was lost; the trial continues from its snapshot"


@dataclasses.dataclass
class Param:
    """One setting of the search space: a float or int range, or choices."""

    name: str
    low: Any = None
    high: Any = None
    log: bool = False
    step: Any = None
    choices: list[Any] | None = None

    def distribution(self) -> Any:
        import optuna.distributions as d

        if self.choices is not None:  # lists (a list setting's values) are kept as JSON text in the study
            return d.CategoricalDistribution([_encoded(c) for c in self.choices])
        if isinstance(self.low, int) and isinstance(self.high, int):
            return d.IntDistribution(self.low, self.high, log=self.log, step=self.step or 1)
        return d.FloatDistribution(float(self.low), float(self.high), log=self.log, step=self.step)

    def values(self) -> list[Any]:
        """The values the space may give this setting that config.py must accept: its bounds or its choices."""
        return list(self.choices) if self.choices is not None else [self.low, self.high]


@dataclasses.dataclass
class Space:
    """SPACE.toml: the study ([study]) and the settings it searches ([space])."""

    name: str
    trials: int
    metric: str
    direction: str
    nproc_per_node: int
    max_restarts: int
    args: list[str]
    storage: str
    sampler: str
    seed: int
    pruner: str
    pruner_startup_trials: int
    pruner_warmup_steps: int
    max_failures: int
    heartbeat_s: int
    params: dict[str, Param]
    root: Path  # the folder of the study's trials' folders (sweeps/<name>) and of its default database

    def storage_url(self) -> str:
        return self.storage or f"sqlite:///{self.root.parent / (self.name + '.db')}"

    def trial_folder(self, number: int) -> Path:
        return self.root / f"trial-{number}"


def _encoded(value: Any) -> Any:
    return json.dumps(value) if isinstance(value, (list, tuple)) else value


def _decoded(value: Any) -> Any:
    if isinstance(value, str) and value.startswith("["):
        with contextlib.suppress(ValueError):
            return json.loads(value)
    return value


def read_space(path: str | os.PathLike, base: str | os.PathLike = "sweeps", config_cls: Any = None) -> Space:
    """SPACE.toml, checked: an unknown key or setting, a value config.py would refuse, an empty space is a RunError
    naming it, before any trial runs."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    where = str(path)
    try:
        with open(path, "rb") as handle:
            text = tomllib.load(handle)
    except OSError as exc:
        raise RunError(f"{where}: cannot read it: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise RunError(f"{where}: not valid TOML: {exc}") from None
    unknown = sorted(set(text) - {"study", "space"})
    if unknown:
        raise RunError(f"{where}: unknown table(s) {', '.join(unknown)} (a space has [study] and [space])")
    study = text.get("study", {})
    values: dict[str, Any] = {}
    for key in study:
        if key not in STUDY_KEYS:
            raise RunError(f"{where}: [study] has no key {key!r} (keys: {', '.join(STUDY_KEYS)})")
    for key, (kind, default) in STUDY_KEYS.items():
        value = study.get(key, default)
        if value is None:
            raise RunError(f"{where}: [study] needs {key}")
        if kind is int and (not isinstance(value, int) or isinstance(value, bool)):
            raise RunError(f"{where}: [study] {key} = {short_repr(value)} is not an integer")
        if not isinstance(value, kind):
            raise RunError(f"{where}: [study] {key} = {short_repr(value)} is not a {kind.__name__}")
        if key in CHOICES and value not in CHOICES[key]:
            raise RunError(f"{where}: [study] {key} = {value!r}, not one of {', '.join(CHOICES[key])}")
        values[key] = value
    if not NAME.fullmatch(values["name"]):
        raise RunError(
            f"{where}: [study] name = {short_repr(values['name'])} must be 1 to 100 letters, digits, '_', '-' or '.' "
            "(it names the study's folder and database)"
        )
    for key in ("trials", "nproc_per_node", "max_failures", "heartbeat_s"):
        if values[key] < 1:
            raise RunError(f"{where}: [study] {key} = {values[key]} must be at least 1")
    for key in ("max_restarts", "pruner_startup_trials", "pruner_warmup_steps"):
        if values[key] < 0:
            raise RunError(f"{where}: [study] {key} = {values[key]} must be at least 0")
    values["args"] = [str(item) for item in values["args"]]
    space = text.get("space", {})
    if not isinstance(space, dict) or not space:
        example = "lr = " + "{ low = 1e-4, high = 1e-2, log = true }"
        raise RunError(f"{where}: [space] names no setting to search (e.g. {example})")
    params = {name: _param(where, name, spec) for name, spec in space.items()}
    result = Space(**values, params=params, root=Path(base).resolve() / values["name"])
    check_settings(result, where, config_cls)
    return result


def _param(where: str, name: str, spec: Any) -> Param:
    shown = f"{where}: [space] {name}"
    if not isinstance(spec, dict):
        forms = "{ low = ..., high = ... } or " + "{ choices = [...] }"
        raise RunError(f"{shown} = {short_repr(spec)}: give {forms}")
    keys = set(spec)
    if "choices" in keys:
        if keys != {"choices"}:
            raise RunError(f"{shown}: choices take no other key (found {', '.join(sorted(keys - {'choices'}))})")
        choices = spec["choices"]
        if not isinstance(choices, list) or not choices:
            raise RunError(f"{shown}: choices must be a non-empty list")
        return Param(name, choices=choices)
    if not {"low", "high"} <= keys or not keys <= {"low", "high", "log", "step"}:
        raise RunError(
            f"{shown}: a range has low and high (and optionally log, step); found {', '.join(sorted(keys)) or 'none'}"
        )
    low, high, log, step = spec["low"], spec["high"], spec.get("log", False), spec.get("step")
    numbers = [v for v in (low, high, step) if v is not None]
    if any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in numbers):
        raise RunError(f"{shown}: low, high and step must be numbers")
    if not all(math.isfinite(v) for v in numbers) or low > high:
        raise RunError(f"{shown}: low = {low} and high = {high} must be finite with low <= high")
    if not isinstance(log, bool) or (log and low <= 0):
        raise RunError(f"{shown}: log = true needs low > 0 (and log is true or false)")
    if log and step is not None:
        raise RunError(f"{shown}: log and step do not go together")
    return Param(name, low=low, high=high, log=log, step=step)


def check_settings(space: Space, where: str, config_cls: Any) -> None:
    """Every name of [space] is a setting of config.py, and config.py accepts the study's args with each bound or
    choice (what its own command line would say)."""
    if config_cls is None:
        config_cls = _project_config().Config
    known = {s.name: s for s in settings(config_cls)}
    for name, param in space.params.items():
        if name not in known:
            import difflib

            close = difflib.get_close_matches(name, known, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise RunError(f"{where}: [space] {name} is no setting of config.py{hint}")
        if name in OWN_SETTINGS:
            raise RunError(f"{where}: [space] {name}: each trial sets it to its own folder; it cannot be searched")
        setting = known[name]
        if param.choices is None and setting.container is None and setting.type not in (int, float):
            raise RunError(f"{where}: [space] {name} is a {setting.type.__name__} setting: give choices, not a range")
        if param.choices is None and setting.type is int and not isinstance(param.low, int):
            raise RunError(f"{where}: [space] {name} is an int setting: its low and high must be integers")
    taken = [a for a in space.args if a.startswith("--") and a[2:].split("=")[0].replace("-", "_") in OWN_SETTINGS]
    if taken:
        raise RunError(f"{where}: [study] args sets {taken[0]}: each trial sets it to its own folder")
    _parse(config_cls, space.args, f"{where}: [study] args")
    for name, param in space.params.items():
        for value in param.values():
            _parse(
                config_cls, [*space.args, *setting_args(name, value)], f"{where}: [space] {name} = {short_repr(value)}"
            )


def _parse(config_cls: Any, argv: list[str], what: str) -> Any:
    """config.py's parse of `argv`; its refusal (one line) as a RunError naming `what`."""
    config = _project_config()
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            return config.parse_args(argv, config_cls)
    except SystemExit:
        lines = [line for line in stderr.getvalue().splitlines() if line.strip()]
        reason = lines[-1].split("error: ", 1)[-1] if lines else "refused"
        raise RunError(f"{what}: {reason}") from None


def _project_config() -> Any:
    import importlib

    return importlib.import_module(f"{PACKAGE}.config")


def setting_args(name: str, value: Any) -> list[str]:
    """The command-line form of one setting's value (a list: its items after the flag; a bool: --x / --no-x)."""
    value = _decoded(value)
    if isinstance(value, bool):
        return [flag(name) if value else "--no-" + flag(name)[2:]]
    if isinstance(value, (list, tuple)):
        return [flag(name), *map(str, value)]
    return [flag(name), repr(value) if isinstance(value, float) else str(value)]


# -- the study ------------------------------------------------------------------------------------------------


def _optuna() -> Any:
    try:
        import optuna
    except ImportError:
        raise RunError("sweeps need optuna: pip install -e '.[sweep]'") from None
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    # The heartbeat (RDBStorage's, recorded by this worker while its trial's job runs) is marked experimental, and
    # meant for Study.optimize: both said once per call, about a choice made here on purpose
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used with Study.optimize")
    return optuna


def open_study(space: Space) -> Any:
    """The study of `space`, made by the first worker that starts (which also enqueues a grid's combinations, once);
    the others load it, and wait for the grid."""
    optuna = _optuna()
    url = space.storage_url()
    if url.startswith("sqlite:///"):
        Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    if space.sampler == "grid" and any(p.choices is None for p in space.params.values()):
        raise RunError("[study] sampler = 'grid' needs choices for every setting of [space]")
    if space.sampler == "tpe":
        sampler = optuna.samplers.TPESampler(seed=space.seed)
    else:  # grid: every combination is enqueued once (below); trials past them draw at random
        sampler = optuna.samplers.RandomSampler(seed=space.seed)
    pruner = make_pruner({key: getattr(space, key) for key in PRUNER_KEYS})
    options = {"sampler": sampler, "pruner": pruner, "study_name": space.name}
    for attempt in range(5):  # workers that start together on a new database: one makes its tables, the others wait
        try:
            storage = optuna.storages.RDBStorage(
                url,
                engine_kwargs=engine_options(url),
                heartbeat_interval=space.heartbeat_s,
                grace_period=3 * space.heartbeat_s,
                heartbeat_stale_trial_callback=_continue_later,  # a worker with no heartbeat: its trial continues
            )
            study = optuna.create_study(storage=storage, direction=space.direction, **options)
            break
        except optuna.exceptions.DuplicatedStudyError:
            study = optuna.load_study(storage=storage, **options)
            _wait_for_grid(study, space)
            return study
        except Exception:  # the database's tables made by another worker at this moment
            if attempt == 4:
                raise
            time.sleep(0.5 + attempt)
    if space.sampler == "grid":
        import itertools

        names = list(space.params)
        for values in itertools.product(*([_encoded(c) for c in space.params[n].choices or ()] for n in names)):
            study.enqueue_trial(dict(zip(names, values, strict=True)))
    study.set_user_attr(READY, True)
    return study


def _wait_for_grid(study: Any, space: Space) -> None:
    """A worker that did not make the study waits until the one that did has enqueued its grid (a trial asked for
    before that would draw at random)."""
    deadline = time.monotonic() + 120
    while not study.user_attrs.get(READY) and time.monotonic() < deadline:
        time.sleep(0.2)


def this_worker() -> dict[str, Any]:
    """This worker as a trial records it: its machine (host name and boot) and its process (pid and start)."""
    pid = os.getpid()
    return {"host": socket.gethostname(), "boot": boot_id(), "pid": pid, "started": process_start(pid)}


def _gone(worker: Any) -> bool:
    """Whether the worker that ran a trial is known dead: it ran on this machine (same boot), and its process is not
    there any more."""
    if not isinstance(worker, dict) or worker.get("host") != socket.gethostname() or worker.get("boot") != boot_id():
        return False  # another machine's: its heartbeat says when it is gone
    pid, started = worker.get("pid"), worker.get("started")
    return type(pid) is not int or not process_alive(pid, started if type(started) is int else None)


def take_over(study: Any) -> list[int]:
    """Trials whose worker is gone are marked failed, once, and each is enqueued again with its parameters to
    continue in its own folder; returns their numbers. Optuna's heartbeat finds those of workers on other machines."""
    optuna = _optuna()
    running = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))
    taken = [trial for trial in running if _gone(trial.user_attrs.get(WORKER))]
    storage = study._storage
    done = []
    for trial in taken:
        try:
            storage.set_trial_user_attr(trial._trial_id, ERROR, INTERRUPTED)
            if not storage.set_trial_state_values(trial._trial_id, state=optuna.trial.TrialState.FAIL):
                continue
        except optuna.exceptions.UpdateFinishedTrialError:  # another worker took it first
            continue
        _continue_later(study, trial)
        done.append(trial.number)
    stale = optuna.storages.fail_stale_trials  # no heartbeat from another machine's worker for 3 heartbeats
    with contextlib.suppress(Exception):
        stale(study)
    return done


def _continue_later(study: Any, trial: Any) -> None:
    """Enqueue a failed-over trial again, to continue in its folder (also optuna's callback for stale trials)."""
    folder = trial.user_attrs.get(CONTINUES, trial.number)
    with contextlib.suppress(Exception):  # a stale trial (optuna's callback) is failed already: mark it if it may be
        study._storage.set_trial_user_attr(trial._trial_id, ERROR, INTERRUPTED)
    study.enqueue_trial(trial.params, user_attrs={CONTINUES: folder, REPLACES: trial.number}, skip_if_exists=False)


def counted(study: Any) -> list[Any]:
    """The trials that count towards [study] trials: all but those that were interrupted and continue in another."""
    every = study.get_trials(deepcopy=False)
    return [t for t in every if t.number not in _replaced(every)]


def _replaced(trials: list[Any]) -> set[int]:
    """The numbers of the trials that were interrupted: another trial continues each in its folder."""
    return {t.user_attrs[REPLACES] for t in trials if REPLACES in t.user_attrs}


@contextlib.contextmanager
def _heartbeat(study: Any, trial: Any, every_s: float) -> Iterator[None]:
    """Tell the study this worker still runs `trial`, every `every_s` seconds, while the block runs."""
    done = threading.Event()

    def beat() -> None:
        while not done.is_set():
            with contextlib.suppress(Exception):
                study._storage.record_heartbeat(trial._trial_id)
            done.wait(every_s)

    thread = threading.Thread(target=beat, name="sweep-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def _die_with_parent() -> None:
    """In the child, before exec: the kernel sends it SIGTERM when this worker dies (a SIGKILLed sweep leaves no
    trial training on alone; torchrun passes it to its ranks, which stop with a snapshot)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def trial_command(space: Space, params: dict[str, Any], folder: Path) -> list[str]:
    args = list(space.args)
    for name in space.params:
        args += setting_args(name, params[name])
    args += [
        "--snapshot-dir", str(folder / "snapshots"),
        "--export-dir", str(folder / "export"),
        "--metrics-file", str(folder / "logs" / "metrics.jsonl"),
        "--log-file", str(folder / "logs" / "train.log"),
    ]  # fmt: skip
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc_per_node={space.nproc_per_node}", f"--max-restarts={space.max_restarts}",
        "--log-dir", str(folder / "logs" / "torchrun"),
        str(PROJECT_ROOT / "train.py"), *args,
    ]  # fmt: skip


def _error_line(folder: Path, code: int) -> str:
    """The trial's failure in one line: the rank that failed first's own line (torchrun's error files)."""
    found = []
    for path in (folder / "logs" / "torchrun").glob("**/error.json"):
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            message = json.loads(path.read_text())["message"]
            extra = message.get("extraInfo", {}) if isinstance(message, dict) else {}
            text = message.get("message", "") if isinstance(message, dict) else str(message)
            found.append((bool(extra.get("peer")), int(extra.get("timestamp", 0)), path.stat().st_mtime, text))
    if found:
        return " ".join(sorted(found)[0][3].split())[:500]
    return f"the trial's job exited with code {code} (its output: {folder / 'logs' / 'console.log'})"


def _last_value(metrics_file: Path, metric: str) -> tuple[float | None, int]:
    """The newest value of `metric` in a run's metrics file, and the newest step."""
    from .plot import read_metrics

    if not metrics_file.is_file():
        return None, 0
    records = read_metrics(metrics_file)
    values = [r[metric] for r in records if isinstance(r.get(metric), (int, float))]
    return (float(values[-1]) if values else None), (records[-1]["step"] if records else 0)


class Interrupted(Exception):
    """The sweep was asked to stop (Ctrl-C, SIGTERM) while a trial ran: the trial stopped with a snapshot."""


def run_trial(study: Any, space: Space, trial: Any, say: Any) -> None:
    """Run one trial to its end and tell the study how it ended."""
    optuna = _optuna()
    number = int(trial.user_attrs.get(CONTINUES, trial.number))
    folder = space.trial_folder(number)
    (folder / "logs").mkdir(parents=True, exist_ok=True)
    params = {name: trial.params[name] for name in space.params}
    env = {
        **os.environ,
        STORAGE: space.storage_url(),
        STUDY: space.name,
        TRIAL: str(trial._trial_id),
        METRIC: space.metric,
        PRUNER: json.dumps({key: getattr(space, key) for key in PRUNER_KEYS}),
        "WANDB_RUN_GROUP": space.name,  # wandb (rank 0 only): one run per trial, grouped by study
        "WANDB_NAME": f"trial-{number}",
    }
    shown = " ".join(f"{flag(n)} {_decoded(v)}" for n, v in params.items())
    again = f" (continues trial {number} from its snapshot)" if number != trial.number else ""
    say(f"trial {trial.number}: {shown}{again}")
    with open(folder / "logs" / "console.log", "ab") as output, _heartbeat(study, trial, space.heartbeat_s):
        job = subprocess.Popen(
            trial_command(space, params, folder),
            cwd=PROJECT_ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=subprocess.STDOUT,
            preexec_fn=_die_with_parent,
        )
        with _passed_on(job):
            code = job.wait()
    if code in (128 + signal.SIGTERM, 128 + signal.SIGINT, -signal.SIGTERM, -signal.SIGINT) and _asked_to_stop:
        raise Interrupted
    summary_path = folder / "export" / "summary.json"
    summary = json.loads(summary_path.read_text()) if code == 0 and summary_path.is_file() else {}
    value, step = _last_value(folder / "logs" / "metrics.jsonl", space.metric)
    study._storage.set_trial_user_attr(trial._trial_id, STEPS, int(summary.get("steps", step)))
    if code == 0 and summary.get("pruned"):
        study.tell(trial, state=optuna.trial.TrialState.PRUNED)
        say(f"trial {trial.number}: pruned at step {summary.get('steps')} ({space.metric} {value})")
    elif code == 0 and value is not None:
        study.tell(trial, value)
        say(f"trial {trial.number}: {space.metric} {value:.6g} after {summary.get('steps', step)} steps")
    else:
        line = _error_line(folder, code) if code else f"the run logged no {space.metric} (set [study] metric)"
        study._storage.set_trial_user_attr(trial._trial_id, ERROR, line)
        study.tell(trial, state=optuna.trial.TrialState.FAIL)
        say(f"trial {trial.number}: failed: {line}")


_asked_to_stop = 0  # the signal that asked this worker to stop, 0 while none did


@contextlib.contextmanager
def _passed_on(job: subprocess.Popen) -> Iterator[None]:
    """SIGTERM and Ctrl-C reach the trial's job (which stops with a snapshot); the worker stops after it."""

    def handle(signum: int, frame: Any) -> None:
        global _asked_to_stop
        _asked_to_stop = signum
        with contextlib.suppress(OSError):
            job.send_signal(signal.SIGTERM)

    previous = {s: signal.signal(s, handle) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def run_study(space: Space, say: Any = print) -> Any:
    """Run trials until the study has [study] trials (those of every worker, earlier starts included)."""
    optuna = _optuna()
    study = open_study(space)
    for number in take_over(study):
        say(f"trial {number} was interrupted: it continues from its snapshot")
    failures: list[str] = []
    waiting = (optuna.trial.TrialState.WAITING,)
    while True:  # trials enqueued to continue an interrupted one run first, even when the count is reached
        if len(counted(study)) >= space.trials and not study.get_trials(deepcopy=False, states=waiting):
            break
        trial = study.ask({name: p.distribution() for name, p in space.params.items()})
        study._storage.set_trial_user_attr(trial._trial_id, WORKER, this_worker())
        run_trial(study, space, trial, say)
        ended = study._storage.get_trial(trial._trial_id)
        if ended.state == optuna.trial.TrialState.FAIL:
            failures.append(f"trial {trial.number}: {ended.user_attrs.get(ERROR)}")
            if len(failures) >= space.max_failures:
                raise RunError(
                    f"{len(failures)} trials failed in a row, the study stops ([study] max_failures):\n  "
                    + "\n  ".join(failures)
                )
        else:
            failures = []
    return study


# -- what a study shows -------------------------------------------------------------------------------------


def rows(study: Any, space: Space) -> list[dict[str, Any]]:
    """One row per trial: number, state, objective, steps, wall time, parameters."""
    found = []
    every = study.get_trials(deepcopy=False)
    replaced = _replaced(every)
    for trial in every:
        state = trial.state.name.lower()
        if trial.number in replaced:
            state = "interrupted"
        elif state == "fail":
            state = "failed"
        elif trial.user_attrs.get(CONTINUES, trial.number) != trial.number:
            state += f" (continues {trial.user_attrs[CONTINUES]})"
        value = trial.value if trial.value is not None else None
        if value is None and trial.intermediate_values:
            value = trial.intermediate_values[max(trial.intermediate_values)]
        end = trial.datetime_complete
        wall = (end - trial.datetime_start).total_seconds() if end and trial.datetime_start else None
        found.append(
            {
                "trial": trial.number,
                "state": state,
                space.metric: value,
                "steps": trial.user_attrs.get(STEPS),
                "wall_s": wall,
                **{name: _decoded(trial.params.get(name)) for name in space.params},
                "error": trial.user_attrs.get(ERROR, "") if state == "failed" else "",
            }
        )
    return found


def table(study: Any, space: Space) -> str:
    found = rows(study, space)
    columns = ["trial", "state", space.metric, "steps", "wall_s", *space.params]

    def cell(value: Any) -> str:
        if value is None:
            return "-"
        if isinstance(value, float):
            return f"{value:.4g}"
        return str(value)

    lines = [[cell(row[c]) for c in columns] for row in found]
    widths = [max(len(c), *(len(line[i]) for line in lines)) if lines else len(c) for i, c in enumerate(columns)]
    text = ["  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True))]
    text += ["  ".join(v.ljust(w) for v, w in zip(line, widths, strict=True)) for line in lines]
    text += [f"  trial {row['trial']}: {row['error']}" for row in found if row["error"]]
    best = _best(study)
    if best is not None:
        text.append(
            f"best: trial {best.number}, {space.metric} {best.value:.6g}, "
            + " ".join(f"{flag(n)} {_decoded(v)}" for n, v in best.params.items())
        )
    return "\n".join(text)


def _best(study: Any) -> Any:
    with contextlib.suppress(ValueError):
        return study.best_trial
    return None


def draw(study: Any, space: Space, path: Path) -> Path | None:
    """sweeps/<study>/trials.png: the objective per trial with the best so far, and each setting against it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    found = [r for r in rows(study, space) if isinstance(r[space.metric], (int, float))]
    names = list(space.params)
    figure, axes = plt.subplots(1, 1 + len(names), figsize=(4.5 * (1 + len(names)), 3.6), squeeze=False)
    first = axes[0][0]
    pick = min if space.direction == "minimize" else max
    best, best_so_far = None, []
    for row in found:
        if row["state"].startswith("complete"):
            best = row[space.metric] if best is None else pick(best, row[space.metric])
        best_so_far.append(best)
    for state, marker in (("complete", "o"), ("pruned", "x")):
        picked = [r for r in found if r["state"].startswith(state)]
        first.scatter([r["trial"] for r in picked], [r[space.metric] for r in picked], marker=marker, label=state)
    first.step([r["trial"] for r in found], best_so_far, where="post", label="best so far")
    first.set_xlabel("trial")
    first.set_ylabel(space.metric)
    first.legend(fontsize="small")
    for axis, name in zip(axes[0][1:], names, strict=True):
        points = [(r[name], r[space.metric]) for r in found if isinstance(r[name], (int, float))]
        if points:
            axis.scatter(*zip(*points, strict=True))
        else:  # choices that are not numbers: one column per choice
            labels = [str(r[name]) for r in found]
            axis.scatter(labels, [r[space.metric] for r in found])
        if space.params[name].log:
            axis.set_xscale("log")
        axis.set_xlabel(name)
    figure.suptitle(f"study {space.name}")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=90)
    plt.close(figure)
    return path


def show(space: Space, say: Any = print) -> Any:
    """The trials table on the console and sweeps/<study>/trials.png."""
    optuna = _optuna()
    try:
        study = optuna.load_study(study_name=space.name, storage=space.storage_url())
    except KeyError:
        raise RunError(f"no study {space.name!r} in {space.storage_url()} yet: run the sweep first") from None
    say(table(study, space))
    picture = draw(study, space, space.root / "trials.png")
    if picture:
        say(f"picture: {picture}")
    return study


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog=f"python -m {PACKAGE}.sweep",
        description="Run (or show) an Optuna study whose trials are multi-rank runs of train.py.",
    )
    parser.add_argument("space", help="SPACE.toml: [study] and [space] (docs/recipes.md, Sweeps)")
    parser.add_argument("--show", action="store_true", help="print the trials table and draw trials.png, run nothing")
    parser.add_argument("--storage", default="", help="the study's database URL (overrides [study] storage)")
    parser.add_argument("--dir", default="sweeps", help="folder of the studies' folders and SQLite files")
    options = parser.parse_args(argv)
    try:
        space = read_space(options.space, options.dir)
        if options.storage:
            space = dataclasses.replace(space, storage=options.storage)
        if options.show:
            show(space)
            return 0
        print(
            f"study {space.name}: {space.trials} trials of {space.nproc_per_node} rank(s), {space.metric} "
            f"({space.direction}), in {space.root}; storage {space.storage_url()}",
            flush=True,
        )
        study = run_study(space, lambda line: print(line, flush=True))
        print(table(study, space), flush=True)
        picture = draw(study, space, space.root / "trials.png")
        if picture:
            print(f"picture: {picture}", flush=True)
        return 0
    except RunError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except Interrupted:
        print(
            "the sweep stopped; its trial stopped with a snapshot: run the same command again to go on", file=sys.stderr
        )
        return 128 + (_asked_to_stop or signal.SIGTERM)
