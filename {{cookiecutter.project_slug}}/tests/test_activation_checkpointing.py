"""--activation-checkpointing: the units' forwards run again in backward (every unit with full, every second with
selective), the gradients and the weights are those of a run without it (dropout replays its masks), also after a
SIGKILL under ddp and fsdp, and a model it cannot serve is refused in one line.
"""

import dataclasses
import json
import warnings

import pytest
import torch
from conftest import (
    PACKAGE,
    QUICK,
    assert_same_weights,
    default_config,
    default_datasets,
    final_model,
    injected,
    outputs,
    run,
    summary,
    train_cmd,
)
from torch import nn

from {{ cookiecutter.project_slug }}.machinery import checkpointing, report
from {{ cookiecutter.project_slug }}.machinery.distributed import DistEnv
from {{ cookiecutter.project_slug }}.machinery.faults import BadUserValue
from {{ cookiecutter.project_slug }}.machinery.hooks import UserCode
from {{ cookiecutter.project_slug }}.machinery.parallel import DistributedModel
from {{ cookiecutter.project_slug }}.machinery.settings import RunError

# The arguments of the SIGKILL resume test beside it: the suite's uninterrupted run of them (reference_runs) serves both
ARGS = QUICK + ["--max-steps", "80", "--snapshot-every", "20"]


def one_step(mode, seed=0):
    """The project's model, built and checkpointed as a run with `--activation-checkpointing mode` (one process),
    after one training forward and backward on a batch of the training data. Returns (model, its units, how many
    times each module inside a unit ran forward)."""
    cfg = dataclasses.replace(default_config(), activation_checkpointing=mode)
    user = UserCode(PACKAGE)
    torch.manual_seed(cfg.seed)
    train, _ = default_datasets()
    model = user.build_model(cfg, train).train()
    parallel = DistributedModel(model, cfg, DistEnv(), user)
    units = parallel.units()
    calls = {}
    for unit in units:
        for module in unit:
            for inner in list(module.modules())[1:]:  # the unit's own forward is the recompute's, not __call__'s
                calls[inner] = 0
                inner.register_forward_pre_hook(lambda m, args: calls.__setitem__(m, calls[m] + 1))
    batch = user.collate([train[i] for i in range(min(cfg.batch_size, len(train)))])
    torch.manual_seed(seed)
    parallel.distributed.zero_grad()
    user.step(parallel.distributed, batch).loss.backward()
    return model, units, calls


def test_full_recomputes_every_unit_selective_every_second_with_the_same_gradients():
    plain, units, plain_calls = one_step("off")
    assert units and all(count == 1 for count in plain_calls.values()), "every module runs forward once without it"
    gradients = {name: p.grad for name, p in plain.named_parameters() if p.grad is not None}
    for mode, recomputed in (("full", range(len(units))), ("selective", range(1, len(units), 2))):
        model, units, calls = one_step(mode)
        assert list(model.state_dict()) == list(plain.state_dict()), "the state_dict keys do not change"
        for index, unit in enumerate(units):
            for module in unit:
                ran = [calls[m] for m in list(module.modules())[1:]]
                if index not in recomputed:
                    assert ran == [1] * len(ran), (mode, index, module)
                elif ran:  # forward, then again in backward, up to the last result backward needs
                    assert 2 in ran and set(ran) <= {1, 2}, (mode, index, module, ran)
        # dropout inside a recomputed unit draws the same masks again: the same gradients, bit for bit
        assert_same_weights(gradients, {name: p.grad for name, p in model.named_parameters() if p.grad is not None})


def accumulated_gradients(mode, **settings):
    """The gradients of two micro-batches (one step with --grad-accum 2), the first unit frozen, the model wrapped as
    a run wraps it with `--activation-checkpointing mode` and `settings` (one process); the warnings met."""
    cfg = dataclasses.replace(default_config(), activation_checkpointing=mode, **settings)
    user = UserCode(PACKAGE)
    torch.manual_seed(cfg.seed)
    train, _ = default_datasets()
    model = user.build_model(cfg, train).train()
    parallel = DistributedModel(model, cfg, DistEnv(), user)
    for parameter in parallel.units()[0][0].parameters():
        parameter.requires_grad_(False)
    parallel.wrap(resumed=False)
    with warnings.catch_warnings(record=True) as met:
        warnings.simplefilter("always")
        for micro in range(2):
            batch = user.collate([train[i] for i in range(micro * 4, micro * 4 + 4)])
            torch.manual_seed(micro)
            with parallel.autocast():
                loss = user.step(parallel.for_steps, batch).loss
            loss.backward()
    said = [str(w.message) for w in met if "checkpoint" in f"{w.filename} {w.message}".lower()]
    return {name: p.grad for name, p in model.named_parameters() if p.grad is not None}, said


