"""Starting from pretrained weights (machinery/pretrained.py): each kind of file gives the model exactly the tensors
from_pretrained gives, read in blocks, tied weights stay tied, names that do not fit are one line, parameters made
on the meta device leave buffers as build_model made them (also those made like a parameter), a peft model gets its
base's weights and keeps its adapters, and under fsdp (two ranks) each rank gets exactly its shard with no more than
one block of a tensor in flight; a peft model with a 0-d parameter trains under fsdp and resumes bitwise."""

import shutil
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as mp
from conftest import EXACT, assert_same_weights, child_env, outputs, project, run, save_base_model, summary, train_cmd
from torch import nn

from {{ cookiecutter.project_slug }}.machinery import pretrained
from {{ cookiecutter.project_slug }}.machinery.distributed import DistEnv
from {{ cookiecutter.project_slug }}.machinery.settings import RunError

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny GPT-2 saved by save_pretrained, and the state from_pretrained gives back."""
    folder = tmp_path_factory.mktemp("base")
    save_base_model(folder)
    reference = transformers.GPT2LMHeadModel.from_pretrained(folder)
    return folder, reference.state_dict()


def fresh_model(folder):
    torch.manual_seed(1)  # other random weights than the saved ones
    return transformers.GPT2LMHeadModel(transformers.GPT2Config.from_pretrained(folder))


@pytest.mark.parametrize("kind", ["folder", "shards", "safetensors", "pt", "bin"])
def test_a_model_starts_from_exactly_the_tensors_of_each_kind_of_weights(base, tmp_path, kind, monkeypatch):
    folder, reference = base
    monkeypatch.setattr(pretrained, "BLOCK_BYTES", 300)  # a few rows at a time: blocks, and a tensor's last one short
    if kind == "shards":
        path = tmp_path / "sharded"
        save_base_model(path, max_shard_size="50KB")
        assert (path / "model.safetensors.index.json").is_file()
    elif kind == "safetensors":
        path = folder / "model.safetensors"
    elif kind in ("pt", "bin"):  # a torch.save state dict; save_pretrained's pytorch_model.bin is one
        path = tmp_path / ("weights.pt" if kind == "pt" else "pytorch_model.bin")
        torch.save(transformers.GPT2LMHeadModel.from_pretrained(folder).state_dict(), path)
    else:
        path = folder
    model = fresh_model(folder)
    assert not torch.equal(model.transformer.h[0].attn.c_attn.weight, reference["transformer.h.0.attn.c_attn.weight"])
    pretrained.load(model, str(path), DistEnv())
    assert_same_weights(model.state_dict(), reference)
    assert model.lm_head.weight is model.transformer.wte.weight  # still one tensor


def test_names_that_do_not_fit_the_model_are_one_line_naming_them(base, tmp_path):
    folder, reference = base
    state = dict(reference)
    state.pop("lm_head.weight")  # tied: the embedding's name is enough
    state["transformer.h.0.mlp.fc.weight"] = state.pop("transformer.h.0.mlp.c_fc.weight")
    state["transformer.wpe.weight"] = torch.zeros(8, 32)
    torch.save(state, tmp_path / "renamed.pt")
    with pytest.raises(RunError) as refused:
        pretrained.load(fresh_model(folder), str(tmp_path / "renamed.pt"), DistEnv())
    line = str(refused.value)
    assert "\n" not in line and str(tmp_path / "renamed.pt") in line
    assert "missing transformer.h.0.mlp.c_fc.weight" in line and "unexpected transformer.h.0.mlp.fc.weight" in line
    assert "transformer.wpe.weight [8, 32] in the file, [16, 32] in the model" in line
    assert "lm_head" not in line
    for absent in (tmp_path / "absent", tmp_path):  # no such path; a folder without weights
        with pytest.raises(RunError, match=str(absent)):
            pretrained.load(fresh_model(folder), str(absent), DistEnv())


class Rotary(nn.Module):
    """Buffers made in __init__, none saved: a rotary table, and others made from a parameter's shape."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, 4, 2) / 4), persistent=False)
        self.register_buffer("mask", torch.ones_like(self.proj.weight), persistent=False)
        self.register_buffer("bias_mask", self.proj.bias.new_ones(4) * 2, persistent=False)
        self.register_buffer("zeros", torch.zeros_like(self.proj.weight[0]), persistent=False)
        self.register_buffer("positions", torch.arange(4, device=self.proj.weight.device), persistent=False)
        self.register_buffer("scale", torch.tensor([0.5, 2.0]).to(self.proj.weight), persistent=False)


