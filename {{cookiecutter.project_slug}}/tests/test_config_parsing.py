"""The settings adapter in one process: flags, types, constraints, --config files, to_toml, the demo block."""

from __future__ import annotations  # the adapter must resolve string annotations, so this file uses them too

import dataclasses
import importlib.util
import math
import sys
from dataclasses import dataclass

import pytest
from conftest import QUICK, ROOT, outputs, run, train_cmd

sys.path.insert(0, str(ROOT))

from {{ cookiecutter.project_slug }} import config
from {{ cookiecutter.project_slug }}.config import option
from {{ cookiecutter.project_slug }}.machinery import runsettings

DEMO_START = "# --- demo settings: delete them with the demo model and data ---"
DEMO_END = "# --- end of demo settings ---"


@dataclass
class Extra:
    """A config of the user's own, with the types and constraints Config does not happen to use."""

    steps: int | None = option(None, "optional integer, at least 1", min=1)
    label: str | None = option("base", "optional string")
    ratio: float = option(0.5, "strictly between 0 and 1", above=0, below=1)
    limit: float = option(math.inf, "any float, infinity included", finite=False)
    mode: str | None = option(None, "optional choice", choices=("a", "b"))
    scale: float = 1.0  # a plain field: no help, no bounds, but finite like every float
    fast: bool = True


def refused(argv, capsys, config_cls=config.Config):
    """Parse argv expecting a refusal: return the error line after checking the exit code is argparse's 2."""
    with pytest.raises(SystemExit) as stopped:
        config.parse_args(argv, config_cls=config_cls)
    assert stopped.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1
    return errors[0]


def write(tmp_path, text, name="run.toml"):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return str(path)


def test_every_field_has_a_flag_with_its_default():
    cfg = config.parse_args([])
    for spec in dataclasses.fields(config.Config):
        if spec.name != "wandb":  # '' stands for "decide at run time", resolved by parse_args
            assert getattr(cfg, spec.name) == spec.default
    assert cfg.wandb in runsettings.WANDB_MODES
    assert config.flag("batch_size") == "--batch-size"
    help_text = config.build_parser().format_help()
    assert all(config.flag(spec.name) in help_text for spec in dataclasses.fields(config.Config))


def test_bool_flags_come_in_pairs(capsys):
    assert config.parse_args([]).compile is False
    assert config.parse_args(["--compile"]).compile is True
    assert config.parse_args(["--compile", "--no-compile"]).compile is False
    refused(["--compile", "False"], capsys)
    assert config.parse_args([], config_cls=Extra).fast is True
    assert config.parse_args(["--no-fast"], config_cls=Extra).fast is False


def test_optional_fields_and_postponed_annotations(capsys):
    assert config.parse_args([], config_cls=Extra) == Extra()
    assert config.parse_args(["--steps", "5"], config_cls=Extra).steps == 5
    assert config.parse_args(["--steps", "None"], config_cls=Extra).steps is None
    assert config.parse_args(["--label", "NONE"], config_cls=Extra).label is None
    assert config.parse_args(["--label", ""], config_cls=Extra).label is None
    assert config.parse_args(["--label", "x"], config_cls=Extra).label == "x"
    assert config.parse_args(["--mode", "b"], config_cls=Extra).mode == "b"
    assert config.parse_args(["--mode", "none"], config_cls=Extra).mode is None
    assert "--steps" in refused(["--steps", "0"], capsys, Extra)
    assert "--steps" in refused(["--steps", "x"], capsys, Extra)
    assert "--mode" in refused(["--mode", "c"], capsys, Extra)


def test_flags_must_be_spelled_out(tmp_path, capsys):
    # A prefix that argparse would complete could also hide --config from the pass that reads the file.
    refused(["--batch", "4"], capsys)
    refused(["--conf", write(tmp_path, "batch_size = 4\n")], capsys)


def test_unsupported_field_types_are_refused_when_the_parser_is_built(capsys):
    @dataclass
    class Tables:
        sizes: dict[str, int] = dataclasses.field(default_factory=dict)

    @dataclass
    class Nested:
        sizes: list[list[int]] = dataclasses.field(default_factory=list)

    @dataclass
    class Flags:
        sizes: list[bool] = dataclasses.field(default_factory=list)

    for unsupported in (Tables, Nested, Flags):
        with pytest.raises(TypeError, match="sizes"):
            config.build_parser(unsupported)
        # at the command line, --help too: one line naming the field and the types there are, exit 2
        for argv in (["--help"], []):
            with pytest.raises(SystemExit) as stopped:
                config.parse_args(argv, unsupported)
            err = capsys.readouterr().err
            assert stopped.value.code == 2 and err.count("\n") == 1 and "sizes" in err and "list[int" in err, err


