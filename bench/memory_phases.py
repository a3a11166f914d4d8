"""Each rank's memory at each phase of a run, --strategy ddp vs fsdp, at 1, 2 and 4 CPU ranks, beside a bare loop.

    python bench/memory_phases.py [--project /path/to/baked_project] [--ranks 1,2,4] [--strategies ddp,fsdp]
                                  [--width 2048 --depth 6] [--steps 20] [--out bench/MEMORY.json]
    python bench/memory_phases.py --model gpt2 [--tokens 256 --batch-size 2] [--steps 4 --snapshot-every 2]
                                  [--template-args=--no-snapshot-copy] ...

The baked train.py runs under torchrun (gloo, one thread per rank) through a wrapper that marks the phases with
phase_probe.py: startup (imports, process group), build (build_model), wrap (sharding or DDP, the optimizer, the
snapshot folder, everything up to the first step), forward and backward (of step 1), step (its optimizer step:
AdamW's state appears), steps (the later steps up to the first snapshot), snapshot (Checkpointer.save; with
--blocking-saves also the writer's copy, serialization and commit, so that its memory is its own), later (the steps
after a snapshot, with the background write), eval (evaluation) and export (model.pt, best.pt). Each phase's
figure is its own peak resident memory (VmHWM, reset between phases); above baseline = minus the same phase's peak
in a run of the same strategy and ranks with --width 32 (what every rank pays anyway). Beside
each, bare_fsdp.py: the same model, data, batch and AdamW in a plain loop (fully_shard per Linear + root, or DDP),
measured the same way against its own --width 32 run: the floor.

--model gpt2: the same with a transformers GPT-2 (pretrained_memory.py's: 6 x 768, 81 M parameters, the output layer
tied to the token embedding) on --tokens-long rows, its weights written by save_pretrained (offline) and named by
model.py's pretrained_weights(cfg) (rank 0 reads them; under fsdp the model is built on meta); the baseline is the
same with pretrained_memory.py's tiny GPT-2. The bare loop calls from_pretrained on every rank and shards the units
the template picks itself (default_shard_units: wpe, each block, ln_f), then the root.
"""

import argparse
import json
import os
import shlex
import shutil
import tempfile
from pathlib import Path

from common import TOKEN_DATA, machine, project_in, rank_files
from pretrained_memory import ARCH, MODEL, save_models

BENCH = Path(__file__).resolve().parent
PHASES = ("startup", "build", "wrap", "forward", "backward", "step", "steps", "snapshot", "later", "eval", "export")

WRAPPER = """
import os, sys
from phase_probe import Phases
phases = Phases()
import train
from {package}.machinery import checkpointer, evaluate, hooks, measure, outputs, pretrained, trainer
# the template resets the peak itself (at start and at each log): it would hide part of a phase's peak
measure._HostMemory._reset = staticmethod(lambda: True)
measure.Measure._reset_peak = lambda self: None

def around(owner, name, phase, then=None):
    original = getattr(owner, name)
    def marked(*args, **kwargs):
        before = phases.current
        phases.enter(phase)
        try:
            return original(*args, **kwargs)
        finally:
            phases.enter(then or before)
    setattr(owner, name, marked)

around(pretrained, "build_model", "build", then="wrap")
around(evaluate, "evaluate", "eval")
around(outputs.ExportFolder, "export", "export")
original_save = checkpointer.Checkpointer.save
def save(self, blocking=False):
    before = phases.current
    phases.enter("snapshot")
    try:
        original_save(self, blocking=blocking or os.environ.get("MEMORY_BLOCKING_SAVES") == "1")
    finally:
        phases.enter("later" if before in ("steps", "later") else before)  # the steps after a snapshot
checkpointer.Checkpointer.save = save
original_step = hooks.UserCode.step
def step(self, model, batch):
    result = original_step(self, model, batch)
    if phases.current == "forward":
        phases.enter("backward")
    return result
hooks.UserCode.step = step
original_forward_backward = trainer.Trainer.forward_backward
def forward_backward(self, micro_batches):
    if phases.current == "wrap":
        phases.enter("forward")
    original_forward_backward(self, micro_batches)
    if phases.current == "backward":
        phases.enter("step")
trainer.Trainer.forward_backward = forward_backward
original_optimizer_step = trainer.Trainer.optimizer_step
def optimizer_step(self):
    stepped = original_optimizer_step(self)
    phases.enter("later" if phases.current == "later" else "steps")
    return stepped
trainer.Trainer.optimizer_step = optimizer_step
train.main(sys.argv[1:])
phases.dump(os.environ["MEMORY_OUT"])
"""


