"""What a run shows of its speed and memory: tokens/s, peak memory per logged step, each rank's step time by part,
the straggler (machinery/measure.py)."""

import json
import logging
import os
import types

import pytest
import torch
from conftest import QUICK, child_env, metrics, outputs, project, run, summary, train_cmd

from {{ cookiecutter.project_slug }}.machinery.distributed import DistEnv
from {{ cookiecutter.project_slug }}.machinery.measure import PARTS, Measure, batch_tokens, peak_flops, straggler

# -- in this process ---------------------------------------------------------------------------------------------


def times(data=0.0, compute=1.0, optimizer=0.2, wait=0.0, snapshot=0.0, steps=10):
    return dict(data=data, compute=compute, optimizer=optimizer, wait=wait, snapshot=snapshot, steps=steps)


def test_the_straggler_is_the_rank_10_percent_slower_than_the_median_without_waiting_with_its_slow_part():
    even = [times(), times(), times(data=0.05), times()]
    assert straggler(even) is None, "5% slower is no straggler"
    found = straggler([times(wait=0.9), times(data=0.5), times(wait=0.8), times(wait=0.5)])
    assert (found["rank"], found["part"]) == (1, "data"), found
    # two ranks compare with the faster one; the others' wait for the straggler does not make them slow
    assert straggler([times(wait=2.0), times(optimizer=0.4)])["part"] == "optimizer"
    assert straggler([times(compute=1.0, wait=3.0), times(compute=1.05)]) is None
    assert straggler([times(data=9.0)]) is None, "one rank has no one to wait for"


def test_a_batch_tells_its_tokens_by_attention_mask_else_input_ids_else_not():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert int(batch_tokens({"input_ids": torch.ones(2, 3), "attention_mask": mask})) == 3
    assert batch_tokens({"input_ids": torch.ones(2, 3)}) == 6
    assert batch_tokens((torch.ones(2, 3), torch.ones(2))) is None
    assert batch_tokens({"x": torch.ones(2, 3)}) is None


def test_peak_flops_of_known_devices_and_none_for_others():
    assert peak_flops("NVIDIA H100 80GB HBM3", "bf16") == pytest.approx(989.4e12)
    assert peak_flops("NVIDIA H100 PCIe", "off") == pytest.approx(51.2e12)
    assert peak_flops("NVIDIA A100-SXM4-80GB", "fp16") == pytest.approx(312e12)
    assert peak_flops("Tesla V100-SXM2-16GB", "bf16") is None, "V100 has no bf16"
    assert peak_flops("Some Future GPU", "bf16") is None


def single_process_measure(step_count=None):
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.AdamW(model.parameters())
    parallel = types.SimpleNamespace(model=model, sharded=False)
    stepper = types.SimpleNamespace(parallel=parallel, optimizer=optimizer, step_count=step_count)
    return Measure(types.SimpleNamespace(amp="off"), DistEnv(), stepper), model, optimizer


def one_step(measure, model, optimizer, batch):
    measure.begin_step()
    measure.done("data")
    model(torch.ones(2, 64)).sum().backward()
    measure.done("compute", [batch])
    measure.done("snapshot")
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    measure.done("optimizer")


def test_tokens_come_from_compute_loss_count_first_and_parts_add_up(caplog):
    measure, model, optimizer = single_process_measure(step_count=torch.tensor(7.0, dtype=torch.float64))
    with caplog.at_level(logging.INFO):
        for _ in range(3):
            one_step(measure, model, optimizer, {"input_ids": torch.ones(2, 5)})
    metrics = measure.interval(seconds=2.0, steps=3)
    assert metrics["tokens_per_s"] == pytest.approx(3 * 7 / 2.0)  # the count, not input_ids' 10
    assert metrics["peak_memory_rank"] == 0 and metrics["peak_memory_mib"] > 0
    # the first step's line: parameters, gradients and Adam's two moments (and its step counts), in bytes
    (record,) = [r for r in caplog.records if "optimizer state" in r.getMessage()]
    weights = 64 * 65 * 4
    assert record.args[0] == f"every rank {weights / 1024:.1f} KiB / {weights / 1024:.1f} KiB / " + (
        f"{(2 * weights + 2 * 4) / 1024:.1f} KiB"
    )
    step_times, found = measure.summary()
    assert len(step_times) == 1 and step_times[0]["steps"] == 3 and found is None
    assert set(PARTS) <= step_times[0].keys() and step_times[0]["compute"] > 0


