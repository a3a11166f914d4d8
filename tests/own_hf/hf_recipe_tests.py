"""The Hugging Face recipes of docs/recipes.md with the real libraries: a `transformers` GPT-2 built from a config
(dropout on, its output layer tied to the token embedding) on a `datasets.Dataset` under ddp and under `--strategy fsdp`
without `shard_units`, and on a `datasets` stream shuffled and split per rank with `split_dataset_by_node` (under ddp);
the same GPT-2 from pretrained weights, and with `peft` LoRA adapters, its base frozen (under both).

The template tests copy this file, as tests/test_hf_recipes.py (its name here keeps the template's own pytest from
collecting it outside a bake), into a bake and run it there. Each test trains the recipe as docs/recipes.md writes it,
uninterrupted and SIGKILLed at a random rank and moment (restarted by torchrun), and compares them bit for bit.
"""

import importlib
import json
import shutil
import sys

import conftest
import pytest
import torch
from conftest import (
    EXACT,
    PACKAGE,
    ROOT,
    assert_same_weights,
    final_model,
    save_base_model,
    sigkill_at_random_and_resume,
)
from test_recipes import RECIPES

pytest.importorskip("transformers")
pytest.importorskip("datasets")
from transformers import AutoModelForCausalLM

STEPS, BATCH, RANKS = 40, 4, 2
ARGS = EXACT + ["--max-steps", str(STEPS), "--batch-size", str(BATCH), "--eval-every", "20", "--lr", "1e-3"]
KILL_AFTER = (11, 25)
# Appended to the recipe's model.py: each training batch's rows, per rank and process, for the stream test.
RECORD = """

_recipe_compute_loss = compute_loss


def compute_loss(model, batch):
    import json, os

    if model.training:
        with open(os.path.join(os.environ["HF_RECORD"], f"rank-{os.environ.get('RANK', '0')}.jsonl"), "a") as f:
            f.write(json.dumps({"pid": os.getpid(), "rows": batch["input_ids"].tolist()}) + "\\n")
    return _recipe_compute_loss(model, batch)
"""
# Appended to the pretrained recipe's model.py: the weights each process's first training step meets (rank 0
# writes them; under fsdp the shards are gathered).
FIRST_STATE = """

_before_first_state = compute_loss
_first_state = [True]


def compute_loss(model, batch):
    import os

    import torch
    from torch.distributed.tensor import DTensor

    if model.training and _first_state[0]:
        _first_state[0] = False
        state = getattr(model, "module", model).state_dict()  # without DDP's wrapper
        state = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in state.items()}
        if os.environ.get("RANK", "0") == "0":
            torch.save(state, os.path.join(os.environ["HF_RECORD"], f"first-state-{os.getpid()}.pt"))
    return _before_first_state(model, batch)
"""


# Appended to the LoRA recipe's model.py: right after optimizer step 15, something writes to a frozen parameter. The
# optimizer's step count (restored on resume) says when, so a resumed run writes it at the same step.
EDIT_FROZEN = """


def extra_state(cfg, model, optimizer):
    import torch

    frozen = model.get_base_model().transformer.h[0].attn.c_attn.base_layer.weight

    def edit(optimizer, args, kwargs):
        if {int(state["step"]) for state in optimizer.state.values()} == {15}:
            with torch.no_grad():
                frozen.mul_(1.5)

    optimizer.register_step_post_hook(edit)
    return {}
"""
EDITED = "base_model.model.transformer.h.0.attn.c_attn.base_layer.weight"