def torchrun(nproc, script, args, cwd, env, out):
    """Run `script` on `nproc` ranks; each rank's record."""
    records = [json.loads(text) for text in rank_files(nproc, script, args, cwd, env, out, timeout=3600)]
    for written in ("snapshots", "export"):  # a GPT-2's are GBs per run
        shutil.rmtree(out / written, ignore_errors=True)
    return records


def peaks(records):
    """{phase: the largest peak over the ranks}, and "run": the largest of them (the whole run's peak)."""
    found: dict[str, float] = {}
    for record in records:
        for phase, peak in record["peak_mib"].items():
            found[phase] = max(found.get(phase, 0.0), peak)
    found["run"] = max(found.values())
    return found


def chosen(records, label, bare_label=""):
    """The template's records of `label` and the bare loop's of `bare_label` (default: `label` too)."""
    return [r for r in records if r["label"] == (bare_label or label if r["source"] == "bare" else label)]


def table(records, label, bare_label=""):
    """The Markdown table of one label's records: each phase's peak above baseline, the largest rank's."""
    rows = chosen(records, label, bare_label)
    phases = [p for p in PHASES if any(p in r["above_mib"] for r in rows)]
    lines = [
        "| strategy | ranks | loop | " + " | ".join(phases) + " | whole run | whole run, MiB |",
        "|---|---|---|" + "---|" * (len(phases) + 2),
    ]
    for r in sorted(rows, key=lambda r: (r["strategy"], r["ranks"], r["source"] != "template")):
        cells = [f"{round(r['above_mib'][p])}" if p in r["above_mib"] else "" for p in phases]  # no "-0"
        lines.append(
            f"| {r['strategy']} | {r['ranks']} | {r['source']} | "
            + " | ".join(cells)
            + f" | **{r['above_mib']['run']:.0f}** | {r['peak_mib']['run']:.0f} |"
        )
    return "\n".join(lines)


