"""The bare DDP loop the benchmark compares the baked project with.

The shape of pytorch/examples' distributed/ddp-tutorial-series/multigpu_torchrun.py, on CPU with gloo: a
process group from torchrun's environment, DistributedDataParallel, a DistributedSampler, a plain loop.
It trains the baked project's own model class on its own data, with the same batch and optimizer:

    torchrun --standalone --nproc_per_node=2 bare_ddp.py --project /path/to/baked_project --max-steps 200
"""

import argparse
import importlib
import os
import sys

import torch
import torch.nn.functional as F
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler


def ddp_setup():
    init_process_group(backend="gloo")


class Trainer:
    def __init__(self, model, train_data, optimizer, max_steps):
        self.rank = int(os.environ["RANK"])
        self.model = DDP(model)
        self.train_data = train_data
        self.optimizer = optimizer
        self.max_steps = max_steps
        self.steps = 0

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad()
        output = self.model(source)
        loss = F.cross_entropy(output, targets)
        loss.backward()
        self.optimizer.step()
        self.steps += 1

    def _run_epoch(self, epoch):
        self.train_data.sampler.set_epoch(epoch)
        for source, targets in self.train_data:
            self._run_batch(source, targets)
            if self.steps == self.max_steps:
                return

    def train(self):
        epoch = 0
        while self.steps < self.max_steps:
            self._run_epoch(epoch)
            epoch += 1
        if self.rank == 0:
            print(f"bare loop: {self.steps} steps, {epoch} epoch(s)", flush=True)


def load_train_objs(args):
    sys.path.insert(0, os.path.abspath(args.project))
    slug = args.package or next(
        name for name in os.listdir(args.project) if os.path.isfile(os.path.join(args.project, name, "model.py"))
    )
    model_module = importlib.import_module(f"{slug}.model")
    data_module = importlib.import_module(f"{slug}.data")
    config = importlib.import_module(f"{slug}.config")
    cfg = config.parse_args(
        [
            "--width",
            str(args.width),
            "--depth",
            str(args.depth),
            "--dropout",
            str(args.dropout),
            "--dataset-size",
            str(args.dataset_size),
            "--wandb",
            "disabled",
        ]
    )
    dataset, _ = data_module.build_datasets(cfg)  # the project's own seam: its training data and model
    torch.manual_seed(args.seed)
    model = model_module.build_model(cfg, dataset)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    return dataset, model, optimizer


def prepare_dataloader(dataset, batch_size):
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=False,
        drop_last=True,
        sampler=DistributedSampler(dataset, drop_last=True),
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--project", required=True, help="a baked project folder (its model and data are used)")
    parser.add_argument("--package", default="", help="its package name (default: found in the folder)")
    parser.add_argument("--max-steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--dataset-size", type=int, default=8192)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=1337)
    args = parser.parse_args()

    ddp_setup()
    dataset, model, optimizer = load_train_objs(args)
    train_data = prepare_dataloader(dataset, args.batch_size)
    Trainer(model, train_data, optimizer, args.max_steps).train()
    destroy_process_group()


if __name__ == "__main__":
    main()