class FromValues(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.register_buffer("start", self.proj.weight.detach() * 1.0, persistent=False)


def test_parameters_made_on_meta_take_no_memory_and_buffers_keep_their_values():
    torch.manual_seed(0)
    reference = dict(Rotary().named_buffers())
    with pretrained.parameters_on_meta():
        model = Rotary()
    assert all(parameter.is_meta for parameter in model.parameters())
    pretrained.materialize(model, torch.device("cpu"))
    assert not any(parameter.is_meta for parameter in model.parameters())
    assert_same_weights(dict(model.named_buffers()), reference)
    assert nn.Linear(2, 2).weight.device.type == "cpu" and torch.ones_like(model.proj.weight).is_meta is False

    # A buffer made from a parameter's values cannot be made on meta: the model is built as usual, with a warning
    # that names the buffer, and it holds what build_model makes.
    warnings = []
    user = SimpleNamespace(build_model=lambda cfg, data: FromValues())
    torch.manual_seed(0)
    built = pretrained.build_model(user, None, None, DistEnv(), True, lambda *args: warnings.append(args[0] % args[1:]))
    assert not any(parameter.is_meta for parameter in built.parameters())
    torch.manual_seed(0)
    assert torch.equal(built.start, FromValues().start)
    assert len(warnings) == 1 and "start" in warnings[0], warnings


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_hugging_face_model_built_on_meta_and_loaded_has_from_pretrained_s_buffers(tmp_path, family):
    """Rotary tables (Llama) and any other buffers: the same as from_pretrained's, saved or not."""
    if family == "gpt2":
        config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4)
        cls = transformers.GPT2LMHeadModel
    else:
        config = transformers.LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=32,
        )
        cls = transformers.LlamaForCausalLM
    cls(config).save_pretrained(tmp_path)
    reference = cls.from_pretrained(tmp_path)
    with pretrained.parameters_on_meta():
        model = cls(config)
    pretrained.materialize(model, torch.device("cpu"))
    pretrained.load(model, str(tmp_path), DistEnv())
    assert_same_weights(dict(model.named_buffers()), dict(reference.named_buffers()))
    assert_same_weights(model.state_dict(), reference.state_dict())


@pytest.mark.parametrize("on_meta", [False, True])
def test_a_peft_model_starts_from_its_base_s_weights_and_keeps_its_adapters(base, on_meta):
    """peft's names (base_model.model., base_layer., modules_to_save) are mapped to the base's; the adapters keep
    what build_model made, also when the base is built on meta (then build_model runs again to make them)."""
    peft = pytest.importorskip("peft")
    folder, reference = base

    def build_model(cfg, data):
        lora = peft.LoraConfig(
            r=4,
            target_modules=["c_attn", "c_proj"],
            fan_in_fan_out=True,
            modules_to_save=["ln_f"],
            task_type="CAUSAL_LM",
        )
        return peft.get_peft_model(fresh_model(folder), lora)

    warnings = []
    model = pretrained.build_model(
        SimpleNamespace(build_model=build_model), None, None, DistEnv(), on_meta, lambda *args: warnings.append(args)
    )
    built = {name: value.clone() for name, value in model.state_dict().items() if "lora_" in name}
    pretrained.materialize(model, torch.device("cpu"))
    pretrained.load(model, str(folder), DistEnv())
    assert not warnings
    base_weights = {
        name.replace("base_model.model.", "").replace(".base_layer", "").replace(".original_module", ""): value
        for name, value in model.state_dict().items()
        if "lora_" not in name and "modules_to_save" not in name
    }
    assert_same_weights(base_weights, reference)
    assert torch.equal(
        model.state_dict()["base_model.model.transformer.ln_f.modules_to_save.default.weight"],
        reference["transformer.ln_f.weight"],
    )
    adapters = {name: value for name, value in model.state_dict().items() if "lora_" in name}
    assert_same_weights(adapters, built)
    lora_a = [value for name, value in adapters.items() if "lora_A" in name]
    assert all(value.abs().sum() > 0 for value in lora_a)  # made as usual: random, not left on meta
    assert all(not value.abs().sum() for name, value in adapters.items() if "lora_B" in name)


