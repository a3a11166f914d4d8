"""Memory per rank when a run starts from pretrained weights, --strategy ddp and fsdp, 2 CPU ranks (gloo).

    python bench/pretrained_memory.py [--project /path/to/baked_project] [--out bench/PRETRAINED.md]

A transformers GPT-2 of about 310 MiB (float32, built from a config and written with save_pretrained, offline) is
trained for one step by the baked train.py under torchrun, through a small wrapper, four ways:
  weights          build_model builds it from its config, pretrained_weights(cfg) names the folder (rank 0 reads it)
  tiny             the same, with a GPT-2 of 27 thousand parameters: what every rank pays anyway (interpreter,
                   torch, transformers, process group, trainer)
  from_pretrained  build_model calls from_pretrained itself on every rank, no pretrained_weights
  config           build_model builds it from its config, no weights at all: what the model itself costs
The wrapper reads /proc/self/status (VmHWM, the peak resident memory so far; VmRSS, RssAnon, RssFile now) at the
first training forward (entry to compute_loss: everything start-up did), before optimizer step 1 (after the first
backward: gradients too) and after it (the optimizer's state too), then both ranks exit: nothing after the first
step is measured.
"""

import argparse
import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

from common import TOKEN_DATA, CpuMeter, load, machine, project_in, scratch_folder

ARCH = {"n_embd": 768, "n_layer": 6, "n_head": 12, "n_positions": 256, "vocab_size": 50257}
TINY = {"n_embd": 32, "n_layer": 1, "n_head": 2, "n_positions": 256, "vocab_size": 128}
CASES = ("tiny", "weights", "from_pretrained", "config")
POINTS = ("first_forward", "before_step", "after_step")

MODEL = """
import os

from transformers import GPT2Config, GPT2LMHeadModel

FOLDER, HOW = os.environ["BENCH_MODEL"], os.environ["BENCH_HOW"]


def build_model(cfg, train_dataset):
    if HOW == "from_pretrained":
        return GPT2LMHeadModel.from_pretrained(FOLDER)
    return GPT2LMHeadModel(GPT2Config.from_pretrained(FOLDER))


if HOW == "weights":

    def pretrained_weights(cfg):
        return FOLDER


def compute_loss(model, batch):
    return model(**batch).loss
"""

WRAPPER = """
import json, os, sys, time
import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
import train
from {package} import model as user_model
from {package}.machinery import pretrained

points = {{}}

def mark(name):
    fields = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines() if ":" in line)
    mib = lambda key: int(fields[key].split()[0]) / 1024
    points[name] = {{"time": time.time(), "hwm": mib("VmHWM"), "rss": mib("VmRSS"), "anon": mib("RssAnon"),
                    "file": mib("RssFile")}}

def around(module, name):
    original = getattr(module, name)
    def marked(*args, **kwargs):
        mark(name + "_start")
        result = original(*args, **kwargs)
        mark(name + "_end")
        return result
    setattr(module, name, marked)

mark("imported")
around(pretrained, "build_model")
around(pretrained, "load")
user_compute_loss = user_model.compute_loss
def compute_loss(model, batch):
    if model.training and "first_forward" not in points:
        mark("first_forward")
    return user_compute_loss(model, batch)
user_model.compute_loss = compute_loss

def before(optimizer, args, kwargs):
    if "before_step" not in points:
        mark("before_step")

def after(optimizer, args, kwargs):
    mark("after_step")
    rank = int(os.environ["RANK"])
    with open(os.path.join(os.environ["MEMORY_OUT"], f"rank{{rank}}.json"), "w") as handle:
        json.dump({{"rank": rank, "points": points}}, handle)
    dist.barrier()
    os._exit(0)  # one step is all this measures: no final snapshot, no export

register_optimizer_step_pre_hook(before)
register_optimizer_step_post_hook(after)
train.main(sys.argv[1:])
raise SystemExit("the run ended before its first optimizer step")
"""


def save_models(folder):
    """The two GPT-2s, built from their configs (random weights) and written with save_pretrained."""
    script = (
        "import sys, torch\n"
        "from transformers import GPT2Config, GPT2LMHeadModel\n"
        "torch.manual_seed(0)\n"
        f"GPT2LMHeadModel(GPT2Config(**{ARCH!r})).save_pretrained(sys.argv[1] + '/gpt2')\n"
        f"GPT2LMHeadModel(GPT2Config(**{TINY!r})).save_pretrained(sys.argv[1] + '/tiny')\n"
    )
    subprocess.run([sys.executable, "-c", script, str(folder)], check=True, capture_output=True)
    return folder / "gpt2", folder / "tiny"


