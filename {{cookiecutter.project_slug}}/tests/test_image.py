"""The Dockerfile that scripts/pytorchjob.yaml's pods run: its torch is one pyproject.toml admits, and its
.dockerignore keeps a run's outputs, environments and caches out of the image."""

import re
import shlex

from conftest import PACKAGE, ROOT
from packaging.requirements import Requirement

from {{ cookiecutter.project_slug }} import config

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

DOCKERFILE = ROOT / "Dockerfile"


def instructions():
    """The Dockerfile's instructions, (keyword, arguments) in order, continuation lines joined, comments left out."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text(encoding="utf-8"))
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


def expand(text, args):
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args[m.group(1) or m.group(2)], text)


def image_torch():
    """The base image's torch release and the requirements the image's pip install is given, ARGs filled in."""
    args, base, installs = {}, None, []
    for keyword, rest in instructions():
        if keyword == "ARG" and "=" in rest:
            name, value = rest.split("=", 1)
            args[name] = value
        elif keyword == "FROM":
            base = expand(rest, args)
        elif keyword == "RUN" and "pip install" in rest:
            installs += [word for word in shlex.split(expand(rest, args)) if not word.startswith(("-", "."))]
    repository, tag = base.split(":", 1)
    assert repository == "pytorch/pytorch", base
    return tag.split("-", 1)[0], installs


def test_the_image_trains_on_a_torch_the_project_admits_and_its_pip_install_keeps_it():
    torch_release, installs = image_torch()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    (wanted,) = [Requirement(need) for need in project["dependencies"] if Requirement(need).name == "torch"]
    assert wanted.specifier.contains(torch_release), f"the image's torch {torch_release} is not {wanted}"
    # The install names the base image's torch exactly: pip keeps that build rather than fetch another torch.
    assert [str(Requirement(need).specifier) for need in installs if Requirement(need).name == "torch"] == [
        f"=={torch_release}"
    ], installs


def ignored(path, patterns):
    """Whether .dockerignore's patterns keep `path` (relative, with /) out of the build context, as Docker reads
    them: the last matching pattern decides, `!` lets a path back in, and a folder left out takes its contents."""
    parts = path.split("/")
    verdict = False
    for pattern in patterns:
        keep = pattern.startswith("!")
        pattern = pattern.lstrip("!").strip("/")
        regex = re.escape(pattern).replace(r"\*\*/", "(?:.*/)?").replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
        if any(re.fullmatch(regex, "/".join(parts[:n])) for n in range(1, len(parts) + 1)):
            verdict = not keep
    return verdict


def test_dockerignore_keeps_outputs_environments_and_caches_out_and_the_sources_in():
    lines = (ROOT / ".dockerignore").read_text(encoding="utf-8").splitlines()
    patterns = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    settings = config.parse_args([])
    outputs = [settings.snapshot_dir, settings.export_dir, settings.metrics_file, settings.log_file]
    kept_out = [f"{path}/x" for path in outputs] + ["wandb/run-1/files", ".venv/bin/python", ".git/HEAD"]
    kept_out += [f"{PACKAGE}/__pycache__/config.cpython-311.pyc", ".pytest_cache/v", "tests/.mypy_cache/x"]
    # Whatever git leaves out of the project, the image leaves out too.
    gitignore = (ROOT / ".gitignore").read_text(encoding="utf-8").splitlines()
    kept_out += [f"{line.strip('/').replace('*', 'a')}/x" for line in gitignore if line and not line.startswith("#")]
    assert [path for path in kept_out if not ignored(path, patterns)] == []
    sources = ["train.py", "pyproject.toml", "README.md", f"{PACKAGE}/config.py", f"{PACKAGE}/machinery/trainer.py"]
    assert [path for path in sources if ignored(path, patterns) or not (ROOT / path).exists()] == []