class Tied(nn.Module):
    """An embedding of 65 rows (fsdp's shards: 33 and 32), a layer, and an output layer tied to the embedding."""

    def __init__(self):
        super().__init__()
        self.embed, self.layer, self.head = nn.Embedding(65, 32), nn.Linear(32, 32), nn.Linear(32, 65, bias=False)
        self.head.weight = self.embed.weight


def shard_and_load(rank, world_size, store_path, path, results):
    """Tied built on meta, sharded by fully_shard over 2 gloo ranks and loaded from `path` in blocks of 600 bytes;
    each tensor's full value (gathered) and the largest tensor any broadcast carried."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size)
    try:
        pretrained.BLOCK_BYTES = 600
        sent, broadcast = [], dist.broadcast

        def recorded(tensor, *args, **kwargs):
            sent.append(tensor.nbytes)
            return broadcast(tensor, *args, **kwargs)

        dist.broadcast = recorded
        with pretrained.parameters_on_meta():
            model = Tied()
        fully_shard(model.layer)
        fully_shard(model)
        pretrained.materialize(model, torch.device("cpu"))
        pretrained.load(model, path, DistEnv(rank=rank, world_size=world_size))
        results[rank] = ({name: value.full_tensor() for name, value in model.state_dict().items()}, max(sent))
    finally:
        dist.destroy_process_group()


def test_under_fsdp_each_rank_gets_exactly_its_rows_with_one_block_in_flight(tmp_path):
    torch.manual_seed(0)
    saved = {name: value for name, value in Tied().state_dict().items() if name != "head.weight"}  # tied: once
    pytest.importorskip("safetensors.torch").save_file(saved, tmp_path / "tied.safetensors")
    results = mp.Manager().dict()
    mp.spawn(shard_and_load, args=(2, tmp_path / "store", str(tmp_path / "tied.safetensors"), results), nprocs=2)
    for rank in range(2):
        state, largest = results[rank]
        assert_same_weights(state, {**saved, "head.weight": saved["embed.weight"]})
        assert largest <= 600  # the embedding alone is 8320 bytes


# -- under fsdp, for real: a peft model with a 0-d parameter and a buffer made from a parameter ----------------------

FEATURES, CLASSES = 8, 4
SCALED_DATA = f"""
import torch
from torch.utils.data import TensorDataset


def build_datasets(cfg):
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(256, {FEATURES}, generator=generator)
    return TensorDataset(inputs, torch.randint(0, {CLASSES}, (256,), generator=generator)), None
"""
SCALED = """
import os

import peft

FEATURES, CLASSES = 8, 4


class Scaled(nn.Module):
    \"\"\"A 0-d parameter (as CLIP's logit_scale), and a buffer __init__ makes from a parameter, saved nowhere.\"\"\"

    def __init__(self, features, classes):
        super().__init__()
        self.embed, self.proj, self.head = nn.Linear(features, 16), nn.Linear(16, 16), nn.Linear(16, classes)
        self.logit_scale = nn.Parameter(torch.tensor(0.5))
        self.register_buffer("mask", torch.ones_like(self.proj.weight), persistent=False)

    def forward(self, x):
        if not torch.equal(self.mask, torch.ones_like(self.mask)):
            raise ValueError("the mask is not what __init__ made")
        hidden = torch.relu(self.proj(torch.relu(self.embed(x)))) @ self.mask / 16
        return self.head(hidden) * self.logit_scale.exp()


