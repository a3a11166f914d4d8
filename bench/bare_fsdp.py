"""The bare loop memory_phases.py compares the baked project's memory with: the floor of --strategy fsdp (and ddp).

A process group from torchrun's environment, the baked project's own model class on its own data, and then:
  fsdp  fully_shard on each unit the project's shard_units names (each Linear of the demo MLP), else the units the
        template picks itself (machinery.parallel.default_shard_units: a GPT-2's wpe, each block, ln_f), then on the
        root
  ddp   DistributedDataParallel (gradient_as_bucket_view, as the template's)
AdamW, the same batch, one CPU thread per rank, a plain loop: no snapshots, no export, no evaluation. The loss is
the project's compute_loss(model, batch) where model.py has one (dict batches: a Hugging Face model), else
cross_entropy of (inputs, targets). The memory of
each phase (built, wrapped, first forward, backward, optimizer step, the steps after) is read by phase_probe.py:

    torchrun --standalone --nproc_per_node=2 bare_fsdp.py --project /path/to/baked_project --strategy fsdp \
        --width 2048 --depth 6 --max-steps 20 --out /tmp/folder
"""

import argparse
import importlib
import os
import sys

import torch
import torch.nn.functional as F
from phase_probe import Phases
from torch.distributed import barrier, init_process_group
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--project", required=True, help="a baked project folder (its model and data are used)")
    parser.add_argument("--package", default="ddp_project")
    parser.add_argument("--strategy", choices=("fsdp", "ddp"), default="fsdp")
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    phases = Phases()
    torch.set_num_threads(1)
    init_process_group(backend="gloo")
    sys.path.insert(0, os.path.abspath(args.project))
    model_module = importlib.import_module(f"{args.package}.model")
    data_module = importlib.import_module(f"{args.package}.data")
    config = importlib.import_module(f"{args.package}.config")
    parallel = importlib.import_module(f"{args.package}.machinery.parallel")
    cfg = config.parse_args(["--width", str(args.width), "--depth", str(args.depth), "--wandb", "disabled"])
    dataset, _ = data_module.build_datasets(cfg)
    torch.manual_seed(args.seed)

    phases.enter("build")
    model = model_module.build_model(cfg, dataset)
    model.train()  # as the template's trainer: from_pretrained returns a model in eval mode (no dropout)
    phases.enter("wrap")
    if args.strategy == "fsdp":
        for unit in getattr(model_module, "shard_units", parallel.default_shard_units)(model):
            fully_shard(unit)
        fully_shard(model)
        forward = model
    else:
        forward = DistributedDataParallel(model, gradient_as_bucket_view=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    loader = DataLoader(dataset, batch_size=args.batch_size, drop_last=True, sampler=DistributedSampler(dataset))

    compute_loss = getattr(model_module, "compute_loss", None)
    steps, batches = 0, iter(loader)
    while steps < args.max_steps:
        try:
            batch = next(batches)
        except StopIteration:
            batches = iter(loader)
            continue
        first = steps == 0
        phases.enter("forward" if first else "steps")
        loss = compute_loss(forward, batch) if compute_loss else F.cross_entropy(forward(batch[0]), batch[1])
        phases.enter("backward" if first else "steps")
        loss.backward()
        phases.enter("step" if first else "steps")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        steps += 1
    phases.dump(args.out, steps=steps)
    barrier()
    os._exit(0)  # gloo's destroy_process_group can hang a rank once the others have gone; nothing is left to do


if __name__ == "__main__":
    main()
