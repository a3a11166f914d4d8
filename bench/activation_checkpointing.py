"""Activation memory and step time, --activation-checkpointing off vs full vs selective, 2 CPU ranks (gloo), ddp.

    python bench/activation_checkpointing.py [--project /path/to/baked_project] [--repeats 3]
        [--out bench/ACTIVATION_CHECKPOINTING.md]

A GPT-2-like transformers model (GPT2Config: 6 layers, width 256, 4 heads, dropout 0.1 as GPT-2 has or
--dropout, built from its config, offline) trains on random token windows of 512 by the baked train.py under
torchrun, through a small wrapper. model.py's shard_units returns the 6 blocks: full recomputes all 6, selective
the 2nd, 4th and 6th; hf-full is the template's off with the model's own activation_checkpointing_enable() (Hugging
Face's: every block, torch.utils.checkpoint, non-reentrant), the field's reference. The wrapper's optimizer step
pre-hook reads VmHWM (the peak resident memory so far) from /proc/self/status at step 1 (the first forward and
backward are done, the optimizer has no state yet) and the clocks (wall and the process's CPU time) at every step;
after the last step both ranks exit. Activation memory = that peak minus the same rank's peak in a run with a tiny
batch (1 window of 8 tokens, off): what the batch's activations add. Step time = the median interval between step
pre-hooks after the first step. The modes run interleaved, --repeats times, on a machine other jobs share.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from common import TOKEN_DATA, CpuMeter, load, machine, project_in, scratch_folder

MODES = ("off", "full", "selective", "hf-full")  # hf-full: Hugging Face's own, activation_checkpointing_enable()
ARCH = {"n_layer": 6, "n_embd": 256, "n_head": 4, "n_positions": 512, "vocab_size": 2048}

MODEL = """
import json
import os

from transformers import GPT2Config, GPT2LMHeadModel


def build_model(cfg, train_dataset):
    # use_cache=False: training keeps no cache (a cache the blocks update is refused under checkpointing)
    config = GPT2Config(**json.loads(os.environ["BENCH_ARCH"]), use_cache=False)
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = float(os.environ["BENCH_DROPOUT"])
    model = GPT2LMHeadModel(config)
    if os.environ.get("BENCH_HF_CHECKPOINTING") == "1":  # the field's own: every block, torch.utils.checkpoint
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    return model


def compute_loss(model, batch):
    return model(**batch).loss


def shard_units(model):
    return list(model.transformer.h)
"""

WRAPPER = """
import json, os, sys, time
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
import train

STEPS = int(os.environ["BENCH_STEPS"])
starts, cpu, peaks = [], [], []

def before(optimizer, args, kwargs):
    starts.append(time.perf_counter())
    cpu.append(time.process_time())
    if len(peaks) == 0:
        status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines() if ":" in line)
        peaks.append(int(status["VmHWM"].split()[0]) / 1024)

def after(optimizer, args, kwargs):
    if len(starts) < STEPS:
        return
    rank = int(os.environ["RANK"])
    with open(os.path.join(os.environ["BENCH_OUT"], f"rank{{rank}}.json"), "w") as handle:
        json.dump({{"rank": rank, "peak_mib": peaks[0], "starts": starts, "cpu": cpu}}, handle)
    dist.barrier()
    os._exit(0)  # what is measured is done: no final snapshot, no export