def tensor_bytes(file):
    """The bytes of the tensors in a .safetensors file, from its header (the tied output layer is stored once)."""
    with open(file, "rb") as handle:
        header = json.loads(handle.read(struct.unpack("<Q", handle.read(8))[0]))
    return sum(
        entry["data_offsets"][1] - entry["data_offsets"][0] for key, entry in header.items() if key != "__metadata__"
    )


def torchrun(script, args, cwd, env, out):
    """Two ranks of `script`; the launch time and each rank's record."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", script, *args]
    launched = time.time()
    result = subprocess.run(
        cmd, cwd=cwd, env={**env, "MEMORY_OUT": str(out)}, capture_output=True, text=True, timeout=900
    )
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return launched, [json.loads(path.read_text()) for path in sorted(out.glob("rank*.json"))]


def summarize(strategy, case, launched, ranks, base, weight_mib):
    """One record per rank: each point's peak, above the tiny run's peak at that point, and that / the weights."""
    rows = []
    for record in ranks:
        points, rank = record["points"], record["rank"]
        row = {"strategy": strategy, "case": case, "rank": rank}
        for point in POINTS:
            peak = points[point]["hwm"]
            above = peak - base[rank][point]["hwm"] if base else 0.0
            row[point] = {"peak_mib": round(peak, 1), "above_mib": round(above, 1), "x": round(above / weight_mib, 2)}
        first = points["first_forward"]
        row["at_first_forward"] = {k: round(first[k], 1) for k in ("rss", "anon", "file")}
        row["launch_to_first_forward_s"] = round(first["time"] - launched, 2)
        row["launch_to_step_end_s"] = round(points["after_step"]["time"] - launched, 2)
        for phase in ("build_model", "load"):
            if f"{phase}_start" in points:
                start, end = points[f"{phase}_start"], points[f"{phase}_end"]
                row[f"{phase}_s"] = round(end["time"] - start["time"], 2)
                row[f"{phase}_peak_mib"] = round(end["hwm"], 1)
        rows.append(row)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--project", default="", help="copy this baked project instead of baking one")
    parser.add_argument("--strategies", default="ddp,fsdp")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--keep", action="store_true", help="keep the scratch folder")
    parser.add_argument(
        "--update", action="store_true", help="replace only the cases measured now in --out's .json, keep the others"
    )
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "PRETRAINED.md"))
    args = parser.parse_args()

    info = machine()
    info["load_before"] = load()[0]
    meter = CpuMeter()
    with scratch_folder("pretrained-memory-", args.keep) as work:
        project, package = project_in(work, args.project)
        (project / package / "data.py").write_text(TOKEN_DATA)
        (project / package / "model.py").write_text(MODEL)
        (work / "measure.py").write_text(WRAPPER.format(package=package))
        big, tiny = save_models(work / "models")
        weight_bytes = tensor_bytes(big / "model.safetensors")
        weight_mib = weight_bytes / 2**20
        print(f"weights: {weight_mib:.1f} MiB ({weight_bytes // 4} float32 parameters)", flush=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "DEBUG_", "TORCHELASTIC_", "OMP_"))}
        env.update({"PYTHONPATH": str(project), "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"})
        env.update({"TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})

        rows = []
        for strategy in args.strategies.split(","):
            base = None
            for case in args.cases.split(","):
                folder = work / f"{strategy}-{case}"
                run_args = [
                    *("--strategy", strategy, "--max-steps", "5", "--batch-size", "4", "--eval-every", "0"),
                    *("--threads-per-rank", "1", "--wandb", "disabled", "--log-file", "", "--metrics-file", ""),
                    *("--snapshot-dir", str(folder / "snapshots"), "--export-dir", str(folder / "export")),
                ]
                case_env = {**env, "BENCH_MODEL": str(tiny if case == "tiny" else big)}
                case_env["BENCH_HOW"] = "weights" if case == "tiny" else case
                launched, ranks = torchrun(str(work / "measure.py"), run_args, project, case_env, folder)
                if case == "tiny":
                    base = {record["rank"]: record["points"] for record in ranks}
                found = summarize(strategy, case, launched, ranks, base, weight_mib)
                for row in found:
                    row["run"] = info["date"]
                rows += found
                for row in found:
                    first = row["first_forward"]
                    print(
                        f"{strategy} {case:15s} rank {row['rank']}: {first['peak_mib']:.0f} MiB at the first forward, "
                        f"{first['above_mib']:+.0f} over tiny = {first['x']:.2f}x; launch to first forward "
                        f"{row['launch_to_first_forward_s']:.1f} s",
                        flush=True,
                    )
    info.update(meter.stop())
    runs = [info]
    if args.update:  # the rows of the cases not measured now, and the runs that measured them
        kept = json.loads(Path(args.out).with_suffix(".json").read_text())
        measured = {(row["strategy"], row["case"]) for row in rows}
        old = [row for row in kept["rows"] if (row["strategy"], row["case"]) not in measured]
        order = [(strategy, case) for strategy in ("ddp", "fsdp") for case in CASES]
        rows = sorted(old + rows, key=lambda row: (order.index((row["strategy"], row["case"])), row["rank"]))
        runs = [run for run in kept["runs"] if any(row["run"] == run["date"] for row in old)] + runs
    write_report(Path(args.out), runs, weight_bytes, rows)
    print(f"wrote {args.out}")


def write_report(out, runs, weight_bytes, rows):
    weight_mib = weight_bytes / 2**20
    table = []
    for row in rows:
        cells = [row["strategy"], row["case"], str(row["rank"]), row["run"]]
        for point in POINTS:
            cells.append(f"{row[point]['peak_mib']:.0f} / {row[point]['above_mib']:+.0f} / {row[point]['x']:.2f}x")
        first = row["at_first_forward"]
        cells.append(f"{first['anon']:.0f} / {first['file']:.0f}")
        cells.append(f"{row['launch_to_first_forward_s']:.1f}")
        table.append("| " + " | ".join(cells) + " |")
    text = "\n".join(
        [
            "# Memory per rank when a run starts from pretrained weights (CPU, gloo, 2 ranks)",
            "",
            *(
                f"Measured {info['date']} on {info['cpu']}, {info['nproc']} cores, torch {info['torch']}, Python "
                f"{info['python']}: 1-minute load {info['load_before']:.2f} at the start, {info['load_after']:.2f} at "
                f"the end; other processes used {info['foreign_cpu_s']:.0f} s of CPU in {info['wall_s']:.0f} s."
                for info in runs
            ),
            "",
            f"The weights: a transformers GPT-2 ({', '.join(f'{k} {v}' for k, v in ARCH.items())}; the output layer "
            f"tied to the token embedding), {weight_bytes / 1e6:.0f} MB = {weight_mib:.1f} MiB of float32 tensors, "
            "in one model.safetensors written by save_pretrained. Cases: `weights` = build_model builds it from "
            "its config and pretrained_weights(cfg) names the folder; `tiny` = the same with a GPT-2 of 27 thousand "
            "parameters (the baseline); `from_pretrained` = build_model calls from_pretrained itself on every rank; "
            "`config` = built from its config, no weights read (the floor: the model itself). One thread per rank, "
            "batch 4 x 16 tokens.",
            "",
            "Each cell: VmHWM (peak resident memory of the whole process so far) in MiB / minus the tiny run's, same "
            "rank, same point / that divided by the weights' size. First forward = entry to compute_loss at step 1 "
            "(all of start-up: build, load, wrap); before step = the optimizer's step pre-hook at step 1 (the "
            "first backward too: gradients); after step = its post-hook (AdamW's state too). Anon / file = "
            "RssAnon / RssFile (memory mapped from files) at the first forward, now, not peak.",
            "",
            "| strategy | case | rank | measured | first forward | before step 1 | after step 1 | anon / file MiB | "
            "launch to first forward s |",
            "|---|---|---|---|---|---|---|---|---|",
            *table,
            "",
            "Every figure and each rank's phase times: PRETRAINED.json.",
            "",
        ]
    )
    out.write_text(text)
    out.with_suffix(".json").write_text(
        json.dumps({"runs": runs, "weight_bytes": weight_bytes, "rows": rows}, indent=1)
    )


if __name__ == "__main__":
    main()
