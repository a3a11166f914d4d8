"""The seam's machinery in process: batches of any structure reach the device whole, a stream gives each rank and
worker its exact share, a token-weighted loss is the mean over every rank's tokens, and a misspelled hook is named.

Nothing here names the demo's model or data.
"""

import io
import sys
import types

import pytest
import torch
import torch.multiprocessing as mp
from conftest import ROOT
from torch.utils.data import DataLoader, IterableDataset

sys.path.insert(0, str(ROOT))

from {{ cookiecutter.project_slug }}.machinery.batches import Progress, to_device
from {{ cookiecutter.project_slug }}.machinery.distributed import DistEnv
from {{ cookiecutter.project_slug }}.machinery.hooks import UserCode
from {{ cookiecutter.project_slug }}.machinery.stream import RankShare, StreamBatches, StreamEnded

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


# -- a stream's share ------------------------------------------------------------------------------------------------


class Numbers(IterableDataset):
    """0, 1, 2, ... : each item is its own position in the stream."""

    def __init__(self, size):
        self.size = size

    def __iter__(self):
        return iter(range(self.size))


def share(rank, world_size, workers, skip=0, dataset=None, batch=4):
    items = RankShare(dataset or Numbers(200), DistEnv(rank=rank, world_size=world_size), batch, skip, True)
    loader = DataLoader(items, batch_size=batch, num_workers=workers, drop_last=True)
    return [int(i) for b in loader for i in b]


@pytest.mark.parametrize("workers", [0, 2])
def test_rank_r_of_n_takes_items_r_r_plus_n_and_workers_keep_the_order(workers):
    for rank in range(3):
        taken = share(rank, 3, workers)
        assert taken == list(range(rank, 3 * len(taken), 3))
        assert len(taken) == (200 // 3 + (rank < 200 % 3)) // 4 * 4  # whole batches only


@pytest.mark.parametrize("workers", [0, 2])
def test_a_share_resumed_after_k_batches_continues_exactly(workers):
    whole = share(1, 2, 0)
    assert share(1, 2, workers, skip=5) == whole[5 * 4 :]


def test_a_dataset_that_shards_itself_is_taken_whole():
    mine = Numbers(40)
    mine.shards_itself = True
    assert share(1, 4, 0, dataset=mine) == list(range(40))


def test_steps_of_a_stream_resume_from_their_state_and_its_end_is_an_error():
    cfg = types.SimpleNamespace(batch_size=2, grad_accum=2, num_workers=0)

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
        cfg = types.SimpleNamespace(strategy="ddp", amp="off", compile=False, clip_grad=0.0)
        wrapped = parallel.Parallel(model, cfg, env, user)
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
    from {{ cookiecutter.project_slug }}.machinery.hooks import _as_result

    errors = (model(batch["x"]) - batch["y"]) ** 2
    return _as_result({"loss": errors.sum(), "count": len(errors)}, batch)


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