def build_model(cfg, train_dataset):
    lora = peft.LoraConfig(r=4, target_modules=["proj"])
    model = peft.get_peft_model(Scaled(FEATURES, CLASSES), lora)
    model.get_base_model().logit_scale.requires_grad_(True)  # trains beside the adapters
    return model


def loss_fn(outputs, targets):
    return nn.functional.cross_entropy(outputs, targets)


def build_optimizer(cfg, model):
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr)


def shard_units(model):
    return [model.get_base_model().embed, model.get_base_model().proj]


def pretrained_weights(cfg):
    return os.environ["WEIGHTS"]
"""


def scaled_weights(seed):
    torch.manual_seed(seed)
    layers = {"embed": nn.Linear(FEATURES, 16), "proj": nn.Linear(16, 16), "head": nn.Linear(16, CLASSES)}
    weights = {
        f"{name}.{kind}": getattr(layer, kind).detach() for name, layer in layers.items() for kind in ("weight", "bias")
    }
    return {**weights, "logit_scale": torch.tensor(0.25 * seed)}


def test_under_fsdp_a_peft_model_with_a_0_d_parameter_starts_from_its_weights_and_resumes_bitwise(tmp_path):
    """Two ranks, --strategy fsdp: the base's weights loaded into a peft model built on meta (its adapters made as
    usual), a buffer made from a parameter's shape holds its values (forward checks), a 0-d parameter trains whole
    on every rank; a resume from a snapshot of step 4 ends bitwise equal to the run that went on. A resume whose
    pretrained_weights changed says once that the snapshot wins."""
    pytest.importorskip("peft")
    workspace = project(tmp_path, model=SCALED, data=SCALED_DATA)  # data and hooks of its own: any model.py
    first, second = scaled_weights(1), scaled_weights(2)
    pytest.importorskip("safetensors.torch").save_file(first, tmp_path / "first.safetensors")
    torch.save(second, tmp_path / "second.pt")
    args = EXACT + ["--strategy", "fsdp", "--max-steps", "6", "--snapshot-every", "2", "--eval-every", "0"]

    def train(name, weights):
        cmd = train_cmd(2, script=str(workspace / "train.py")) + args + outputs(tmp_path, name)
        env = child_env(PYTHONPATH=workspace, WEIGHTS=str(tmp_path / weights))
        return run(cmd, env=env, cwd=workspace).stdout

    train("run", "first.safetensors")
    assert summary(tmp_path)["steps"] == 6
    reference = torch.load(tmp_path / "run-export" / "model.pt", weights_only=True)
    base = {
        name.replace("base_model.model.", "").replace("base_layer.", ""): value for name, value in reference.items()
    }
    for name in ("embed.weight", "proj.weight", "head.bias"):  # frozen: still the file's
        assert torch.equal(base[name], first[name]), name
    assert reference["base_model.model.logit_scale"] != first["logit_scale"]  # trained
    assert reference["base_model.model.proj.lora_B.default.weight"].abs().sum() > 0  # trained from zeros

    shutil.copytree(tmp_path / "run-snapshots", tmp_path / "again-snapshots")
    shutil.rmtree(tmp_path / "again-snapshots" / "step-00000006")
    out = train("again", "second.pt")
    assert (summary(tmp_path, "again")["resumed_from"], summary(tmp_path, "again")["steps"]) == (4, 6)
    assert_same_weights(torch.load(tmp_path / "again-export" / "model.pt", weights_only=True), reference)
    said = [line for line in out.splitlines() if "second.pt" in line and "WARNING" in line]
    assert len(said) == 1 and "first.safetensors" in said[0] and "--resume never" in said[0], out[-3000:]
