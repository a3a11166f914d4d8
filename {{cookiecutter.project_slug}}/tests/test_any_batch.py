"""The seam's machinery in process: batches of any structure reach the device whole, a stream gives each rank and
worker its exact share, a token-weighted loss is the mean over every rank's tokens, and a misspelled hook is named.

Nothing here names the demo's model or data.
"""

import collections
import contextlib
import dataclasses
import io
import random
import sys
import types

import numpy
import pytest
import torch
import torch.multiprocessing as mp
from conftest import ROOT
from torch.utils.data import DataLoader, Dataset, IterableDataset

sys.path.insert(0, str(ROOT))

from {{ cookiecutter.project_slug }}.machinery.batches import Batches, Progress, to_device
from {{ cookiecutter.project_slug }}.machinery.distributed import DistEnv
from {{ cookiecutter.project_slug }}.machinery.hooks import UserCode, as_step_result
from {{ cookiecutter.project_slug }}.machinery.snapshot import capture_rng, restore_rng
from {{ cookiecutter.project_slug }}.machinery.stream import RankShare, StreamBatches, StreamEnded, shards_itself

# -- any batch to the device ---------------------------------------------------------------------------------------


def test_every_tensor_of_a_nested_batch_moves_and_other_values_stay():
    batch = {
        "input_ids": torch.ones(2, 3, dtype=torch.long),
        "extra": [torch.zeros(2), ("a name", 7, torch.ones(1))],
        "pair": (torch.zeros(1), {"deep": torch.ones(2, 2)}),
        "text": ["first", "second"],
    }
    moved = to_device(batch, torch.device("meta"))
    leaves = torch.utils._pytree.tree_leaves(moved)
    assert [leaf.device.type for leaf in leaves if isinstance(leaf, torch.Tensor)] == ["meta"] * 5
    assert [leaf for leaf in leaves if not isinstance(leaf, torch.Tensor)] == ["a name", 7, "first", "second"]
    assert isinstance(moved["pair"], tuple) and isinstance(moved["extra"][1], tuple)
    assert moved["input_ids"].dtype == torch.long and moved["pair"][1]["deep"].shape == (2, 2)


@dataclasses.dataclass(frozen=True)
class Frozen:
    pixels: torch.Tensor
    label: str


@dataclasses.dataclass
class Example:
    inputs: torch.Tensor
    nested: Frozen
    weights: list


Pair = collections.namedtuple("Pair", "x y")


class Encoding(collections.UserDict):
    """A mapping that is no dict, as Hugging Face's BatchEncoding; with an attribute of its own."""

    def __init__(self, data=None, kind="text"):
        super().__init__(data)
        self.kind = kind


def test_dataclasses_named_tuples_and_mappings_move_like_dicts():
    batch = Example(torch.ones(3, 2), Frozen(torch.zeros(3, 1), "cat"), [Pair(torch.ones(3), 4)])
    encoding = Encoding({"input_ids": torch.ones(3, 5)}, kind="tokens")
    moved, moved_encoding = to_device((batch, encoding), torch.device("meta"))
    assert type(moved) is Example and type(moved.nested) is Frozen and type(moved.weights[0]) is Pair
    assert [t.device.type for t in (moved.inputs, moved.nested.pixels, moved.weights[0].x)] == ["meta"] * 3
    assert moved.nested.label == "cat" and moved.weights[0].y == 4 and batch.inputs.device.type == "cpu"
    assert type(moved_encoding) is Encoding and moved_encoding.kind == "tokens"
    assert moved_encoding["input_ids"].device.type == "meta" and encoding["input_ids"].device.type == "cpu"
    # compute_loss returning a scalar: the batch's size is read from the dataclass
    result = as_step_result(torch.tensor(1.0), batch)
    assert result.count == 3


# -- a stream's share ------------------------------------------------------------------------------------------------


class Numbers(IterableDataset):
    """0, 1, 2, ... : each item is its own position in the stream."""

    def __init__(self, size):
        self.size = size

    def __iter__(self):
        return iter(range(self.size))


