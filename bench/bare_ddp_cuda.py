"""The bare DDP loop on GPUs, the baseline of the GPU check.

The shape of pytorch/examples' distributed/ddp-tutorial-series/multigpu_torchrun.py: nccl, one GPU per rank
(LOCAL_RANK), DistributedDataParallel with device_ids, a DistributedSampler, batches moved to the GPU from pinned
memory, a plain loop. It trains what the baked project's seam builds (build_datasets, build_model, loss_fn), with
AdamW at the project's --lr and --weight-decay, so it measures the same work as the baked train.py; flags it does
not know go to the project's own settings (--batch-size, the demo's --width, ...). It reads the loss every
--log-every steps, as the baked train.py does by default, so both wait for the GPU equally often.
With --device cpu it runs on gloo, so that its plumbing can be tried on a machine without GPUs.

    torchrun --standalone --nproc_per_node=1 bare_ddp_cuda.py --project /path/to/baked_project --max-steps 300 \\
        --batch-size 256
"""

import argparse
import importlib
import os
import sys

import torch
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--project", required=True, help="a baked project folder (its model and data are used)")
    parser.add_argument("--package", default="", help="its package name (default: found in the folder)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--max-steps", type=int, default=300)
    parser.add_argument("--log-every", type=int, default=10)
    args, project_flags = parser.parse_known_args()

    sys.path.insert(0, os.path.abspath(args.project))
    package = args.package or next(
        name
        for name in sorted(os.listdir(args.project))
        if os.path.isfile(os.path.join(args.project, name, "model.py"))
    )
    config = importlib.import_module(f"{package}.config")
    data = importlib.import_module(f"{package}.data")
    model_module = importlib.import_module(f"{package}.model")
    cfg = config.parse_args(project_flags)

    local_rank = int(os.environ["LOCAL_RANK"])
    on_gpu = args.device == "cuda"
    if on_gpu:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        init_process_group(backend="nccl", device_id=device)
    else:
        device = torch.device("cpu")
        init_process_group(backend="gloo")

    torch.manual_seed(cfg.seed)
    train_data, _ = data.build_datasets(cfg)
    model = model_module.build_model(cfg, train_data).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    model = DDP(model, device_ids=[local_rank] if on_gpu else None)
    loader = DataLoader(
        train_data,
        batch_size=cfg.batch_size,
        drop_last=True,
        pin_memory=on_gpu,
        sampler=DistributedSampler(train_data, drop_last=True),
    )

    steps, epoch = 0, 0
    while steps < args.max_steps:
        loader.sampler.set_epoch(epoch)
        for source, targets in loader:
            source, targets = source.to(device, non_blocking=True), targets.to(device, non_blocking=True)
            optimizer.zero_grad()
            loss = model_module.loss_fn(model(source), targets)
            loss.backward()
            optimizer.step()
            steps += 1
            if steps % args.log_every == 0:
                value = loss.item()  # every rank waits for its GPU here, as in the baked loop's logging
                if os.environ["RANK"] == "0":
                    print(f"step {steps} loss {value:.4f}", flush=True)
            if steps == args.max_steps:
                break
        epoch += 1
    destroy_process_group()


if __name__ == "__main__":
    main()