def test_mfu_is_the_first_steps_counted_flops_per_second_over_the_peak():
    measure, model, optimizer = single_process_measure()
    measure._peak, measure._count_flops = 1e9, True  # as on a GPU whose peak is in the table
    with measure.counting_flops():
        one_step(measure, model, optimizer, (torch.ones(2, 64), None))
    with measure.counting_flops():  # the first step only
        one_step(measure, model, optimizer, (torch.ones(2, 64), None))
    # forward 2 x 2 x 64 x 64 (the matmul of 2 samples), backward as much again (the weight's gradient; the input
    # needs none), over 2 steps
    assert measure.interval(seconds=0.5, steps=2)["mfu"] == pytest.approx(2 * 2 * 2 * 64 * 64 * 2 / 0.5 / 1e9)
    # where the batches tell their tokens: 6 x the parameters per token
    measure, model, optimizer = single_process_measure(step_count=torch.tensor(10.0, dtype=torch.float64))
    measure._peak = 1e9
    one_step(measure, model, optimizer, {})
    assert measure.interval(seconds=2.0, steps=1)["mfu"] == pytest.approx(6 * 64 * 65 * 10 / 2.0 / 1e9)


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="the peak is reset through /proc")
def test_the_peak_memory_of_an_interval_is_its_own():
    measure, model, optimizer = single_process_measure()
    one_step(measure, model, optimizer, (torch.ones(2, 64), None))
    held = torch.ones(300 * 2**20 // 4)  # 300 MiB, touched, and given back before the log
    del held
    first = measure.interval(seconds=1.0, steps=1)
    one_step(measure, model, optimizer, (torch.ones(2, 64), None))
    second = measure.interval(seconds=1.0, steps=1)
    assert "tokens_per_s" not in first, "a tuple batch tells no tokens"
    assert first["peak_memory_mib"] - second["peak_memory_mib"] > 250, (first, second)


# -- a run of 2 ranks whose rank 1 is slow to load its data ------------------------------------------------------

TOKEN_DATA = """
import os
import time

import torch
from torch.utils.data import default_collate


def build_datasets(cfg):
    generator = torch.Generator().manual_seed(0)
    items = []
    for _ in range(512):
        ids = torch.randint(0, 16, (5,), generator=generator)
        items.append({"input_ids": ids, "attention_mask": torch.tensor([1, 1, 1, 0, 0]), "labels": ids.roll(1)})
    return items, None


def collate(items):
    if os.environ.get("SLOW_DATA_RANK") == os.environ.get("RANK"):
        time.sleep(float(os.environ["SLOW_DATA_S"]))
    return default_collate(items)
"""

TOKEN_MODEL = """
import torch
import torch.nn.functional as F
from torch import nn


def build_model(cfg, train_dataset):
    return nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 16))


def compute_loss(model, batch):
    return F.cross_entropy(model(batch["input_ids"]).flatten(0, 1), batch["labels"].flatten())


def build_optimizer(cfg, model):  # in place of one model.py may have for its own model
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr)
"""


def test_a_rank_slow_to_load_data_is_named_with_its_part_and_a_dict_batch_logs_tokens(tmp_path):
    workspace = project(tmp_path, model=TOKEN_MODEL, data=TOKEN_DATA)
    args = QUICK + ["--max-steps", "12", "--log-every", "4", "--batch-size", "8"] + outputs(tmp_path)
    env = child_env(PYTHONPATH=workspace, SLOW_DATA_RANK=1, SLOW_DATA_S=0.05)
    run(train_cmd(nproc=2, script=str(workspace / "train.py")) + args, env=env, cwd=workspace)
    records = metrics(tmp_path)
    assert [r["step"] for r in records] == [4, 8, 12]
    for record in records:
        # 3 tokens of 5 in every sample: tokens come from the attention mask, over the same seconds as samples
        assert record["tokens_per_s"] == pytest.approx(3 * record["samples_per_s"]), record
        assert record["peak_memory_rank"] in (0, 1) and record["peak_memory_mib"] > 0, record
    done = summary(tmp_path)
    assert json.loads((tmp_path / "summary.json").read_text()) == done  # beside the metrics file too
    rank0, rank1 = done["step_times"]
    assert rank0["steps"] == rank1["steps"] == 12
    assert rank1["data"] > 12 * 0.05 * 0.9, rank1
    # rank 0 waited for rank 1's data in the gradient sync: its wait, not its compute
    assert rank0["wait"] > 12 * 0.05 * 0.5 and rank0["compute"] < rank0["wait"], rank0
    assert (done["straggler"]["rank"], done["straggler"]["part"]) == (1, "data"), done["straggler"]
