"""A settings dataclass as a command line (`batch_size` -> `--batch-size`, `--compile/--no-compile`, list items after
their flag) and as a TOML file (`--config run.toml`, overridden by flags); `option(32, "...", min=1)` declares the
values a field accepts. Plain argparse, no torch: `--help` and a mistyped flag answer before torch loads.
"""

from __future__ import annotations

import argparse
import builtins
import dataclasses
import difflib
import inspect
import math
import operator
import re
import sys
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

NONE_WORDS = ("", "none")  # what an optional field reads as None, on the command line and in a config file
COMPARISONS = {">=": operator.ge, ">": operator.gt, "<=": operator.le, "<": operator.lt}
INT_LIMIT = 2**63  # an integer setting lies in [-INT_LIMIT, INT_LIMIT): what torch and numpy integers hold
MAX_CONFIG_BYTES = 1 << 20  # a settings file is small: a larger one (or /dev/zero) is not one


@dataclass(frozen=True)
class Rules:
    """The values a field accepts. Bounds: min/max inclusive, above/below exclusive."""

    choices: tuple | None = None
    min: float | None = None
    max: float | None = None
    above: float | None = None
    below: float | None = None
    nonempty: bool = False  # refuse ''
    finite: bool = True  # refuse nan and +-inf in float fields
    reason: str = ""  # why the bounds are what they are, shown when a value breaks them
    check: Callable[[Any], str | None] | None = None  # a rule of its own: what is wrong with a value, or None

    def problem(self, value: Any) -> str | None:
        """What is wrong with `value` ("must be > 0, got -1.0"), or None when it is allowed. For a list or tuple,
        `check` sees the whole value and the other rules each item."""
        if value is None:
            return None
        found = self.check(value) if self.check is not None else None
        if found:
            return found
        if isinstance(value, (list, tuple)):
            items = dataclasses.replace(self, check=None)
            problems = [problem for problem in map(items.problem, value) if problem]
            return problems[0] if problems else None
        if self.choices is not None and value not in self.choices:
            return f"must be one of {', '.join(map(str, self.choices))}, got {short_repr(value)}"
        if self.nonempty and value == "":
            return "must not be empty"
        if isinstance(value, float) and self.finite and not math.isfinite(value):
            return f"must be a finite number, got {value}"
        limits = {">=": self.min, ">": self.above, "<=": self.max, "<": self.below}
        bounds = [(sign, bound) for sign, bound in limits.items() if bound is not None]
        if all(COMPARISONS[sign](value, bound) for sign, bound in bounds):  # nan fails every comparison
            if type(value) is int and not -INT_LIMIT <= value < INT_LIMIT:
                return f"must be an integer of at most 64 bits, got {short_repr(value)}"
            return None
        allowed = " and ".join(f"{sign} {bound}" for sign, bound in bounds)
        why = f" ({self.reason})" if self.reason else ""
        return f"must be {allowed}{why}, got {short_repr(value, quote=False)}"


def short_repr(value: Any, quote: bool = True, limit: int = 60) -> str:
    """`value` for a one-line message: its repr, cut short when long. quote=False: a number, or a string of printable
    characters, as it is (str)."""
    try:
        plain = not quote and (not isinstance(value, str) or value.isprintable())
        text = str(value) if plain else repr(value)
    except ValueError:  # an integer of more digits than Python converts to text
        return f"an integer of {value.bit_length()} bits"
    if len(text) <= limit:
        return text
    return f"{text[: limit // 2]}...{text[-10:]} ({len(text)} characters)"


def cut_short(names: Sequence[str], shown: int, separator: str = ", ") -> str:
    """The first `shown` names, joined, and how many more there are: "a, b and 4 more"."""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return separator.join(names[:shown]) + more


