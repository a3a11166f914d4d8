"""The GPU check's benchmark and its one summary table: the baked train.py against a bare DDP loop on one GPU.

Run by scripts/gpu-check.sh (its run half), which hands it the results of the install and of `pytest -m gpu`:

  overhead   steady-state optimizer steps/s and launch-to-first-step of bench/bare_ddp_cuda.py (A) and the baked
             train.py (B): 1 rank, nccl, the same model, data, batch and optimizer, alternating A B A B; medians.
             Both read the loss every 10 steps; the baked run evaluates and saves only after its last step.
  snapshot   the time the training thread spends in Snapshots.save() and fence() for a model of about 100M
             parameters whose weights and AdamW state live on the GPU, against a torch.save of the same state on
             the training thread (what a plain loop does); and the GPU time of a step taken while a save copies.

The overhead runs are timed by bench/probe.py, as in the CPU benchmark. The table goes to stdout and to
<out>/summary.md, the raw numbers to <out>/gpu-bench.json. With --device cpu --quick the same code runs on CPU with
tiny sizes: a test of the plumbing, not a result.
"""

import argparse
import importlib
import json
import re
import shutil
import sys
import time
import traceback
import xml.etree.ElementTree as ET
from pathlib import Path

import torch
from common import BENCH, Run, machine, median, steps_per_second

BARE = BENCH / "bare_ddp_cuda.py"
SIZES = {  # the demo's own flags: this benchmark measures the template's demo
    "full": {
        "overhead": ["--width", "4096", "--depth", "4", "--batch-size", "256", "--dataset-size", "65536"],
        "snapshot": ["--width", "4096", "--depth", "7", "--batch-size", "32"],
        "pairs": 3,
        "steps": 300,
        "warmup": 20,
        "reps": 3,
    },
    "quick": {
        "overhead": ["--width", "64", "--depth", "2", "--batch-size", "32", "--dataset-size", "2048"],
        "snapshot": ["--width", "256", "--depth", "2", "--batch-size", "32", "--dataset-size", "256"],
        "pairs": 1,
        "steps": 30,
        "warmup": 5,
        "reps": 1,
    },
}
RUN_TIMEOUT_S = 240  # one training run of the overhead section


class Budget:
    """The time left to this benchmark, so that the GPU half ends when promised."""

    def __init__(self, deadline):
        self.deadline = deadline

    def left(self):
        return self.deadline - time.time() if self.deadline else float("inf")


def section_overhead(project, package, device, work, size, budget, log):
    """Steady-state steps/s and launch-to-first-step, bare (A) and baked (B), alternating."""
    runs = {"bare": [], "baked": []}
    flags, steps = size["overhead"], size["steps"]
    backend = "nccl" if device == "cuda" else "gloo"
    for pair in range(size["pairs"]):
        if pair and budget.left() < 90:
            log(f"  stopping after {pair} pair(s): the time budget is nearly spent")
            break
        for kind in ("bare", "baked"):
            folder = work / f"overhead-{pair}-{kind}"
            if kind == "bare":
                run = Run(
                    BARE,
                    ["--project", project, "--package", package, "--device", device, "--max-steps", steps, *flags],
                    1,
                    folder,
                )
            else:
                run = Run(
                    project / "train.py",
                    [
                        *flags,
                        "--max-steps",
                        steps,
                        "--snapshot-every",
                        steps + 1,
                        "--eval-every",
                        0,
                        "--wandb",
                        "disabled",
                        "--backend",
                        backend,
                    ],
                    1,
                    folder,
                )
            code = run.wait(timeout=max(30.0, min(RUN_TIMEOUT_S, budget.left())))
            if code != 0:
                raise RuntimeError(f"the {kind} run exited {code}:\n{run.text()[-3000:]}")
            result = {
                "launch_to_first_step_s": run.first_step() - run.launched,
                "steps_per_s": steps_per_second(run.step_times(), size["warmup"]),
            }
            runs[kind].append(result)
            log(
                f"  {kind:5s} {result['steps_per_s']:8.2f} steps/s, first step "
                f"{result['launch_to_first_step_s']:.2f} s after launch"
            )
    return runs