register_optimizer_step_pre_hook(before)
register_optimizer_step_post_hook(after)
train.main(sys.argv[1:])
raise SystemExit("the run ended before its last measured step")
"""


def torchrun(script, args, cwd, env, out):
    """Two ranks of `script`; each rank's record."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", script, *args]
    result = subprocess.run(cmd, cwd=cwd, env={**env, "BENCH_OUT": str(out)}, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    warnings = [line for line in (result.stdout + result.stderr).splitlines() if "checkpoint" in line.lower()]
    warnings = [line for line in warnings if "warn" in line.lower()]
    return [json.loads(path.read_text()) for path in sorted(out.glob("rank*.json"))], warnings


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--project", default="", help="copy this baked project instead of baking one")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps per run (the first is not timed)")
    parser.add_argument("--batch-size", type=int, default=2, help="windows of 512 tokens per rank")
    parser.add_argument("--dropout", type=float, default=0.1, help="GPT-2's three dropouts (its default: 0.1)")
    parser.add_argument(
        "--mmap-threshold", type=int, default=1048576, help="MALLOC_MMAP_THRESHOLD_ for the ranks; 0: glibc's default"
    )
    parser.add_argument("--keep", action="store_true", help="keep the scratch folder")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "ACTIVATION_CHECKPOINTING.md"))
    args = parser.parse_args()

    info = machine()
    info["load_before"] = load()[0]
    meter = CpuMeter()
    with scratch_folder("activation-checkpointing-", args.keep) as work:
        project, package = project_in(work, args.project)
        (project / package / "data.py").write_text(TOKEN_DATA)
        (project / package / "model.py").write_text(MODEL)
        (work / "measure.py").write_text(WRAPPER.format())
        env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "DEBUG_", "TORCHELASTIC_", "OMP_"))}
        env.update({"PYTHONPATH": str(project), "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"})
        env.update({"TRANSFORMERS_OFFLINE": "1", "BENCH_ARCH": json.dumps(ARCH)})
        env["BENCH_VOCAB"], env["BENCH_DROPOUT"] = str(ARCH["vocab_size"]), str(args.dropout)
        if args.mmap_threshold:
            env["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)

        def measure(name, mode, seq, batch, steps):
            folder = work / name
            run_args = [
                *("--activation-checkpointing", "off" if mode == "hf-full" else mode),
                *("--batch-size", str(batch), "--max-steps", "100"),
                *("--eval-every", "0", "--threads-per-rank", "1", "--wandb", "disabled", "--log-file", ""),
                *("--metrics-file", "", "--snapshot-every", "1000"),
                *("--snapshot-dir", str(folder / "snapshots"), "--export-dir", str(folder / "export")),
            ]
            run_env = {**env, "BENCH_TOKENS": str(seq), "BENCH_STEPS": str(steps)}
            run_env["BENCH_HF_CHECKPOINTING"] = "1" if mode == "hf-full" else "0"
            return torchrun(str(work / "measure.py"), run_args, project, run_env, folder)

        tiny, _ = measure("tiny", "off", 8, 1, 2)
        base = {record["rank"]: record["peak_mib"] for record in tiny}
        print(f"tiny batch: peak {base} MiB", flush=True)
        runs, noise = [], []
        for repeat in range(args.repeats):
            for mode in MODES:
                ranks, warned = measure(f"{mode}-{repeat}", mode, 512, args.batch_size, args.steps)
                noise += warned
                activations = max(r["peak_mib"] - base[r["rank"]] for r in ranks)
                step_s, cpu_s = (
                    statistics.median(b - a for r in ranks for a, b in zip(r[clock][1:], r[clock][2:], strict=False))
                    for clock in ("starts", "cpu")
                )
                runs.append(
                    {
                        "mode": mode,
                        "repeat": repeat,
                        "activation_mib": activations,
                        "step_s": step_s,
                        "cpu_s": cpu_s,
                        "peak_mib": [r["peak_mib"] for r in ranks],
                    }
                )
                print(
                    f"{mode:9s} #{repeat}: activations {activations:.0f} MiB, step {step_s:.2f} s, CPU {cpu_s:.2f} s",
                    flush=True,
                )
    info.update(meter.stop())
    write_report(Path(args.out), info, base, runs, noise, args)
    print(f"wrote {args.out}")


def write_report(out, info, base, runs, noise, args):
    by_mode = {mode: [run for run in runs if run["mode"] == mode] for mode in MODES}
    off_memory = statistics.median(run["activation_mib"] for run in by_mode["off"])
    off_step = statistics.median(run["step_s"] for run in by_mode["off"])
    off_cpu = statistics.median(run["cpu_s"] for run in by_mode["off"])
    rows = []
    for mode, found in by_mode.items():
        memory = statistics.median(run["activation_mib"] for run in found)
        steps = [run["step_s"] for run in found]
        cpu = [run["cpu_s"] for run in found]
        rows.append(
            f"| {mode} | {memory:.0f} | {memory / off_memory:.2f} | {statistics.median(cpu):.2f} "
            f"({', '.join(f'{s:.2f}' for s in cpu)}) | {statistics.median(cpu) / off_cpu:.2f} | "
            f"{statistics.median(steps):.2f} ({', '.join(f'{s:.2f}' for s in steps)}) | "
            f"{statistics.median(steps) / off_step:.2f} |"
        )
    text = "\n".join(
        [
            "# --activation-checkpointing: activation memory and step time (CPU, gloo, 2 ranks, ddp)",
            "",
            f"Measured {info['date']} on {info['cpu']}, {info['nproc']} cores, torch {info['torch']}, Python "
            f"{info['python']}: 1-minute load {info['load_before']:.2f} at the start, {info['load_after']:.2f} at the "
            f"end; other processes used {info['foreign_cpu_s']:.0f} s of CPU in {info['wall_s']:.0f} s. The machine "
            "is shared with other jobs: step times are noisy, hence each mode's runs, interleaved.",
            "",
            f"Model: transformers GPT-2 ({', '.join(f'{k} {v}' for k, v in ARCH.items())}; dropout {args.dropout}; "
            f"use_cache False), built from its config; shard_units = its 6 blocks. Batch {args.batch_size} windows "
            f"of 512 tokens per rank, one thread per rank, {args.steps} optimizer steps per run, {args.repeats} runs "
            "per mode. Activations = the larger rank's VmHWM at the step-1 optimizer pre-hook minus that rank's in a "
            f"run with 1 window of 8 tokens ({', '.join(f'rank {r}: {v:.0f}' for r, v in sorted(base.items()))} "
            "MiB): the embeddings, the loss and the logits (outside the units) count too. "
            + (
                f"MALLOC_MMAP_THRESHOLD_={args.mmap_threshold}: glibc maps and unmaps each allocation of that size "
                "or more, so the resident peak follows the tensors alive, not what its heap keeps. "
                if args.mmap_threshold
                else "glibc's default allocator settings (its heap keeps freed buffers: the peaks are high). "
            )
            + "Step = the median interval between step pre-hooks after step 1, over both ranks: CPU time of the "
            "rank's process (what the step computes; one thread per rank), and wall time (what other jobs on the "
            "machine stretch); each run's median in brackets.",
            "",
            "| mode | activations MiB (median) | x off | CPU s per step (median; runs) | x off | "
            "wall s per step (median; runs) | x off |",
            "|---|---|---|---|---|---|---|",
            *rows,
            "",
            f"Warnings about checkpointing in the runs' output: {len(noise)}.",
            "",
            "```json",
            json.dumps({"machine": info, "tiny_peak_mib": base, "runs": runs}, indent=1),
            "```",
            "",
        ]
    )
    out.write_text(text)


if __name__ == "__main__":
    main()