@dataclass
class Lists:
    """Settings that hold several values, and optional ones of every kind."""

    lora_targets: list[str] = option(["c_attn"], "modules that get adapters")
    sizes: tuple[int, ...] = option((1, 2), "positive sizes", min=1)
    rates: list[float] | None = option(None, "optional rates")
    layers: tuple[int, ...] | None = option((0,), "optional layers, some by default")
    pair: list[int] = option([1, 2], "exactly two", check=lambda v: None if len(v) == 2 else f"needs 2, got {len(v)}")
    strict: bool | None = option(None, "an optional bool")
    names: list[str] = dataclasses.field(default_factory=list)  # a plain field with a factory


def test_lists_and_tuples_from_the_command_line(capsys):
    assert config.parse_args([], config_cls=Lists) == Lists()
    assert Lists().lora_targets is not Lists().lora_targets  # each config has its own default list
    cfg = config.parse_args(
        ["--lora-targets", "c_attn", "c_proj", "--sizes", "3", "--rates", "0.5", "2", "--names"], config_cls=Lists
    )
    assert (cfg.lora_targets, cfg.sizes, cfg.rates, cfg.names) == (["c_attn", "c_proj"], (3,), [0.5, 2.0], [])
    assert type(cfg.sizes) is tuple and type(cfg.rates[1]) is float
    assert config.parse_args(["--layers", "none"], config_cls=Lists).layers is None
    assert config.parse_args(["--layers"], config_cls=Lists).layers == ()
    assert config.parse_args(["--lora-targets", "none"], config_cls=Lists).lora_targets == ["none"]  # not optional
    assert "--sizes" in refused(["--sizes", "1", "x"], capsys, Lists)
    assert "--sizes" in refused(["--sizes", "1", "0"], capsys, Lists)  # the bounds apply to each item
    assert "--pair" in refused(["--pair", "1", "2", "3"], capsys, Lists)  # check sees the whole list
    assert "--lora-targets [STR ...]" in config.build_parser(Lists).format_help()


def test_lists_and_tuples_from_toml_and_back(tmp_path, capsys):
    path = write(tmp_path, 'lora_targets = ["c_attn", "c_proj"]\nsizes = [4]\nrates = [1, 0.25]\nlayers = "none"\n')
    cfg = config.parse_args(["--config", path], config_cls=Lists)
    assert (cfg.lora_targets, cfg.sizes, cfg.rates, cfg.layers) == (["c_attn", "c_proj"], (4,), [1.0, 0.25], None)
    assert config.parse_args(["--config", path, "--sizes", "5", "6"], config_cls=Lists).sizes == (5, 6)
    for changed in (
        cfg,
        Lists(lora_targets=[], rates=[], strict=False, names=['a "quoted"\n', "é"]),
        Lists(layers=(-3, 2**40), rates=[math.pi, 5e-324], strict=True),
    ):
        back = write(tmp_path, config.to_toml(changed), "back.toml")
        assert config.parse_args(["--config", back], config_cls=Lists) == changed
    assert 'lora_targets = ["c_attn", "c_proj"]' in config.to_toml(cfg).splitlines()
    for text in ('lora_targets = "c_attn"\n', "sizes = [1, 2.5]\n", 'rates = [1, "x"]\n', "sizes = [0]\n"):
        key = text.split(" ")[0]
        assert key in refused(["--config", write(tmp_path, text)], capsys, Lists)


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--epochs", "0"], "--epochs"),
        (["--max-steps", "-1"], "--max-steps"),
        (["--lr", "0"], "--lr"),
        (["--lr", "-1"], "--lr"),
        (["--lr", "11"], "--lr"),
        (["--lr", "nan"], "--lr"),
        (["--lr", "inf"], "--lr"),
        (["--lr", "1e309"], "--lr"),
        (["--weight-decay", "nan"], "--weight-decay"),
        (["--weight-decay", "1.5"], "--weight-decay"),
        (["--clip-grad", "-0.5"], "--clip-grad"),
        (["--clip-grad", "inf"], "--clip-grad"),  # no upper bound: only the finiteness rule stops these
        (["--clip-grad", "1e309"], "--clip-grad"),
        (["--clip-grad", "nan"], "--clip-grad"),
        (["--seed", "-1"], "--seed"),
        (["--seed", str(2**32)], "--seed"),
        (["--keep-snapshots", "1"], "--keep-snapshots"),
        (["--snapshot-dir", ""], "--snapshot-dir"),
        (["--export-dir", ""], "--export-dir"),
        (["--resume", "sometimes"], "--resume"),
        (["--dist-timeout", "0"], "--dist-timeout"),
        (["--dist-timeout", str(8 * 24 * 3600)], "--dist-timeout"),
        (["--eval-every", "-1"], "--eval-every"),
        (["--epochs", str(2**63)], "--epochs"),  # no upper bound: only the 64-bit rule stops these
        (["--max-steps", "9" * 400], "--max-steps"),
        (["--threads-per-rank", str(2**63 - 1)], "--threads-per-rank"),  # torch.set_num_threads would raise
        (["--num-workers", "100000"], "--num-workers"),  # as many processes per rank
    ],
)
def test_values_outside_a_fields_constraints_are_refused(capsys, argv, flag):
    assert flag in refused(argv, capsys)