def section_snapshot(project, package, device, work, size, log):
    """The training thread's stall per snapshot of a model on `device`: background save vs torch.save."""
    sys.path.insert(0, str(project))
    config = importlib.import_module(f"{package}.config")
    data = importlib.import_module(f"{package}.data")
    model_module = importlib.import_module(f"{package}.model")
    snapshot = importlib.import_module(f"{package}.machinery.snapshot")
    distributed = importlib.import_module(f"{package}.machinery.distributed")
    from torch.utils.data import default_collate

    device = torch.device(device, 0) if device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    cfg = config.parse_args([*size["snapshot"], "--wandb", "disabled"])
    torch.manual_seed(cfg.seed)
    train_data, _ = data.build_datasets(cfg)
    model = model_module.build_model(cfg, train_data).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=cfg.weight_decay)
    inputs, targets = default_collate([train_data[index] for index in range(cfg.batch_size)])
    inputs, targets = inputs.to(device), targets.to(device)
    parameters = sum(p.numel() for p in model.parameters())
    step = [0]

    def settle():  # an empty queue, so that each timing starts from an idle GPU
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def forward_backward():
        model_module.loss_fn(model(inputs), targets).backward()

    def optimizer_step():
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step[0] += 1

    def state():  # what the baked trainer's Checkpointer.save() gathers
        return {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scaler": {},
            "step": step[0],
            "progress": {"step": step[0]},
            "config": cfg.to_dict(),
            "run_id": "bench",
            "torch_version": str(torch.__version__),
        }

    def timed_step(save=False):
        """Seconds from the start of a step to its end on the device, with a background save in it or not."""
        settle()
        start = time.perf_counter()
        if save:
            snapshots.save(step[0], state(), {"rng": snapshot.capture_rng()})
        called = time.perf_counter()
        forward_backward()
        fenced = time.perf_counter()
        if save:
            snapshots.wait_until_copied()
        waited = time.perf_counter()
        optimizer_step()
        settle()
        return time.perf_counter() - start, (called - start) + (waited - fenced)

    folder = work / "snapshot"
    snapshots = snapshot.Snapshots(str(folder / "snapshots"), distributed.DistEnv(device=device), keep=2)
    state_bytes = 3 * sum(p.numel() * p.element_size() for p in model.parameters())
    snapshots.prepare(state_bytes)
    result = {
        "parameters": parameters,
        "state_bytes": state_bytes,
        "device": str(device),
        "sync_save_s": [],
        "async_blocked_s": [],
        "plain_step_s": [],
        "saving_step_s": [],
        "async_background_s": [],
    }
    try:
        for _ in range(3):  # AdamW's state exists after the first step; the rest warms the allocator
            timed_step()
        started = time.perf_counter()
        snapshots.save(step[0], state(), {"rng": snapshot.capture_rng()})  # allocates the pinned buffers
        snapshots.wait()
        result["first_save_s"] = time.perf_counter() - started
        for rep in range(size["reps"]):
            result["plain_step_s"].append(timed_step()[0])
            path = folder / f"sync-{rep}.pt"
            settle()
            started = time.perf_counter()
            with open(path, "wb") as handle:
                torch.save(state(), handle)  # copies every GPU tensor to the host first, on this thread
            result["sync_save_s"].append(time.perf_counter() - started)
            path.unlink()
            started = time.perf_counter()
            seconds, blocked = timed_step(save=True)
            snapshots.wait()
            result["saving_step_s"].append(seconds)
            result["async_blocked_s"].append(blocked)
            result["async_background_s"].append(time.perf_counter() - started)
            log(
                f"  rep {rep}: torch.save {result['sync_save_s'][-1]:.3f} s, background save stalls "
                f"{blocked:.4f} s, step {result['plain_step_s'][-1] * 1e3:.1f} ms plain / {seconds * 1e3:.1f} ms "
                f"with a save"
            )
    finally:
        snapshots.close()
        shutil.rmtree(folder, ignore_errors=True)
    return result