@pytest.mark.slow  # torch.compile's first call takes seconds
def test_compiled_in_bf16_with_a_frozen_unit_and_accumulated_gradients_it_gives_the_gradients_of_off():
    """A compiled frozen unit with dropout stopped the run (inductor cannot replay random numbers in a graph without
    gradients): a unit that backward does not reach is run as it is. Compiled, the two graphs' kernels may sum in
    another order (the last bits differ); a mask drawn anew or a unit left out of backward would differ by far more."""
    settings = {"compile": True, "amp": "bf16"}
    (plain, _), (recomputed, said) = accumulated_gradients("off", **settings), accumulated_gradients("full", **settings)
    assert plain and not said and set(recomputed) == set(plain)
    for name, gradient in plain.items():
        assert (recomputed[name] - gradient).abs().max() <= 0.05 * gradient.abs().max(), name


def test_a_hugging_face_model_trains_without_its_cache_and_exports_the_config_it_was_built_with(tmp_path):
    """A cache handed to a block would be refused: its config's use_cache is off to train, on in the export."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=32, n_positions=16)
    model = transformers.GPT2LMHeadModel(config).train()
    checkpointing.apply(model, [[block] for block in model.transformer.h], "full")
    ids = torch.randint(0, 32, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    report.save_pretrained(model, model.state_dict(), str(tmp_path / "hf"))
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["use_cache"] is True
    assert model.config.use_cache is False


def test_buffers_a_forward_changes_are_updated_once_and_gradients_are_the_same():
    """BatchNorm's running statistics: its recompute in backward would update them a second time."""

    def trained(mode):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.5)), nn.Linear(8, 2))
        checkpointing.apply(model, [[model[0]], [model[1]]], mode)
        for _ in range(2):
            model(torch.randn(16, 4)).square().sum().backward()
        return {**model.state_dict(), **{f"{name}.grad": p.grad for name, p in model.named_parameters()}}

    plain, recomputed = trained("off"), trained("full")
    assert plain["0.1.num_batches_tracked"] == 2
    assert_same_weights(plain, recomputed)


def test_a_model_without_units_and_a_unit_given_an_object_are_refused_in_one_line():
    user = UserCode(PACKAGE)
    user.shard_units = None  # the default units: children with parameters; a bare Linear has none
    cfg = dataclasses.replace(default_config(), activation_checkpointing="full")
    with pytest.raises(RunError) as refused:
        DistributedModel(nn.Linear(4, 4), cfg, DistEnv(), user)
    assert "--activation-checkpointing" in str(refused.value) and "\n" not in str(refused.value)

    class Cache:  # state the forward changes: a recompute would append to it a second time
        def __init__(self):
            self.seen = []

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 4)

        def forward(self, x, scale=1.0, cache=None):
            if cache is not None:
                cache.seen.append(x)
            return self.linear(x) * scale

    model = nn.Sequential(Block(), Block())
    checkpointing.apply(model, [[model[0]], [model[1]]], "full")
    x = torch.randn(2, 4, requires_grad=True)
    model[1](model[0](x, scale=2.0, cache=None), 0.5).sum().backward()  # tensors, numbers and None replay
    with pytest.raises(BadUserValue) as refused:
        model[0](x, cache=Cache())
    line = str(refused.value)
    assert "'cache'" in line and "Cache" in line and "--activation-checkpointing" in line and "\n" not in line


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_full_resumed_after_a_sigkill_ends_with_the_weights_of_a_run_without_it(tmp_path, reference_runs, strategy):
    """Rank 0 is SIGKILLed right after the snapshot of step 40 and torchrun restarts the job, which resumes there. Its
    snapshots are written without a copy of the state (--no-snapshot-copy): the reference run copies it."""
    args = ARGS + (["--strategy", "fsdp"] if strategy == "fsdp" else [])
    reference = reference_runs(args)  # --activation-checkpointing off
    cmd = train_cmd(2, ["--max-restarts=1"], script="tests/fault_injection.py")
    env = injected(tmp_path, FAULT="kill_after_commit", FAULT_STEP=40)
    run(cmd + args + ["--activation-checkpointing", "full", "--no-snapshot-copy"] + outputs(tmp_path), env=env)
    assert (tmp_path / "fault-fired").exists()
    assert (summary(tmp_path)["resumed_from"], summary(tmp_path)["steps"]) == (40, 80)
    assert_same_weights(reference["model"], final_model(tmp_path / "run-snapshots")["model"])