def first_line(exc: BaseException) -> str:
    """An exception for a one-line message: its type and the first line of what it says, cut short."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:200]}" if lines else type(exc).__name__


class RunError(Exception):
    """A problem the user fixes (settings, data, machine, an unfitting snapshot): reported as one line, no traceback."""


def option(
    default: Any,
    help: str,
    *,
    choices: Sequence | None = None,
    min: float | None = None,
    max: float | None = None,
    above: float | None = None,
    below: float | None = None,
    nonempty: bool = False,
    finite: bool = True,
    reason: str = "",
    check: Callable[[Any], str | None] | None = None,
) -> Any:
    """A config field: its default, its help text (shown by --help; write % as %%) and the values it accepts
    (`check`: a function of the value that says what is wrong with it, or returns None). For a list or tuple
    setting, the bounds and choices apply to each item, `check` to the whole."""
    rules = Rules(
        tuple(choices) if choices is not None else None, min, max, above, below, nonempty, finite, reason, check
    )
    metadata = {"help": help, "rules": rules}
    if isinstance(default, list):  # a dataclass refuses a mutable default: each config gets a copy of it
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def step_range(text: str) -> tuple[int, int] | None:
    """`A:B` (optimizer steps A to B, counted from 1) as (A, B); None for ''; ValueError for anything else."""
    if not text:
        return None
    found = re.fullmatch(r"\s*([0-9]{1,18})\s*:\s*([0-9]{1,18})\s*", text)
    if found is None:
        raise ValueError(f"must be A:B with whole numbers (optimizer steps, counted from 1), got {short_repr(text)}")
    start, end = int(found[1]), int(found[2])
    if not 1 <= start <= end:
        raise ValueError(f"must be A:B with 1 <= A <= B, got {short_repr(text)}")
    return start, end


def step_range_problem(text: str) -> str | None:
    """What is wrong with a step range (`step_range`), or None: a `check` for option()."""
    try:
        step_range(text)
    except ValueError as exc:
        return str(exc)
    return None


SCALARS = (bool, int, float, str)
SettingsT = TypeVar("SettingsT")  # Config, or a settings dataclass of the user's own
TYPE_WORDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


@dataclass(frozen=True)
class Setting:
    """One field of a config dataclass, as the command line and config files see it."""

    name: str
    type: builtins.type  # one of SCALARS: the field's, or each item's when `container` is set
    optional: bool  # also accepts None
    default: Any
    help: str
    rules: Rules
    container: builtins.type | None = None  # list or tuple (of `type`), or None for a single value


def settings(config_cls: type) -> list[Setting]:
    """The fields of `config_cls` with their resolved types; a TypeError for a field the adapter cannot express."""
    hints = typing.get_type_hints(config_cls)  # resolves string annotations (from __future__ import annotations)
    found = []
    for spec in dataclasses.fields(config_cls):
        hint, optional = hints[spec.name], False
        if typing.get_origin(hint) in (typing.Union, types.UnionType):
            rest = [arg for arg in typing.get_args(hint) if arg is not type(None)]
            optional = len(rest) < len(typing.get_args(hint))
            hint = rest[0] if optional and len(rest) == 1 else hint
        container, args = typing.get_origin(hint), typing.get_args(hint)
        if (container is list and len(args) == 1) or (container is tuple and args[1:] == (Ellipsis,)):
            hint = args[0]
        else:
            container = None
        if hint not in SCALARS or (container is not None and hint is bool):
            raise TypeError(
                f"{config_cls.__name__}.{spec.name}: type {hints[spec.name]} is not supported (use int, float, str, "
                "bool, list[int | float | str], tuple[int | float | str, ...], or one of them | None)"
            )
        default = spec.default
        if default is dataclasses.MISSING:
            if spec.default_factory is dataclasses.MISSING:
                raise TypeError(f"{config_cls.__name__}.{spec.name} needs a default")
            default = spec.default_factory()
        meta = spec.metadata
        found.append(
            Setting(spec.name, hint, optional, default, meta.get("help", ""), meta.get("rules", Rules()), container)
        )
    return found


def flag(name: str) -> str:
    """The command-line flag of a field: batch_size -> --batch-size."""
    return "--" + name.replace("_", "-")


def _or_none(convert):
    """An argparse type for an optional field: NONE_WORDS (any case) mean None, anything else goes to convert."""

    def parse(text: str):
        return None if text.strip().lower() in NONE_WORDS else convert(text)

    parse.__name__ = convert.__name__  # argparse names it in "invalid int value: 'x'"
    return parse


class _Items(argparse.Action):
    """The items after a list or tuple flag, each converted to the setting's type; a lone NONE_WORDS item is None
    for an optional setting."""

    def __init__(self, *args: Any, setting: Setting, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.setting = setting

    def __call__(self, parser, namespace, values, option_string=None):
        setting = self.setting
        if setting.optional and len(values) == 1 and values[0].strip().lower() in NONE_WORDS:
            setattr(namespace, self.dest, None)
            return
        items = []
        for text in values:
            try:
                items.append(setting.type(text))
            except ValueError:
                raise argparse.ArgumentError(self, f"invalid {setting.type.__name__} value: {text!r}") from None
        assert setting.container is not None
        setattr(namespace, self.dest, setting.container(items))


def build_parser(config_cls: type) -> argparse.ArgumentParser:
    """The command line of `config_cls`: one flag per field, --x/--no-x for bools, and --config FILE."""
    parser = argparse.ArgumentParser(
        prog="train.py",
        description="Train with DistributedDataParallel. Runs as `python train.py` or under torchrun.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        allow_abbrev=False,  # a prefix must not quietly pick a flag (or hide --config from the first pass)
    )
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="read settings from this TOML file (keys are setting names, "
        "e.g. batch_size = 64); flags on the command line override it",
    )
    fields = settings(config_cls)
    owners = [declared_by(config_cls, setting.name) for setting in fields]
    # One group per class that declares settings, the class's own first (its settings may override the others').
    order = sorted(dict.fromkeys(owners), key=lambda owner: owner is not config_cls)
    groups = {owner: parser.add_argument_group(group_title(owner)) for owner in order}
    for setting, owner in zip(fields, owners, strict=True):
        kind: dict[str, Any]
        if setting.type is bool:
            kind = {"action": argparse.BooleanOptionalAction}
        elif setting.container is not None:
            kind = {"nargs": "*", "metavar": setting.type.__name__.upper(), "action": _Items, "setting": setting}
        else:
            choices = setting.rules.choices
            kind = {
                "type": _or_none(setting.type) if setting.optional else setting.type,
                "choices": (*choices, None) if choices is not None and setting.optional else choices,
            }
        groups[owner].add_argument(
            flag(setting.name), dest=setting.name, default=setting.default, help=setting.help, **kind
        )
    return parser


def declared_by(config_cls: type, name: str) -> type:
    """The class that declares field `name` of `config_cls` (the last to, when a subclass declares it again)."""
    return next((owner for owner in config_cls.__mro__ if name in inspect.get_annotations(owner)), config_cls)


def group_title(owner: type) -> str:
    """The --help group of the settings `owner` declares: the first line of its docstring."""
    doc = owner.__dict__.get("__doc__") or ""
    if doc and not doc.startswith(f"{owner.__name__}("):  # dataclass writes its signature where none is
        return doc.strip().splitlines()[0]
    return f"settings of {owner.__name__}"


def _toml_kind(value: Any) -> str:
    kinds = {bool: "a boolean", int: "an integer", float: "a float", str: "a string", dict: "a table", list: "an array"}
    return kinds.get(type(value), "a date or time")


def _from_toml(setting: Setting, value: Any) -> Any:
    """The value of `setting` a TOML value stands for; ValueError when its TOML type does not fit."""
    if setting.optional and isinstance(value, str) and value.strip().lower() in NONE_WORDS:
        return None
    if setting.container is not None:
        if not isinstance(value, list):
            raise ValueError(
                f"must be an array of {TYPE_WORDS[setting.type].removeprefix('a ').removeprefix('an ')}s"
                f"{' or none' if setting.optional else ''}, got {_toml_kind(value)} ({short_repr(value)})"
            )
        item = dataclasses.replace(setting, optional=False, container=None)
        try:
            return setting.container(_from_toml(item, each) for each in value)
        except ValueError as exc:
            raise ValueError(f"items {exc}") from None
    if setting.type is float and type(value) is int:
        try:
            return float(value)  # `lr = 1` means 1.0
        except OverflowError:
            raise ValueError(f"must be a number, got an integer too large for a float ({short_repr(value)})") from None
    if type(value) is setting.type:  # exact: TOML true is not an integer
        if type(value) is str and "\0" in value:
            raise ValueError(f"must not hold a NUL character (\\u0000), got {short_repr(value)}")
        return value
    raise ValueError(
        f"must be {TYPE_WORDS[setting.type]}{' or none' if setting.optional else ''}, "
        f"got {_toml_kind(value)} ({short_repr(value)})"
    )


def read_config_file(path: str, config_cls: type) -> dict[str, Any]:
    """The settings a TOML file sets, by field name; ValueError with one line naming the file on any problem, and no
    other exception whatever the file holds (any bytes, any size, values of any type or magnitude)."""
    try:
        with open(path, "rb") as handle:
            data = handle.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ValueError(f"--config {path}: cannot read it: {exc.strerror or exc}") from exc
    if len(data) > MAX_CONFIG_BYTES:
        raise ValueError(f"--config {path}: larger than {MAX_CONFIG_BYTES >> 20} MiB, so not a settings file")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise ValueError(
            f"--config {path}: not UTF-8 text (byte 0x{data[exc.start]:02x} on line {line}); TOML files are UTF-8"
        ) from None
    try:
        table = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"--config {path}: not valid TOML: {exc}") from None
    except RecursionError:
        raise ValueError(f"--config {path}: not a settings file: arrays or tables nested too deeply") from None
    except ValueError as exc:  # e.g. an integer of more digits than Python converts
        raise ValueError(f"--config {path}: not a settings file: {exc}") from None
    by_name = {setting.name: setting for setting in settings(config_cls)}
    values: dict[str, Any] = {}
    for key, value in table.items():
        name = key.replace("-", "_")
        if name not in by_name:
            close = difflib.get_close_matches(name, by_name, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"--config {path}: unknown setting {short_repr(key)}{hint}")
        if name in values:
            raise ValueError(f"--config {path}: {name!r} is set twice")
        try:
            values[name] = _from_toml(by_name[name], value)
        except ValueError as exc:
            raise ValueError(f"--config {path}: {short_repr(key)} {exc}") from None
    return values


def parse_args(argv: Sequence[str] | None, config_cls: type[SettingsT]) -> SettingsT:
    """Settings from --config FILE, then the command line on top; exit 2 with one line on the first bad value, or on
    a field of a type no flag can express (at any command line, --help too)."""
    try:
        parser = build_parser(config_cls)
    except TypeError as exc:  # settings(): the field, its type and the types there are
        print(f"train.py: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    first_pass = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    first_pass.add_argument("--config")  # read first, so that the file's values become the parser's defaults
    path = first_pass.parse_known_args(argv)[0].config
    from_file: dict[str, Any] = {}
    if path is not None:
        try:
            from_file = read_config_file(path, config_cls)
        except ValueError as exc:
            parser.error(str(exc))
        parser.set_defaults(**from_file)
    values = vars(parser.parse_args(argv))
    del values["config"]
    cfg = config_cls(**values)
    for setting in settings(config_cls):
        value = getattr(cfg, setting.name)
        if setting.rules.choices and value == setting.default:
            continue  # a default outside the choices means "decide at run time" (--wandb '')
        problem = setting.rules.problem(value)
        if problem:
            in_file = setting.name in from_file and (
                from_file[setting.name] is value or from_file[setting.name] == value  # `is`: nan is itself
            )
            parser.error(
                f"{flag(setting.name)} {problem}" + (f" (set by {setting.name} in --config {path})" if in_file else "")
            )
    return cfg


def _toml_value(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(map(_toml_value, value)) + "]"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)  # repr of a float reads back bit for bit; inf and nan are TOML too
    escaped = re.sub(r'["\\]', lambda found: "\\" + found[0], value)
    return '"' + re.sub(r"[\x00-\x1f\x7f]", lambda found: f"\\u{ord(found[0]):04X}", escaped) + '"'


def to_toml(cfg: Any) -> str:
    """The settings of `cfg` as a TOML file that --config reads back to an equal config. None is left out where it is
    the default, and written as "none" where it is not."""
    lines = []
    for setting in settings(type(cfg)):
        value = getattr(cfg, setting.name)
        if value is None and setting.default is None:
            continue
        lines.append(f"{setting.name} = {_toml_value('none' if value is None else value)}")
    return "\n".join(lines) + "\n"