def share(rank, world_size, workers, skip=0, dataset=None, batch=4):
    """The items rank `rank` trains on, from its `skip`-th on."""
    env = DistEnv(rank=rank, world_size=world_size)
    dataset = dataset or Numbers(200)
    items = RankShare(dataset, env, batch, skip, shards_itself(dataset, env))
    loader = DataLoader(items, batch_size=batch, num_workers=workers, drop_last=True)
    return [int(i) for b in loader for i in b]


@pytest.mark.parametrize("workers", [0, 2])
def test_rank_r_of_n_takes_items_r_r_plus_n_and_workers_keep_the_order(workers):
    for rank in range(3):
        taken = share(rank, 3, workers)
        assert taken == list(range(rank, 3 * len(taken), 3))
        assert len(taken) == (200 // 3 + (rank < 200 % 3)) // 4 * 4  # whole batches only


@pytest.mark.parametrize("workers", [0, 2])
def test_a_share_resumed_after_k_items_continues_exactly_whatever_the_batch_size(workers):
    whole = share(1, 2, 0)
    assert share(1, 2, workers, skip=20) == whole[20:]
    assert share(1, 2, workers, skip=20, batch=3) == whole[20 : 20 + len(share(1, 2, workers, skip=20, batch=3))]
    assert share(1, 2, workers, skip=6, batch=5)[:5] == whole[6:11]  # a position no whole batch of 5 ends at


def test_a_dataset_that_shards_itself_is_taken_whole():
    mine = Numbers(40)
    mine.shards_itself = True
    assert share(1, 4, 0, dataset=mine) == list(range(40))


def test_steps_of_a_stream_resume_from_their_state_and_its_end_is_an_error():
    cfg = types.SimpleNamespace(batch_size=2, grad_accum=2, num_workers=0, seed=0)

    def batches():  # rank 0 of 2 on the stream 0, 1, ..., 19: items 0, 2, 4, ...
        return StreamBatches(Numbers(20), cfg, DistEnv(rank=0, world_size=2), Progress(), None)

    whole = batches()
    first = [batch.tolist() for batch in next(whole)]
    saved = io.BytesIO()
    torch.save(whole.state_dict(), saved)  # as a snapshot holds it
    second = [batch.tolist() for batch in next(whole)]
    assert first + second == [[0, 2], [4, 6], [8, 10], [12, 14]]
    resumed = batches()
    saved.seek(0)
    resumed.load_state_dict(torch.load(saved, weights_only=True))
    assert [batch.tolist() for batch in next(resumed)] == second
    with pytest.raises(StreamEnded):
        next(whole)  # items 16 and 18 are left: not a whole step


def test_a_stream_resumed_with_another_batch_size_and_accumulation_continues_at_the_next_item():
    def batches(batch_size, grad_accum):  # rank 1 of 2 on the stream 0, 1, ..., 99: items 1, 3, 5, ...
        cfg = types.SimpleNamespace(batch_size=batch_size, grad_accum=grad_accum, num_workers=0, seed=0)
        return StreamBatches(Numbers(100), cfg, DistEnv(rank=1, world_size=2), Progress(), None)

    first = batches(3, 2)
    taken = [int(i) for batch in next(first) for i in batch]
    resumed = batches(4, 1)
    resumed.load_state_dict(first.state_dict())
    assert taken == [1, 3, 5, 7, 9, 11]
    assert next(resumed)[0].tolist() == [13, 15, 17, 19]


class Drawing(IterableDataset):
    """0, 1, 2, ... , each with a random number from torch's, Python's and NumPy's streams drawn as it is read."""

    read = 0  # where reading starts

    def __iter__(self):
        for index in range(self.read, 1000):
            yield torch.tensor(
                [index, torch.rand(()).item(), random.random(), numpy.random.rand()], dtype=torch.float64
            )


class DrawingFromItsPlace(Drawing):
    """The same, giving each rank its own items (one rank's copy here), with a state_dict that marks its place."""

    shards_itself = True

    def __iter__(self):
        for item in super().__iter__():
            self.read += 1
            yield item

    def state_dict(self):
        return {"read": self.read}

    def load_state_dict(self, state):
        self.read = state["read"]


@pytest.mark.parametrize("dataset", [Drawing, DrawingFromItsPlace], ids=["skipping", "the dataset's own state"])
def test_a_stream_that_draws_random_numbers_resumes_exactly_with_the_models_draws(dataset):
    """Read in this process, as a trainer does (a dropout draw after each step), snapshotted after step 3 (the
    stream's place and the process's streams) and resumed; a resume skips the items consumed, or loads the dataset's
    own state_dict, which marks its place."""
    cfg = types.SimpleNamespace(batch_size=2, grad_accum=2, num_workers=0, seed=5)

    def stream():
        return StreamBatches(dataset(), cfg, DistEnv(rank=1, world_size=2), Progress(), None)

    def steps(batches, count):
        return [(torch.cat(next(batches)), torch.rand(3)) for _ in range(count)]  # the step's items, its dropout

    torch.manual_seed(0)
    whole = stream()
    assert whole.own_state == (dataset is DrawingFromItsPlace)
    before = steps(whole, 3)
    saved_stream, saved_rng = io.BytesIO(), capture_rng()
    torch.save(whole.state_dict(), saved_stream)
    after = steps(whole, 4)
    assert len({float(item[1]) for step, _ in before + after for item in step}) == 4 * 7, "each item drew its own"

    torch.manual_seed(1)  # another process: whatever its streams, the resume restores them
    resumed = stream()
    saved_stream.seek(0)
    resumed.load_state_dict(torch.load(saved_stream, weights_only=True))
    restore_rng(saved_rng)  # last, as the trainer does
    again = steps(resumed, 4)
    for (items, dropout), (items_again, dropout_again) in zip(after, again, strict=True):
        assert torch.equal(items, items_again) and torch.equal(dropout, dropout_again)


# -- random augmentation in DataLoader workers ---------------------------------------------------------------------


class Augmented(Dataset):
    """Items with a random augmentation, drawn from torch's and Python's streams, as image pipelines do."""

    def __len__(self):
        return 24

    def __getitem__(self, index):
        return torch.tensor([index, torch.rand(()).item(), random.random()], dtype=torch.float64)


class AugmentedByBatch(Augmented):
    """Read a batch at once, as Hugging Face datasets do."""

    def __getitems__(self, indices):
        return [self[index] for index in indices]


@pytest.mark.parametrize(("grad_accum", "dataset"), [(1, Augmented), (2, AugmentedByBatch)])
def test_augmented_items_read_by_workers_are_the_same_after_a_resume_mid_epoch(grad_accum, dataset):
    """A resume skips the items already trained: each item's draws are its own, not a worker's next ones. With
    persistent workers over two and a half epochs, from a resume in the second epoch."""
    cfg = types.SimpleNamespace(batch_size=2, grad_accum=grad_accum, num_workers=2, seed=3)
    steps = 30 // grad_accum  # 12 // grad_accum steps per epoch

    def taken(progress, count):
        batches = Batches(dataset(), cfg, DistEnv(), progress, None)
        return [torch.cat(next(batches)) for _ in range(count)]

    whole = taken(Progress(), steps)
    at = 17 // grad_accum  # a snapshot's position: 5 // grad_accum steps into the second epoch
    resumed = taken(Progress(epoch=1, samples_in_epoch=(at - 12 // grad_accum) * 2 * grad_accum), steps - at)
    assert all(torch.equal(a, b) for a, b in zip(whole[at:], resumed, strict=True))
    assert len({float(item[1]) for step in whole for item in step}) == 2 * 30, "every item drew its own numbers"


# -- a token-weighted loss over ranks with unequal counts ------------------------------------------------------------


def weighted_step(rank, world_size, store_path, results):
    """One step of the trainer's Stepper on a 2-rank gloo group, as the first step of a resumed job: rank r's batch
    has 2 + 5r tokens."""
    import torch.distributed as dist

    from {{ cookiecutter.project_slug }}.machinery import parallel, step
    from {{ cookiecutter.project_slug }}.machinery.batches import Progress

    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size)
    try:
        env = DistEnv(rank=rank, world_size=world_size)
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1)
        user = types.SimpleNamespace(step=lambda m, b: token_sum(m, b), shard_units=None)
        cfg = types.SimpleNamespace(
            strategy="ddp", amp="off", compile=False, clip_grad=0.0, activation_checkpointing="off"
        )
        wrapped = parallel.DistributedModel(model, cfg, env, user)
        wrapped.wrap(resumed=True)  # a resumed job: one settling pass runs first, its gradients thrown away
        optimizer = torch.optim.SGD([model.weight], lr=1.0)  # the bias is not the optimizer's: still cleared
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
        stepper = step.Stepper(
            wrapped, optimizer, scheduler, torch.amp.GradScaler("cpu", enabled=False), user, cfg, env, Progress()
        )
        stepper.forward_backward([tokens_of(rank)])
        results[rank] = ([p.grad.clone() for p in model.parameters()], float(stepper.loss_sum))
    finally:
        dist.destroy_process_group()


def tokens_of(rank):
    generator = torch.Generator().manual_seed(rank)
    count = 2 + 5 * rank  # unequal: 2 tokens on rank 0, 7 on rank 1
    return {"x": torch.randn(count, 3, generator=generator), "y": torch.randn(count, 1, generator=generator)}


def token_sum(model, batch):
    errors = (model(batch["x"]) - batch["y"]) ** 2
    return as_step_result({"loss": errors.sum(), "count": len(errors)}, batch)


def test_a_token_weighted_loss_is_the_mean_over_every_ranks_tokens(tmp_path):
    manager = mp.Manager()
    results = manager.dict()
    mp.spawn(weighted_step, args=(2, tmp_path / "store", results), nprocs=2)
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    everything = [tokens_of(0), tokens_of(1)]
    x, y = torch.cat([b["x"] for b in everything]), torch.cat([b["y"] for b in everything])
    loss = ((model(x) - y) ** 2).mean()  # one process, every token weighing the same
    loss.backward()
    for rank in range(2):
        grads, logged = results[rank]
        for got, expected in zip(grads, (p.grad for p in model.parameters()), strict=True):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
        assert logged == pytest.approx(loss.item(), rel=1e-5)  # the step's loss, the same on every rank


def evaluate_on(rank, world_size, store_path, results):
    """evaluate() on a 2-rank gloo group, with a step whose sums have names that depend on the batch: "odd" only
    for odd samples, which rank 0 (samples 0, 2, 4, ...) never meets."""
    import torch.distributed as dist

    from {{ cookiecutter.project_slug }}.machinery.evaluate import evaluate

    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size)
    try:
        env = DistEnv(rank=rank, world_size=world_size)
        model = torch.nn.Linear(1, 1)
        parallel = types.SimpleNamespace(model=model, sharded=False, autocast=contextlib.nullcontext)
        user = types.SimpleNamespace(step=named_sums, collate=None)
        cfg = types.SimpleNamespace(batch_size=2, num_workers=0)
        results[rank] = evaluate(torch.arange(6.0), parallel, user, cfg, env, lambda: None)[0]
    finally:
        dist.destroy_process_group()


def named_sums(model, batch):
    sums = {"all": batch.sum()}
    if (batch % 2 == 1).any():
        sums["odd"] = batch[batch % 2 == 1].sum()
    return as_step_result({"loss": batch.sum(), "count": len(batch), **sums}, batch)


def test_evaluation_sums_are_the_union_of_every_ranks_names_each_over_the_total_count(tmp_path):
    manager = mp.Manager()
    results = manager.dict()
    mp.spawn(evaluate_on, args=(2, tmp_path / "store", results), nprocs=2)
    # samples 0..5: every sum over the 6 samples, "odd" (1 + 3 + 5) from rank 1 alone
    assert results[0] == results[1] == {"val_loss": 15 / 6, "val_all": 15 / 6, "val_odd": 9 / 6}


# -- the hooks -------------------------------------------------------------------------------------------------------


def test_a_misspelled_hook_is_named_and_a_missing_one_is_an_error(tmp_path, monkeypatch):
    package = tmp_path / "userpkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "data.py").write_text("def build_datasets(cfg):\n    return [], None\n")
    (package / "model.py").write_text(
        "import torch\n\ndef build_model(cfg, train):\n    return torch.nn.Linear(1, 1)\n\n"
        "def loss_fn(outputs, targets):\n    return outputs.mean()\n\n"
        "def build_optimiser(cfg, model):\n    return None\n\ndef helper():\n    return 1\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    (line,) = UserCode("userpkg").misspelled()
    assert "build_optimiser" in line and "build_optimizer" in line
    (package / "model.py").write_text("def build_model(cfg, train):\n    return None\n")
    for name in [m for m in sys.modules if m.startswith("userpkg")]:
        monkeypatch.delitem(sys.modules, name)
    with pytest.raises(Exception, match="compute_loss.*loss_fn"):
        UserCode("userpkg")


class TiedLM(torch.nn.Module):
    """Input and output embeddings share one weight, as in most causal LMs; the blocks in a ModuleList."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.ModuleDict({"embed": torch.nn.Embedding(10, 4), "norm": torch.nn.LayerNorm(4)})
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2))
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.body["embed"].weight


def test_default_fsdp_units_never_split_modules_that_share_a_parameter():
    from {{ cookiecutter.project_slug }}.machinery.parallel import default_shard_units

    model = TiedLM()
    units = default_shard_units(model)
    assert units == [model.body["norm"], *model.blocks]  # embed and head: left to the root, which holds the weight
    untied = TiedLM()
    untied.head.weight = torch.nn.Parameter(untied.head.weight.detach().clone())
    assert default_shard_units(untied) == [untied.body["embed"], untied.body["norm"], *untied.blocks, untied.head]


def test_a_changed_base_lr_reaches_the_users_scheduler_on_resume_and_left_out_parameters_are_named():
    from {{ cookiecutter.project_slug }}.machinery.optim import OptimizerPart, SchedulerPart, unoptimized_parameters

    def build(lr):
        model = torch.nn.Linear(2, 2)
        optimizer = torch.optim.SGD([model.weight], lr=lr)  # the bias is in no group
        return model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (step + 1))

    model, optimizer, scheduler = build(1.0)
    assert unoptimized_parameters(model, optimizer) == ["bias"]
    for _ in range(3):
        optimizer.step()
        scheduler.step()
    saved = OptimizerPart(optimizer).state_dict(), SchedulerPart(scheduler).state_dict()
    _, optimizer, scheduler = build(0.5)  # the resume's build_optimizer, with the new --lr; restored in this order
    OptimizerPart(optimizer).load_state_dict(saved[0])
    part = SchedulerPart(scheduler)
    part.load_state_dict(saved[1])
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.5 / 4) and part.rescaled == [(1.0, 0.5)]
    optimizer.step()
    scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.5 / 5)


def test_a_parameter_in_two_optimizers_or_two_groups_is_named_at_start_up():
    from {{ cookiecutter.project_slug }}.machinery.optim import as_optimizer, optimizer_warnings

    model = torch.nn.Linear(2, 2)
    both = as_optimizer([torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.AdamW([model.weight], lr=0.1)])
    (line,) = optimizer_warnings(model, both)  # each step would move the weight twice
    assert "weight" in line and "bias" not in line, line
    groups = torch.optim.SGD([{"params": [model.weight]}, {"params": [model.bias]}], lr=0.1)
    assert optimizer_warnings(model, groups) == []
