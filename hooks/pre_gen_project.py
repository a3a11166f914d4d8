"""Reject bad answers before anything is written.

Cookiecutter removes the half-made project folder when this hook exits non-zero, so a bad value leaves
nothing behind. Each problem is reported on one line naming the key, the value and what is allowed.
"""

import keyword
import re
import sys

# Jinja fills these in; the formatter would squeeze the spaces out of the braces.
# fmt: off
ANSWERS = {
    "project_name": {{ cookiecutter.project_name | py_str }},
    "project_slug": {{ cookiecutter.project_slug | py_str }},
    "description": {{ cookiecutter.description | py_str }},
    "author": {{ cookiecutter.author | py_str }},
    "nproc_per_node": {{ cookiecutter.nproc_per_node | py_str }},
    "backend": {{ cookiecutter.backend | py_str }},
    "use_wandb": {{ cookiecutter.use_wandb | py_str }},
    "wandb_project": {{ cookiecutter.wandb_project | py_str }},
    "debug_port": {{ cookiecutter.debug_port | py_str }},
    "replica_groups": {{ cookiecutter.replica_groups | py_str }},
}
# fmt: on

# Top-level names the baked project imports, directly or through its dependencies, or that already sit in
# its root folder. A package with one of these names would shadow the real module for train.py and tests.
TAKEN_NAMES = {
    "torch",
    "torchvision",
    "torchaudio",
    "triton",
    "numpy",
    "tqdm",
    "debugpy",
    "wandb",
    "pytest",
    "_pytest",
    "cookiecutter",
    "setuptools",
    "pkg_resources",
    "pip",
    "wheel",
    "jinja2",
    "markupsafe",
    "filelock",
    "fsspec",
    "networkx",
    "sympy",
    "mpmath",
    "typing_extensions",
    "requests",
    "urllib3",
    "certifi",
    "idna",
    "charset_normalizer",
    "click",
    "pydantic",
    "pydantic_core",
    "yaml",
    "sentry_sdk",
    "platformdirs",
    "google",
    "psutil",
    "git",
    "gitdb",
    "smmap",
    "setproctitle",
    "packaging",
    "annotated_types",
    "typing_inspection",
    "pluggy",
    "iniconfig",
    "nvidia",
    "matplotlib",
    "ruff",
    "mypy",
    "ipykernel",
    "nbclient",
    "nbformat",
    "xdist",
    "transformers",
    "datasets",
    "huggingface_hub",
    "tokenizers",
    "safetensors",
    # The bake's own top-level files and folders, and the folders a run writes next to them by default.
    "train",
    "tests",
    "scripts",
    "docs",
    "notebooks",
    "snapshots",
    "logs",
    "export",
    "runs",
}
# Only a bake with replica groups imports torchft.
TAKEN_WITH_REPLICA_GROUPS = {"torchft"}
UNWANTED_IN_TEXT = {"\n": "a line break", "\r": "a carriage return", "\x00": "a NUL character"}
WANDB_FORBIDDEN = set("/\\#?%:")


def check_slug(slug, replica_groups="no"):
    taken = TAKEN_NAMES | (TAKEN_WITH_REPLICA_GROUPS if replica_groups == "yes" else set())
    allowed = "a Python identifier in lower case, such as my_project"
    if not slug.isidentifier():
        return f"is not a Python identifier; allowed: {allowed}"
    if keyword.iskeyword(slug) or keyword.issoftkeyword(slug):
        return f"is a Python keyword; allowed: {allowed}"
    if slug != slug.lower():
        return f"has upper-case letters; allowed: {allowed}"
    if slug in sys.stdlib_module_names or slug in taken:
        return (
            f"shadows the module {slug!r} that the project imports or contains; allowed: {allowed}, not a module name"
        )
    return None


def check_int(text, low=None):
    if not re.fullmatch(r"[0-9]+", text):
        return None
    value = int(text)
    return value if low is None or value >= low else None


def problems(answers):
    for key in ("project_name", "description", "author"):
        for char, what in UNWANTED_IN_TEXT.items():
            if char in answers[key]:
                yield key, f"contains {what}; allowed: one line of text"
                break
    if not answers["project_name"].strip():
        yield "project_name", "is empty; allowed: any non-empty one-line name"

    reason = check_slug(answers["project_slug"], answers["replica_groups"])
    if reason:
        yield "project_slug", reason

    nproc = check_int(answers["nproc_per_node"].strip(), low=1)
    if nproc is None:
        yield "nproc_per_node", "is not an integer >= 1; allowed: 1, 2, 8, ..."

    port = check_int(answers["debug_port"].strip())
    if port is None:
        yield (
            "debug_port",
            "is not an integer; allowed: an integer port with 1024 <= port and port + nproc_per_node - 1 <= 65535",
        )
    elif port < 1024 or (nproc is not None and port + nproc - 1 > 65535):
        top = 65535 - (nproc or 1) + 1
        yield "debug_port", f"is out of range; allowed: 1024 <= debug_port <= {top} (ranks use debug_port + local rank)"

    for key, choices in (
        ("backend", ("auto", "nccl", "gloo")),
        ("use_wandb", ("yes", "no")),
        ("replica_groups", ("no", "yes")),
    ):
        if answers[key] not in choices:
            yield key, f"is not a valid choice; allowed: {', '.join(choices)}"

    project = answers["wandb_project"]
    if not project or len(project) > 128 or WANDB_FORBIDDEN & set(project) or not project.isprintable():
        yield (
            "wandb_project",
            "is not a valid wandb project name; allowed: 1 to 128 printable characters without / \\ # ? % :",
        )


def main():
    found = list(problems(ANSWERS))
    for key, reason in found:
        print(f"error: {key}={ANSWERS[key]!r} {reason}", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