# ---- the summary ------------------------------------------------------------------------------------------------


def pytest_outcome(xml_path, exit_code):
    """(what pytest -m gpu reported, in a few words; whether it passed)."""
    if exit_code == 124:
        return "timed out", False
    try:
        root = ET.parse(xml_path).getroot()
    except (OSError, ET.ParseError):
        return f"no report (pytest exited {exit_code})", False
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    count = {key: sum(int(suite.get(key, 0)) for suite in suites) for key in ("tests", "failures", "errors", "skipped")}
    seconds = sum(float(suite.get("time", 0)) for suite in suites)
    passed = count["tests"] - count["failures"] - count["errors"] - count["skipped"]
    words = f"{passed} passed, {count['skipped']} skipped"
    if count["failures"] or count["errors"]:
        words += f", {count['failures'] + count['errors']} FAILED"
    return f"{words} in {seconds:.0f} s", exit_code == 0


def torch_floor(project):
    """(the torch>= floor the project declares, whether this torch meets it)."""
    match = re.search(r'"torch>=([0-9.]+)"', (project / "pyproject.toml").read_text())
    if not match:
        return "none declared", True
    version = tuple(int(part) for part in re.findall(r"\d+", torch.__version__.split("+")[0])[:3])
    floor = tuple(int(part) for part in match.group(1).split("."))
    return f">={match.group(1)}", version >= floor


def rows_of(results):
    """The table's rows: (check, A, B, B/A, note)."""
    rows = []
    floor, meets = torch_floor(results["project"])
    install = results["install"]
    rows.append(
        (
            "install from the prepared folder, no network",
            "",
            "ok" if install == "ok" else "FAILED",
            "",
            f"torch {torch.__version__} against the declared torch{floor}: {'met' if meets else 'NOT met'}",
        )
    )
    words, _ = results["tests"]
    rows.append(("pytest -m gpu", "", words, "", f"{torch.cuda.device_count()} GPU(s) visible"))
    overhead = results.get("overhead")
    if isinstance(overhead, dict):
        pairs = len(overhead["bare"])
        for label, key, unit in (
            ("steady-state steps/s: bare loop (A), baked train.py (B)", "steps_per_s", ""),
            ("launch to first optimizer step", "launch_to_first_step_s", " s"),
        ):
            a, b = median([r[key] for r in overhead["bare"]]), median([r[key] for r in overhead["baked"]])
            rows.append(
                (
                    label,
                    f"{a:.2f}{unit}",
                    f"{b:.2f}{unit}",
                    f"{b / a:.3f}",
                    f"median of {pairs} alternating pair(s), 1 rank",
                )
            )
    elif overhead:
        rows.append(("steps/s, bare loop vs baked train.py", "", overhead, "", ""))
    snap = results.get("snapshot")
    if isinstance(snap, dict):
        sync, stall = median(snap["sync_save_s"]), median(snap["async_blocked_s"])
        rows.append(
            (
                "training-thread stall per snapshot: torch.save (A), background save (B)",
                f"{sync:.3f} s",
                f"{stall:.4f} s",
                f"{stall / sync:.4f}",
                f"{_millions(snap['parameters'])} parameters and AdamW state on {snap['device']}; the first "
                f"save, which allocates its buffers, {snap['first_save_s']:.2f} s",
            )
        )
        plain, saving = median(snap["plain_step_s"]), median(snap["saving_step_s"])
        rows.append(
            (
                "one step, to its end on the device: plain (A), with a save (B)",
                f"{plain * 1e3:.1f} ms",
                f"{saving * 1e3:.1f} ms",
                f"{saving / plain:.2f}",
                "B holds the save's copies, which the step's optimizer waits for on the device",
            )
        )
    elif snap:
        rows.append(("snapshot stall", "", snap, "", ""))
    if results.get("started"):
        spent = time.time() - results["started"]
        rows.append(("wall time of this half", "", f"{spent:.0f} s", "", f"limit {results['limit_s']:.0f} s"))
    return rows