@pytest.mark.parametrize(
    "argv",
    [
        ["--seed", "0"],
        ["--seed", str(2**32 - 1)],
        ["--keep-snapshots", "2"],
        ["--lr", "10"],
        ["--lr", "1e-12"],
        ["--max-steps", "0"],
        ["--clip-grad", "0"],
        ["--weight-decay", "1"],
        ["--eval-every", "0"],
        ["--resume", "never"],
        ["--dist-timeout", str(7 * 24 * 3600)],
        ["--max-steps", str(2**63 - 1)],
    ],
)
def test_values_on_a_bound_that_allows_them_are_accepted(argv):
    cfg = config.parse_args(argv)
    value = getattr(cfg, argv[0][2:].replace("-", "_"))
    assert str(value) == argv[1] or float(value) == float(argv[1])


def test_exclusive_bounds_and_the_finite_opt_out(capsys):
    assert config.parse_args(["--ratio", "0.999"], config_cls=Extra).ratio == 0.999
    for bad in ("0", "1", "nan"):
        assert "--ratio" in refused(["--ratio", bad], capsys, Extra)
    assert config.parse_args(["--limit", "inf"], config_cls=Extra).limit == math.inf
    assert config.parse_args(["--limit", "1e309"], config_cls=Extra).limit == math.inf
    assert config.parse_args(["--scale=-1e300"], config_cls=Extra).scale == -1e300
    for bad in ("nan", "-inf", "1e309"):
        assert "--scale" in refused([f"--scale={bad}"], capsys, Extra)


def test_config_file_with_command_line_overrides(tmp_path):
    path = write(
        tmp_path, 'batch_size = 64\nlr = 1\n"snapshot-dir" = "from-file"\ncompile = true\namp = "bf16"\nseed = 7\n'
    )
    cfg = config.parse_args(["--config", path, "--batch-size", "8", "--no-compile"])
    assert (cfg.batch_size, cfg.compile) == (8, False)  # the command line wins
    assert (cfg.lr, cfg.snapshot_dir, cfg.amp, cfg.seed) == (1.0, "from-file", "bf16", 7)  # the file beats defaults
    assert type(cfg.lr) is float
    assert cfg.epochs == config.Config.epochs  # neither: the default
    assert config.parse_args(["--config", path]).compile is True


def test_config_file_optional_values(tmp_path):
    cfg = config.parse_args(["--config", write(tmp_path, 'steps = 4\nlabel = "none"\nmode = "a"\n')], config_cls=Extra)
    assert (cfg.steps, cfg.label, cfg.mode) == (4, None, "a")


@pytest.mark.parametrize(
    "text, names",
    [
        ("batch_sise = 4\n", ["batch_sise"]),  # unknown key
        ('epochs = "3"\n', ["epochs"]),  # a string for an integer
        ("epochs = true\n", ["epochs"]),  # a boolean is not an integer in TOML
        ("lr = 0.5\nepochs = 2.0\n", ["epochs"]),  # a float for an integer
        ('compile = "yes"\n', ["compile"]),
        ("lr = -1.0\n", ["--lr", "lr"]),  # the file's values meet the same constraints as flags
        ("lr = nan\n", ["--lr", "lr"]),
        ('amp = "fp8"\n', ["--amp", "amp"]),
        ('snapshot_dir = ""\n', ["--snapshot-dir"]),
        ("batch_size = 4\nbatch-size = 5\n", ["batch_size"]),  # the same setting twice
        ("[optimizer]\nlr = 0.1\n", ["optimizer"]),  # tables are not settings
        ("epochs = \n", []),  # not TOML
    ],
)
def test_bad_config_files_are_refused_naming_the_key_and_the_file(tmp_path, capsys, text, names):
    path = write(tmp_path, text)
    error = refused(["--config", path], capsys)
    assert path in error
    for name in names:
        assert name in error