@pytest.fixture
def recipe(tmp_path, monkeypatch):
    """A copy of this project with a recipe's model.py and data.py, which the runs of the test train: a function
    that takes the recipe's name and returns the copy's (model, data) modules."""

    def make(name, extra=""):
        workspace = tmp_path / "project"
        shutil.copytree(ROOT / PACKAGE, workspace / PACKAGE, ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copy(ROOT / "train.py", workspace / "train.py")
        for file, source in RECIPES[name].items():
            added = RECORD + extra if file == "model.py" else ""
            (workspace / PACKAGE / file).write_text(source + added, encoding="utf-8")
        (tmp_path / "rows").mkdir()
        monkeypatch.setenv("HF_RECORD", str(tmp_path / "rows"))
        monkeypatch.setattr(conftest, "ROOT", workspace)  # train_cmd() and child_env() take the copy
        monkeypatch.syspath_prepend(str(workspace))
        for module in [m for m in sys.modules if m == PACKAGE or m.startswith(PACKAGE + ".")]:
            monkeypatch.delitem(sys.modules, module)
        return importlib.import_module(f"{PACKAGE}.model"), importlib.import_module(f"{PACKAGE}.data")

    return make


def check_export_loads_strictly_with_tied_weights(model_module, export_dir, reference):
    model = model_module.build_model(None, None)
    weights = torch.load(export_dir / "model.pt", weights_only=True)
    model.load_state_dict(weights, strict=True)
    assert model.lm_head.weight is model.transformer.wte.weight  # still one tensor
    assert_same_weights(model.state_dict(), reference)
    return weights


def check_hf_folder_loads_as_model_pt(export_dir, weights):
    """export/hf is a transformers folder that from_pretrained loads to model.pt's tensors, weights still tied."""
    loaded = AutoModelForCausalLM.from_pretrained(export_dir / "hf")
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    assert_same_weights(loaded.state_dict(), weights)


def check_adapter_folder_loads_as_model_pt(model_module, export_dir, weights):
    """export/hf is a peft adapter folder: PeftModel.from_pretrained on the base (model.pt's base weights, as a
    user's base from the hub) gives model.pt's tensors."""
    from peft import PeftModel

    base = AutoModelForCausalLM.from_config(model_module.build_model(None, None).get_base_model().config)
    base_weights = {
        key.removeprefix("base_model.model.").replace(".base_layer.", "."): value
        for key, value in weights.items()
        if ".lora_" not in key
    }
    base.load_state_dict(base_weights, strict=True)
    assert_same_weights(PeftModel.from_pretrained(base, export_dir / "hf").state_dict(), weights)


def rows_per_process(tmp_path, rank):
    processes = {}
    for line in (tmp_path / "rows" / f"rank-{rank}.jsonl").read_text().splitlines():
        entry = json.loads(line)
        processes.setdefault(entry["pid"], []).extend(entry["rows"])
    return list(processes.values())


def killed_run_ends_as_the_uninterrupted_one(tmp_path, model_module, strategy, args=()):
    """The recipe trained uninterrupted and SIGKILLed (restarted by torchrun): bitwise the same weights, an export
    that loads strictly with its weights still tied; returns (the restarted run's summary, model.pt's weights)."""
    args = ARGS + ["--strategy", strategy, *args]
    resumed = sigkill_at_random_and_resume(tmp_path, RANKS, args, kill_after=KILL_AFTER)
    assert resumed["steps"] == STEPS and resumed["resumed_from"] >= 10, resumed
    reference = final_model(tmp_path / "reference-snapshots")["model"]
    assert_same_weights(reference, final_model(tmp_path / "run-snapshots")["model"])
    weights = check_export_loads_strictly_with_tied_weights(model_module, tmp_path / "run-export", reference)
    return resumed, weights


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_dataset_resumes_bitwise_and_its_export_loads_with_tied_weights(tmp_path, recipe, strategy):
    model_module, _ = recipe("hf")
    _, weights = killed_run_ends_as_the_uninterrupted_one(tmp_path, model_module, strategy)
    check_hf_folder_loads_as_model_pt(tmp_path / "run-export", weights)


@pytest.mark.slow
def test_a_split_stream_trains_every_item_of_each_split_once_in_order_and_resumes_bitwise(
    tmp_path, recipe, monkeypatch
):
    """Under ddp only: which items a rank trains, and where a resume takes the stream up, do not depend on the
    strategy (the same GPT-2 resumes bitwise under fsdp in the dataset test above)."""
    model_module, data_module = recipe("hf-stream")
    resumed, _ = killed_run_ends_as_the_uninterrupted_one(tmp_path, model_module, "ddp")
    for rank in range(RANKS):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", str(RANKS))
        split, _ = data_module.build_datasets(importlib.import_module(f"{PACKAGE}.config").parse_args([]))
        expected = [item["input_ids"] for _, item in zip(range(STEPS * BATCH), split, strict=False)]
        reference_rows, *attempts = rows_per_process(tmp_path, rank)
        assert reference_rows == expected  # the uninterrupted run: every item of this rank's split, in order
        last = attempts[-1]  # the attempt that finished: from the snapshot it resumed, to the end
        assert last == expected[resumed["resumed_from"] * BATCH :]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_pretrained_model_starts_from_its_weights_and_a_resume_from_its_snapshot_bitwise(
    tmp_path, recipe, monkeypatch, strategy
):
    """The fine-tuning recipe: prepare_data tokenizes into a cache, the runs start from the weights of a folder that
    save_pretrained wrote (under fsdp: built on meta, sharded, then loaded), and a SIGKILLed run resumes from its
    snapshot, not from the weights, to the same bits as the uninterrupted one."""
    save_base_model(tmp_path / "base-model")
    monkeypatch.setenv("BASE_MODEL", str(tmp_path / "base-model"))
    monkeypatch.setenv("DATA_CACHE", str(tmp_path / "data-cache"))
    model_module, _ = recipe("hf-pretrained", extra=FIRST_STATE)
    killed_run_ends_as_the_uninterrupted_one(tmp_path, model_module, strategy)
    transformers = importlib.import_module("transformers")
    expected = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base-model").state_dict()
    firsts = [torch.load(path) for path in sorted((tmp_path / "rows").glob("first-state-*.pt"))]
    from_weights = [first for first in firsts if all(torch.equal(first[k], expected[k]) for k in expected)]
    # the uninterrupted run and the killed one start from the weights; the restart from its snapshot
    assert len(firsts) == 3 and len(from_weights) == 2, len(firsts)
    assert (tmp_path / "data-cache").is_dir()


def snapshot_contents(folder):
    """{step: (the step whose snapshot holds the frozen parameters, bytes on disk, the model's keys it holds)}."""
    sharded_keys = importlib.import_module(f"{PACKAGE}.machinery.snapshot").sharded_keys
    found = {}
    for step_folder in sorted(folder.glob("step-*")):
        manifest = json.loads((step_folder / "manifest.json").read_text())
        if (step_folder / "sharded").is_dir():
            keys = set(sharded_keys(str(step_folder / "sharded")))
        else:
            keys = set(torch.load(step_folder / "shared.pt", weights_only=True)["model"])
        size = sum(entry["size"] for entry in manifest["files"].values())
        found[manifest["step"]] = (manifest.get("frozen_in"), size, keys)
    return found


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_lora_snapshots_write_the_frozen_base_once_resume_bitwise_and_export_an_adapter_folder(
    tmp_path, recipe, monkeypatch, strategy
):
    pytest.importorskip("peft")
    save_base_model(tmp_path / "base-model")  # the base starts from its weights (pretrained_weights)
    monkeypatch.setenv("BASE_MODEL", str(tmp_path / "base-model"))
    model_module, _ = recipe("lora", extra=EDIT_FROZEN)
    # each block's activations recomputed in backward: its adapters train, its base is frozen
    args = ["--keep-snapshots", "2", "--activation-checkpointing", "full"]
    killed_run_ends_as_the_uninterrupted_one(tmp_path, model_module, strategy, args)
    weights = torch.load(tmp_path / "run-export" / "model.pt", weights_only=True)
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base-model").state_dict()
    for name in ("transformer.wte.weight", "transformer.h.1.attn.c_attn.weight"):  # frozen: still the base's
        peft_name = "base_model.model." + name.replace("c_attn.", "c_attn.base_layer.")
        assert torch.equal(weights[peft_name], base[name]), name
    check_adapter_folder_loads_as_model_pt(model_module, tmp_path / "run-export", weights)

    model = model_module.build_model(None, None)
    frozen = {name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    base_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    assert frozen and EDITED in frozen
    for run in ("reference", "run"):
        snapshots = snapshot_contents(tmp_path / f"{run}-snapshots")
        # Step 10 held the base; step 20 holds it again (a frozen parameter changed at step 15) and, no kept
        # snapshot referring to step 10 any more, that one is pruned, while step 20 is kept for the newest two.
        assert {step: held_in for step, (held_in, _, _) in snapshots.items()} == {20: 20, 30: 20, 40: 20}, run
        assert frozen <= snapshots[20][2]
        for step in (30, 40):
            assert not frozen & snapshots[step][2]  # the adapters, their optimizer state and the progress only
            assert snapshots[20][1] - snapshots[step][1] >= base_bytes
    said = [line for line in (tmp_path / "reference.log").read_text().splitlines() if " WARNING " in line]
    assert any(EDITED in line for line in said), said  # the change is said, naming the parameter
    assert not [line for line in said if "activation-checkpointing" in line or "utils/checkpoint" in line], said