def _millions(count):
    return f"{count / 1e6:.0f}M" if count >= 1e6 else f"{count / 1e6:.2f}M"


def table(results, info):
    title = (
        f"GPU check on {info['gpu']}"
        if results["device"] == "cuda"
        else "GPU check, DRY RUN ON CPU: the plumbing only, no GPU result"
    )
    lines = [
        f"### {title}",
        "",
        f"torch {info['torch']} (CUDA {info['cuda'] or 'none'}), Python {info['python']}, {info['cpu']}, "
        f"{info['nproc']} cores, {info['date']}",
        "",
        "| check | A | B | B/A | note |",
        "|---|---|---|---|---|",
    ]
    lines += ["| " + " | ".join(cell.replace("|", "/") for cell in row) + " |" for row in rows_of(results)]
    return "\n".join(lines) + "\n"


def gpu_info():
    info = machine()
    info["cuda"] = torch.version.cuda
    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(index) for index in range(torch.cuda.device_count())]
        info["gpu"] = f"{len(names)} x {names[0]}" if len(set(names)) == 1 else ", ".join(names)
    else:
        info["gpu"] = "no GPU"
    return info


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--project", required=True, help="the baked project folder")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--quick", action="store_true", help="tiny sizes and one pair: to try the plumbing")
    parser.add_argument("--out", required=True, help="folder for summary.md and gpu-bench.json")
    parser.add_argument("--tests-xml", default="", help="the JUnit XML report of pytest -m gpu")
    parser.add_argument("--tests-exit", type=int, default=0, help="pytest's exit code")
    parser.add_argument("--install", default="ok", help="'ok' when the project installed from the prepared folder")
    parser.add_argument("--started", type=float, default=0.0, help="when the run half started (seconds since epoch)")
    parser.add_argument("--limit", type=float, default=480.0, help="seconds the run half may take")
    args = parser.parse_args()

    project = Path(args.project).resolve()
    package = next(path.name for path in sorted(project.iterdir()) if (path / "model.py").exists())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = out / "bench-work"
    work.mkdir(exist_ok=True)
    size = SIZES["quick" if args.quick else "full"]
    budget = Budget(args.started + args.limit - 15 if args.started else 0)

    def log(text):
        print(text, flush=True)

    results = {
        "project": project,
        "device": args.device,
        "install": args.install,
        "started": args.started,
        "limit_s": args.limit,
        "tests": pytest_outcome(args.tests_xml, args.tests_exit),
    }
    failed = args.install != "ok" or not results["tests"][1]
    sections = (
        ("overhead", lambda: section_overhead(project, package, args.device, work, size, budget, log)),
        ("snapshot", lambda: section_snapshot(project, package, args.device, work, size, log)),
    )
    for name, section in sections:
        if budget.left() < (10 if args.quick else 60):
            results[name] = "not run: the time budget is spent"
            failed = True
            continue
        log(f"{name}:")
        try:
            results[name] = section()
        except Exception as exc:  # one failed section still leaves the table with the others
            traceback.print_exc()
            results[name] = f"FAILED: {str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__}"
            failed = True
    shutil.rmtree(work, ignore_errors=True)

    info = gpu_info()
    text = table(results, info)
    (out / "summary.md").write_text(text)
    raw = {key: value for key, value in results.items() if key != "project"}
    (out / "gpu-bench.json").write_text(json.dumps({"machine": info, "results": raw}, indent=1, default=str))
    print("\n" + text, flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