@pytest.mark.parametrize(
    "data",
    [
        b"lr = " + b"1" * 400 + b"\n",  # an integer no float holds
        b"epochs = " + b"1" * 400 + b"\n",  # an integer no int64 holds
        b"seed = " + b"1" * 5000 + b"\n",  # more digits than Python converts
        b'lr = 0.1\nlog_file = "\xff\xfe"\n',  # not UTF-8
        b'log_file = "run\\u0000.log"\n',  # a NUL in a path
        b"lr = " + b"[" * 5000 + b"]" * 5000 + b"\n",  # nested deeper than Python recurses
        b"# a comment\n" * 100_000,  # valid TOML, but more than a settings file holds (also: /dev/zero)
    ],
    ids=["float-400-digits", "int-400-digits", "int-5000-digits", "not-utf8", "nul", "nested", "over-1-MiB"],
)
def test_any_bytes_in_a_config_file_are_one_line_from_train_py(tmp_path, data):
    """train.py refuses the file before training: exit code 2, one error line naming --config and the file."""
    path = tmp_path / "run.toml"
    path.write_bytes(data)
    result = run(train_cmd() + ["--config", str(path)] + QUICK + outputs(tmp_path), check=False, timeout=60)
    assert result.returncode == 2, result.stdout[-3000:]
    assert "Traceback" not in result.stdout
    errors = [line for line in result.stdout.splitlines() if "error:" in line]
    assert len(errors) == 1 and f"--config {path}" in errors[0], result.stdout[-3000:]
    assert not any(tmp_path.glob("run-*")) and not (tmp_path / "run.log").exists()  # nothing trained or written


def test_missing_config_file_is_refused(tmp_path, capsys):
    path = str(tmp_path / "absent.toml")
    assert path in refused(["--config", path], capsys)


def test_a_bad_file_value_is_fine_when_the_command_line_replaces_it(tmp_path):
    path = write(tmp_path, "lr = -1.0\n")
    assert config.parse_args(["--config", path, "--lr", "0.1"]).lr == 0.1


def test_to_toml_reads_back_to_the_same_config(tmp_path):
    tricky = 'a "quoted" \\ back\\slash, tab\t, newline\n, del\x7f, unicode é 😀, {rank} %s'
    cfg = dataclasses.replace(
        config.parse_args(["--compile", "--amp", "fp16", "--seed", str(2**32 - 1)]),
        log_file=tricky,
        wandb_project="ünïcode'project",
        metrics_file="",
        lr=0.1 + 0.2,
        dist_timeout=1e-3,
        weight_decay=5e-324,  # the smallest subnormal float
    )
    path = write(tmp_path, config.to_toml(cfg))
    assert config.parse_args(["--config", path]) == cfg

    extra = Extra(steps=None, label=None, mode="b", limit=math.inf)
    extra_path = write(tmp_path, config.to_toml(extra), "extra.toml")
    assert config.parse_args(["--config", extra_path], config_cls=Extra) == extra


def test_config_round_trips_through_to_dict():
    cfg = config.parse_args(["--batch-size", "3"])
    assert config.Config(**cfg.to_dict()) == cfg


def test_deleting_the_demo_block_leaves_a_working_config(tmp_path, monkeypatch):
    source = (ROOT / "{{ cookiecutter.project_slug }}" / "config.py").read_text(encoding="utf-8")
    lines = source.splitlines(keepends=True)
    starts = [i for i, line in enumerate(lines) if line.strip() == DEMO_START]
    ends = [i for i, line in enumerate(lines) if line.strip() == DEMO_END]
    if not starts and not ends:
        pytest.skip("config.py has no demo settings any more")
    assert len(starts) == 1 and len(ends) == 1 and starts[0] < ends[0]
    stripped_source = "".join(lines[: starts[0]] + lines[ends[0] + 1 :])

    name = "{{ cookiecutter.project_slug }}.config_without_demo"
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(name, loader=None))
    module.__package__ = "{{ cookiecutter.project_slug }}"
    monkeypatch.setitem(sys.modules, name, module)  # get_type_hints looks the module up by name
    exec(compile(stripped_source, str(tmp_path / "config.py"), "exec"), module.__dict__)

    demo_free = module.Config
    kept = {spec.name: spec.default for spec in dataclasses.fields(demo_free)}
    every = {spec.name: spec.default for spec in dataclasses.fields(config.Config)}
    assert kept.items() < every.items()  # the demo settings went, the others stayed with their defaults
    cfg = module.parse_args(["--batch-size", "4", "--compile"])
    assert (cfg.batch_size, cfg.compile) == (4, True)
    path = write(tmp_path, module.to_toml(cfg))
    assert module.parse_args(["--config", path]) == cfg
    assert "--batch-size" in module.build_parser().format_help()