def ratios(records, label, bare_label=""):
    """fsdp / ddp (template) and template / bare, whole run above baseline, per number of ranks."""
    found = {
        (r["source"], r["strategy"], r["ranks"]): r["above_mib"]["run"] for r in chosen(records, label, bare_label)
    }
    lines = ["| ranks | fsdp / ddp (template) | fsdp / ddp (bare) | fsdp template / bare | ddp template / bare |"]
    lines.append("|---|---|---|---|---|")
    for n in sorted({key[2] for key in found}):

        def ratio(a, b):
            return f"{found[a] / found[b]:.2f}x" if a in found and b in found and found[b] > 0 else ""

        lines.append(
            f"| {n} | {ratio(('template', 'fsdp', n), ('template', 'ddp', n))} | "
            f"{ratio(('bare', 'fsdp', n), ('bare', 'ddp', n))} | "
            f"{ratio(('template', 'fsdp', n), ('bare', 'fsdp', n))} | "
            f"{ratio(('template', 'ddp', n), ('bare', 'ddp', n))} |"
        )
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--project", default="", help="a baked project, copied (default: bake the template)")
    parser.add_argument("--model", choices=("mlp", "gpt2"), default="mlp", help="the demo MLP or a pretrained GPT-2")
    parser.add_argument("--ranks", default="1,2,4")
    parser.add_argument("--strategies", default="ddp,fsdp")
    parser.add_argument("--width", type=int, default=2048, help="the MLP's")
    parser.add_argument("--depth", type=int, default=6, help="the MLP's")
    parser.add_argument("--tokens", type=int, default=256, help="the GPT-2's sequence length")
    parser.add_argument("--batch-size", type=int, default=0, help="per rank (default: 32 for the MLP, 2 for GPT-2)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--snapshot-every", type=int, default=10)
    parser.add_argument(
        "--template-args",
        default="",
        help="more flags for the template's runs, not the bare loop's (--template-args=\"--a --b 1\")",
    )
    parser.add_argument("--no-bare", action="store_true", help="leave the bare loop out")
    parser.add_argument("--no-template", action="store_true", help="run the bare loop only")
    parser.add_argument("--blocking-saves", action="store_true", help="each snapshot written before training goes on")
    parser.add_argument("--label", default="", help="a name for this set of runs in the .json")
    parser.add_argument("--out", default=str(BENCH / "MEMORY.json"), help="records are added to this .json")
    parser.add_argument("--tables", default="", help="print the tables of these labels (comma-separated) and exit")
    parser.add_argument("--bare-label", default="", help="with --tables: the bare loop's rows from this label")
    args = parser.parse_args()
    if args.tables:
        records = json.loads(Path(args.out).read_text())
        for label in args.tables.split(","):
            print(
                f"{label}:\n\n{table(records, label, args.bare_label)}\n\n{ratios(records, label, args.bare_label)}\n"
            )
        return

    work = Path(tempfile.mkdtemp(prefix="memory-phases-"))
    project, package = project_in(work, args.project)
    wrapper = work / "measure.py"
    wrapper.write_text(WRAPPER.format(package=package))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "DEBUG_", "TORCHELASTIC_", "OMP_"))}
    env.update({"PYTHONPATH": f"{project}{os.pathsep}{BENCH}", "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled"})
    if args.blocking_saves:
        env["MEMORY_BLOCKING_SAVES"] = "1"
    batch = args.batch_size or (2 if args.model == "gpt2" else 32)
    if args.model == "gpt2":
        (project / package / "data.py").write_text(TOKEN_DATA)
        (project / package / "model.py").write_text(MODEL)
        big, tiny = save_models(work / "models")
        env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
        env["BENCH_TOKENS"] = str(args.tokens)
        # (name, flags, environment): the baseline first; the template reads the weights through pretrained_weights,
        # the bare loop calls from_pretrained on every rank
        sizes = [(name, [], {"BENCH_MODEL": str(folder)}) for name, folder in (("tiny", tiny), ("gpt2", big))]
        how = {"template": "weights", "bare": "from_pretrained"}
    else:
        sizes = [(str(width), ["--width", str(width), "--depth", str(args.depth)], {}) for width in (32, args.width)]
        how = {"template": "", "bare": ""}
    model_name = sizes[1][0]
    extra = shlex.split(args.template_args)

    out = Path(args.out)
    records = json.loads(out.read_text()) if out.exists() else []
    for nproc in map(int, args.ranks.split(",")):
        for strategy in args.strategies.split(","):
            found = {}
            for name, size, size_env in sizes:
                folder = work / f"{strategy}-{nproc}-{name}"
                run_args = [
                    *size,
                    *("--strategy", strategy, "--max-steps", str(args.steps), "--batch-size", str(batch)),
                    *("--snapshot-every", str(args.snapshot_every), "--eval-every", "0", "--threads-per-rank", "1"),
                    *("--wandb", "disabled", "--log-file", "", "--metrics-file", ""),
                    *("--snapshot-dir", str(folder / "snapshots"), "--export-dir", str(folder / "export")),
                    *extra,
                ]
                if not args.no_template:
                    run_env = {**env, **size_env, "BENCH_HOW": how["template"]}
                    found[("template", name)] = torchrun(nproc, str(wrapper), run_args, project, run_env, folder)
                if not args.no_bare:
                    bare_args = [
                        *("--project", str(project), "--package", package, "--strategy", strategy),
                        *(*size, "--batch-size", str(batch)),
                        *("--max-steps", str(args.steps), "--out", str(folder / "bare")),
                    ]
                    run_env = {**env, **size_env, "BENCH_HOW": how["bare"]}
                    found[("bare", name)] = torchrun(
                        nproc, str(BENCH / "bare_fsdp.py"), bare_args, project, run_env, folder / "bare"
                    )
            for source in ("template", "bare"):
                if (source, model_name) not in found:
                    continue
                model, base = peaks(found[(source, model_name)]), peaks(found[(source, sizes[0][0])])
                record = {
                    "label": args.label,
                    "source": source,
                    "strategy": strategy,
                    "ranks": nproc,
                    "model": args.model,
                    **({"arch": ARCH, "tokens": args.tokens} if args.model == "gpt2" else {}),
                    **({"width": args.width, "depth": args.depth} if args.model == "mlp" else {}),
                    "batch_size": batch,
                    "steps": args.steps,
                    "snapshot_every": args.snapshot_every,
                    "template_args": extra if source == "template" else [],
                    "blocking_saves": args.blocking_saves,
                    "malloc_env": {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")},
                    "peak_mib": {k: round(v, 1) for k, v in model.items()},
                    "above_mib": {k: round(v - base[k], 1) for k, v in model.items() if k in base},
                    "per_rank": found[(source, model_name)],
                    "baseline_per_rank": found[(source, sizes[0][0])],
                    "machine": machine(),
                }
                records.append(record)
                shown = " ".join(f"{k} {v:.0f}" for k, v in record["above_mib"].items())
                print(f"{args.label} {source} {strategy} {nproc}: {shown}", flush=True)
                out.write_text(json.dumps(records, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
