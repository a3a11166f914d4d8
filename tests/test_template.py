"""The template: bakes with every choice and awkward text, refuses bad answers, and its projects pass their tests."""

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
import yaml

ROOT = Path(__file__).resolve().parents[1]
AWKWARD = {
    "project_name": 'Ünïcode "Quoted" O\'Brien \\ 🚀',
    "project_slug": "awkward_project",
    "description": 'Says "hi", it\'s got \\backslashes\\, tabs\tand emoji 🤖 — and {braces}',
    "author": 'Zoë O\'Connor "ZO" \\',
}
# The quick tier of a baked project's own suite (its in-process tests), run for every variant; the whole suite runs
# once, on a bake whose demo model and data were replaced by a user's own (test_own_model_and_data_pass_the_whole_suite)
FAST_OWN_TESTS = ["-m", "not slow"]
OWN_MODEL = ROOT / "tests" / "own_model"
OWN_LM = ROOT / "tests" / "own_lm"  # a transformer language model on a stream, with its own seam tests
# The machinery's own stress tests (multi-node rendezvous, the job lock's races, crashes inside a save, ...): a user's
# model, data or settings cannot break what they check, so they are not in a bake's suite; they run in the bake of
# the whole-suite test, each `<name>_tests.py` as `tests/test_machinery_<name>.py`, with the bake's conftest.
MACHINERY_TESTS = ROOT / "tests" / "machinery"
# That bake's suite, machinery stress tests included, in groups of test files of about the same length (60-100 s
# each on an idle machine), each group in one pytest process: the template's workers share out the groups and the
# other bakes (no workers inside workers). A file's tests stay together, with the runs its module shares; the last
# group holds every test file the others do not name.
WHOLE_SUITE_GROUPS = {
    "store-exactness": ["test_store", "test_exactness"],
    "fault-tolerance": ["test_machinery_fault_tolerance", "test_fault_tolerance"],
    "debug": ["test_debug", "test_debug_recipes", "test_debug_flags", "test_any_batch"],
    "signals-lock-nodes": [
        "test_machinery_signals",
        "test_machinery_job_lock",
        "test_store_lock",
        "test_machinery_parent_death",
        "test_machinery_multinode",
    ],
    "seam-fsdp": ["test_seam", "test_fsdp"],
    "launch-recipes": ["test_launch", "test_recipes", "test_sweep"],
    "the-others": None,
}
HF_RECIPE_TESTS = ROOT / "tests" / "own_hf" / "hf_recipe_tests.py"  # docs/recipes.md with transformers, datasets
# What the opt-in torchft replica groups (replica_groups=yes) leave in a bake: a bake without them names none of it.
REPLICA_GROUP_TRACES = re.compile(r"torchft|replica[ _-]?group|--fault-tolerance|fault_tolerance", re.I)
DEMO_BLOCK = re.compile(
    r"^[ \t]*# --- demo settings: delete them with the demo model and data ---\n"
    r".*?^[ \t]*# --- end of demo settings ---\n",
    re.M | re.S,
)


def bake(tmp_path, **answers):
    """Bake with cookiecutter's command line, as a user would; return the project folder."""
    cmd = [sys.executable, "-m", "cookiecutter", "--no-input", str(ROOT), "-o", str(tmp_path)]
    result = subprocess.run(cmd + [f"{k}={v}" for k, v in answers.items()], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    (project,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    return project


UNRENDERED = re.compile(r"\{\{ ?cookiecutter\.|\{%|\{#")


def assert_fully_rendered(project):
    """No Jinja left in any baked file: an unrendered variable names the file and line."""
    leftovers = []
    for path in sorted(p for p in project.rglob("*") if p.is_file()):
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # binary files are copied, never rendered
        for number, line in enumerate(text.splitlines(), 1):
            if UNRENDERED.search(line):
                leftovers.append(f"{path.relative_to(project)}:{number}: {line.strip()}")
    assert not leftovers, "unrendered template syntax:\n" + "\n".join(leftovers)


def assert_lint_clean(project):
    """The bake passes its own ruff settings, lint and format, as a user's first `ruff check` would see it."""
    run_in(project, "-m", "ruff", "check", "--no-cache", ".")
    run_in(project, "-m", "ruff", "format", "--no-cache", "--check", ".")


def assert_commands_aligned(project):
    """In the code blocks of the README and docs/ and in train.py's docstring, the comments of adjacent command lines
    start in one column, whatever length the rendered answers (ports, rank counts, names) gave the commands."""
    pages = [project / "README.md", *sorted((project / "docs").glob("*.md"))]
    blocks = [
        (str(page.relative_to(project)), block)
        for page in pages
        for block in page.read_text(encoding="utf-8").split("```")[1::2]  # the code blocks
    ]
    docstring = (project / "train.py").read_text(encoding="utf-8").split('"""')[1]
    ragged = []
    for where, block in blocks + [("train.py", docstring)]:
        lines = block.splitlines()
        columns = [
            line.index("  # ") if "  # " in line and not line.lstrip().startswith("#") else None for line in lines
        ]
        for number in range(1, len(lines)):
            here, before = columns[number], columns[number - 1]
            if here is not None and before is not None and here != before:
                ragged.append(f"{where}: {lines[number].strip()}")
    assert not ragged, "comments out of line with the line above:\n" + "\n".join(ragged)


def assert_no_replica_groups(project):
    """No file of the bake mentions torchft, replica groups or their --fault-tolerance setting, in its name or its
    text. Left out: .cookiecutter.json (the recorded answer, replica_groups = no)."""
    traces = []
    for path in sorted(p for p in project.rglob("*") if p.is_file()):
        name = str(path.relative_to(project))
        if name == ".cookiecutter.json":
            continue
        if re.search("torchft|replica", path.name, re.I):  # replicas.py, test_replica_groups.py
            traces.append(name)
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        traces += [
            f"{name}:{n}: {line.strip()}"
            for n, line in enumerate(text.splitlines(), 1)
            if REPLICA_GROUP_TRACES.search(line)
        ]
    assert not traces, "replica groups in a bake without them:\n" + "\n".join(traces)


def assert_clean_bake(project):
    assert_fully_rendered(project)
    assert_commands_aligned(project)
    assert_lint_clean(project)


def run_in(project, *args, check=True, timeout=300, **env):
    result = subprocess.run(
        [sys.executable, *args],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**_clean_env(), **env},
    )
    if check:
        # The names of the failed tests first: a long failure message can push them out of the tail.
        failed = "\n".join(line[:300] for line in result.stdout.splitlines() if line.startswith(("FAILED ", "ERROR ")))
        assert result.returncode == 0, (
            f"{args} failed:\n{failed}\n...\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
        )
    return result


def _clean_env():
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith(("DEBUG_", "WANDB_", "PYTEST_"))}


def _load_jsonc():
    """The baked tests' reader of VSCode's JSON with comments (it holds no template variable): one copy of it."""
    path = ROOT / "{{cookiecutter.project_slug}}" / "tests" / "jsonc.py"
    spec = importlib.util.spec_from_file_location("baked_jsonc", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.load_jsonc


load_jsonc = _load_jsonc()


def swap_in_own_model(project, source=OWN_MODEL):
    """What a user does: replace model.py and data.py with their own (from `source`), delete the demo settings from
    config.py."""
    package = project / project.name
    for name in ("model.py", "data.py"):
        (package / name).write_text((source / name).read_text())
    config = package / "config.py"
    text, removed = DEMO_BLOCK.subn("", config.read_text())
    assert removed == 1, "config.py must hold exactly one marked demo-settings block"
    config.write_text(text)


def test_defaults_bake_a_complete_project(tmp_path):
    """The default answers' bake, checked file by file; its quick tier runs where the README's install put its
    requirements in a fresh venv (test_the_readme_install_resolves_...)."""
    project = bake(tmp_path)
    assert_clean_bake(project)
    assert project.name == "ddp_project"
    for name in [
        "train.py",
        "pyproject.toml",
        "README.md",
        ".vscode/launch.json",
        "notebooks/train.ipynb",
        "ddp_project/machinery/snapshot/__init__.py",
        "tests/conftest.py",
    ]:
        assert (project / name).is_file(), name
    assert list((project / "scripts").glob("*.sbatch"))
    # The image (its Dockerfile) trains on the torch release that these tests run the projects on.
    (image_torch,) = re.findall(r"^ARG TORCH=(\S+)$", (project / "Dockerfile").read_text(), re.M)
    (tested_torch,) = re.findall(r"^torch==(\S+)$", (ROOT / "requirements-dev.txt").read_text(), re.M)
    assert image_torch == tested_torch
    assert_no_replica_groups(project)  # opt-in: replica_groups defaults to no
    # mypy runs on the replica_groups=yes bake: its package is this one plus the replica groups' additions only.


@pytest.mark.parametrize("group", list(WHOLE_SUITE_GROUPS))
def test_own_model_and_data_pass_the_whole_suite(tmp_path, group):
    """The seam, kept honest: a user's CNN with BatchNorm and their own data, the demo deleted, every test unchanged."""
    project = bake(tmp_path)
    swap_in_own_model(project)
    for path in MACHINERY_TESTS.glob("*_tests.py"):
        shutil.copy(path, project / "tests" / f"test_machinery_{path.name.removesuffix('_tests.py')}.py")
    demo_names = re.compile(r"--width|--depth|--dropout|--dataset-size|--val-size|TeacherDataset|\bMLP\b")
    for path in [*project.glob("ddp_project/*.py"), *project.glob("tests/*.py"), project / "train.py"]:
        assert not demo_names.search(path.read_text()), f"{path.relative_to(project)} still names the demo"
    present = {path.stem for path in (project / "tests").glob("test_*.py")}
    named = [name for names in WHOLE_SUITE_GROUPS.values() for name in names or ()]
    assert len(set(named)) == len(named) and set(named) <= present, f"the groups name a file twice or none: {named}"
    files = WHOLE_SUITE_GROUPS[group] or sorted(present - set(named))
    result = run_in(
        project, "-m", "pytest", "-q", "-p", "no:cacheprovider", *[f"tests/{name}.py" for name in files], timeout=900
    )
    summary = result.stdout.strip().splitlines()[-1]
    assert re.search(r"\d+ passed", summary) and "failed" not in summary, summary
    print(f"the swapped-in model's run of {', '.join(files)}: {summary}")


def test_rebake_from_the_recorded_answers_reproduces_the_project_byte_for_byte(tmp_path):
    """.cookiecutter.json holds every answer, so a re-bake from it (how a project pulls template updates) is exact."""
    answers = {**AWKWARD, "nproc_per_node": "3", "backend": "gloo", "use_wandb": "no", "debug_port": "7000"}
    answers["replica_groups"] = "yes"
    answers["wandb_project"] = "awkward-runs"
    first = bake(tmp_path / "first", **answers)
    recorded = json.loads((first / ".cookiecutter.json").read_text(encoding="utf-8"))
    options = {key for key in json.loads((ROOT / "cookiecutter.json").read_text()) if not key.startswith("_")}
    assert set(answers) == options, "the answers above must set every option"
    assert recorded == answers
    again = bake(tmp_path / "again", **recorded)

    def tree(project):
        return {str(p.relative_to(project)): p.read_bytes() for p in sorted(project.rglob("*")) if p.is_file()}

    first_files, again_files = tree(first), tree(again)
    assert sorted(first_files) == sorted(again_files)
    differing = [name for name in first_files if first_files[name] != again_files[name]]
    assert not differing, f"a re-bake from .cookiecutter.json differs in {differing}"


def test_slug_is_derived_from_the_name(tmp_path):
    project = bake(tmp_path, project_name="My Cool-Project")
    assert_clean_bake(project)
    assert project.name == "my_cool_project"
    assert (project / "my_cool_project" / "machinery" / "trainer.py").is_file()


@pytest.mark.parametrize(
    "name, slug",
    [
        ('Zoë\'s "Net"', "zoës_net"),
        ("  Hello,  World! -- v2.0 ", "hello_world_v20"),
        ("3D U-Net", "project_3d_u_net"),
        ("Class", "project_class"),
        ("🚀 !!", "project"),
    ],
)
def test_slug_derived_from_a_name_with_punctuation_is_a_valid_identifier(tmp_path, name, slug):
    """Only the name given: the default slug drops what cannot be in an identifier and the hook accepts it."""
    project = bake(tmp_path, project_name=name)
    assert project.name == slug
    assert (project / slug / "__init__.py").is_file()
    assert json.loads((project / ".cookiecutter.json").read_text(encoding="utf-8"))["project_slug"] == slug
    assert run_in(project, "-c", f"import {slug}; print({slug}.__name__)").stdout.strip() == slug
    assert name in (project / "README.md").read_text(encoding="utf-8")
    job_name = yaml.safe_load((project / "scripts" / "pytorchjob.yaml").read_text())["metadata"]["name"]
    assert re.fullmatch(r"[a-z]([-a-z0-9]{0,38}[a-z0-9])?", job_name), job_name  # what Kubernetes accepts


def test_awkward_text_bakes_into_valid_python_toml_and_json(tmp_path):
    project = bake(tmp_path, **AWKWARD)
    assert_clean_bake(project)
    run_in(project, "-m", "compileall", "-q", ".")
    meta = tomllib.loads((project / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    assert meta["description"] == AWKWARD["description"]
    assert meta["authors"] == [{"name": AWKWARD["author"]}]
    for path in (project / ".vscode").glob("*.json"):
        load_jsonc(path)
    shown = run_in(project, "-c", "from awkward_project.machinery import baked; print(ascii(baked.PROJECT_NAME))")
    assert shown.stdout.strip() == ascii(AWKWARD["project_name"])
    assert AWKWARD["project_name"] in (project / "README.md").read_text(encoding="utf-8")
    # setuptools validates the metadata while building the wheel.
    run_in(project, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path / "wheel"), ".")
    assert list((tmp_path / "wheel").glob("awkward_project-0.1.0-*.whl"))
    assert "--snapshot-every" in run_in(project, "train.py", "--help").stdout
    # (its quick tier is the default bake's: no test of it reads the project's name, description or author)


def test_use_wandb_no_leaves_wandb_out(tmp_path):
    project = bake(tmp_path, use_wandb="no")
    assert_clean_bake(project)
    assert "wandb" not in tomllib.loads((project / "pyproject.toml").read_text())["project"]["dependencies"]
    probe = (
        "import sys, train; train.main(['--max-steps', '3', '--dataset-size', '512']); "
        "print('wandb imported:', 'wandb' in sys.modules)"
    )
    result = run_in(project, "-c", probe)
    assert "wandb imported: False" in result.stdout
    assert not (project / "wandb").exists()
    run_in(project, "-m", "pytest", "-q", "-p", "no:cacheprovider", *FAST_OWN_TESTS)


def test_use_wandb_yes_defaults_to_offline_without_an_api_key(tmp_path):
    project = bake(tmp_path, use_wandb="yes")
    assert_clean_bake(project)
    assert any(
        d.startswith("wandb")
        for d in tomllib.loads((project / "pyproject.toml").read_text())["project"]["dependencies"]
    )
    probe = "from ddp_project import config; print(config.parse_args([]).wandb)"
    assert run_in(project, "-c", probe, HOME=str(tmp_path)).stdout.strip() == "offline"


@pytest.mark.parametrize("backend", ["auto", "gloo", "nccl"])
def test_backend_choice_is_the_default_and_can_be_overridden(tmp_path, backend):
    project = bake(tmp_path, backend=backend)
    assert_clean_bake(project)
    assert f"(default: {backend})" in " ".join(run_in(project, "train.py", "--help").stdout.split())
    if backend == "auto":
        return  # the default answer: the other bakes' runs train with it
    args = ["train.py", "--max-steps", "2", "--dataset-size", "512", "--wandb", "disabled"]
    result = run_in(project, *args, check=False)
    if (
        backend == "nccl"
        and "cuda" not in run_in(project, "-c", "import torch; print(torch.cuda.is_available() and 'cuda')").stdout
    ):
        assert result.returncode != 0 and "--backend nccl needs CUDA GPUs" in result.stderr
        run_in(project, *args, "--backend", "gloo")
    else:
        assert result.returncode == 0, result.stderr[-3000:]
    if backend == "nccl":  # its own quick tier passes on whatever machine runs it, with or without GPUs
        run_in(project, "-m", "pytest", "-q", "-p", "no:cacheprovider", *FAST_OWN_TESTS)


def test_replica_groups_yes_bakes_torchft_replica_groups_that_pass_their_tests(tmp_path):
    """replica_groups=yes adds the opt-in torchft replica groups: the module, the setting, the dependency and the
    tests, which run here (a default bake has none of them, and its suite none of these runs)."""
    project = bake(tmp_path, replica_groups="yes")
    assert_clean_bake(project)
    assert (project / "ddp_project" / "machinery" / "replicas.py").is_file()
    extras = tomllib.loads((project / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert [need for need in extras["ft"] + extras["dev"] if need.startswith("torchft")] == ["torchft>=0.2"] * 2
    help_text = run_in(project, "train.py", "--help").stdout
    assert "--fault-tolerance" in help_text and "torchft" in help_text
    result = run_in(
        project, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_replica_groups.py", timeout=900
    )
    summary = result.stdout.strip().splitlines()[-1]
    assert re.search(r"\d+ passed", summary) and not re.search(r"failed|error|skipped", summary), summary
    # The package type-checks with the settings in its pyproject.toml (mypy's basic mode), the replica groups' module
    # too. Once, here: a default bake's package is this one less the replica groups' additions (a module, an import
    # and a setting that no other file may name: assert_no_replica_groups), so it holds no code this check skips.
    run_in(project, "-m", "mypy", "--no-incremental")


# The answers that change a bake's requirements (pyproject.toml), each against the default bake's.
# The answers whose requirements pip resolves in the README install test. use_wandb=no asks for the default's
# requirements less wandb (the test checks it): what resolves for the default resolves for it.
DEPENDENCY_OPTIONS = {
    "default": {},
    "replica_groups=yes": {"replica_groups": "yes"},
}


def test_the_readme_install_resolves_with_pip_for_every_dependency_option_and_its_quick_tier_passes_there(tmp_path):
    """The README's `pip install -e '.[dev]'`, in a fresh venv (with the pip it bundles) on this machine's package
    index, for each answer that changes the requirements, with torch held at the build these tests run on (the
    README's constraint: pip would otherwise take the newest, a CUDA build). pip resolves (--dry-run --report: the
    README's command less the downloads and unpacking); uv then makes the venv hold exactly the artifacts pip chose,
    and nothing else (`uv pip sync` of the report's URLs: it resolves nothing of its own), and the bake's quick tier
    runs there. A requirement that sends pip backtracking through hundreds of releases fails at the timeout."""
    from concurrent.futures import ThreadPoolExecutor
    from importlib.metadata import version

    projects = {name: bake(tmp_path / name, **answers) for name, answers in DEPENDENCY_OPTIONS.items()}
    default = (projects["default"] / "pyproject.toml").read_text()
    assert len({(project / "pyproject.toml").read_text() for project in projects.values()}) == len(projects)
    options = json.loads((ROOT / "cookiecutter.json").read_text())
    others = [
        (key, value)
        for key, values in options.items()
        if isinstance(values, list) and not key.startswith("_")
        for value in values[1:]
    ]
    for key, value in others:  # every other answer leaves the requirements as they are, or takes wandb out
        if key == "replica_groups":
            continue
        baked = tomllib.loads((bake(tmp_path / f"{key}-{value}", **{key: value}) / "pyproject.toml").read_text())
        wanted = tomllib.loads(default)["project"]
        if key == "use_wandb":
            wanted["dependencies"] = [d for d in wanted["dependencies"] if not d.startswith("wandb")]
        assert baked["project"] == wanted, key
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    held = tmp_path / "torch.txt"
    held.write_text(f"torch=={version('torch')}\n")
    env = {k: v for k, v in _clean_env().items() if not k.startswith(("WARM_", "VIRTUAL_ENV", "PYTHONPATH"))}

    def resolve(name):
        report = tmp_path / f"{name}.json"
        result = subprocess.run(
            [venv / "bin" / "pip", "install", "--dry-run", "--ignore-installed", "--quiet", "--report", report]
            + ["-e", ".[dev]", "-c", held],
            cwd=projects[name],
            capture_output=True,
            text=True,
            env=env,
            timeout=900,
        )
        assert result.returncode == 0, f"{name}: pip install -e '.[dev]' does not resolve:\n{result.stderr[-3000:]}"
        return json.loads(report.read_text())["install"]

    with ThreadPoolExecutor(len(projects)) as pool:
        chosen = dict(zip(projects, pool.map(resolve, projects), strict=True))
    uv = shutil.which("uv", path=str(Path(sys.executable).parent)) or shutil.which("uv")
    assert uv, "uv installs pip's choices here: ./scripts/setup-env.sh puts it in the template's environment"
    for name, project in projects.items():
        lines = [f"-e {project}"] + [
            f"{item['metadata']['name']} @ {item['download_info']['url']}"
            for item in chosen[name]
            if "dir_info" not in item["download_info"]  # the bake itself, editable
        ]
        assert any(line.startswith("torch @ ") for line in lines), f"{name}: pip chose no torch"
        (tmp_path / f"{name}.txt").write_text("\n".join(lines) + "\n")
        subprocess.run(
            [uv, "pip", "sync", "--quiet", "--python", venv / "bin" / "python", tmp_path / f"{name}.txt"],
            check=True,
            env=env,
            timeout=900,
        )
        result = subprocess.run(
            [venv / "bin" / "python", "-m", "pytest", "-q", "-p", "no:cacheprovider", *FAST_OWN_TESTS],
            cwd=project,
            capture_output=True,
            text=True,
            env=env,
            timeout=600,
        )
        summary = result.stdout.strip().splitlines()[-1]
        assert result.returncode == 0 and "failed" not in summary, f"{name}: {result.stdout[-3000:]}"
        print(f"{name}: pip chose {len(chosen[name])} distributions; quick tier: {summary}")


def test_nproc_and_debug_port_reach_every_place_that_uses_them(tmp_path):
    project = bake(tmp_path, nproc_per_node="4", debug_port="6000")
    assert_clean_bake(project)
    launch = load_jsonc(project / ".vscode" / "launch.json")
    f5 = next(c for c in launch["configurations"] if c.get("module") == "torch.distributed.run")
    assert "--nproc_per_node=4" in f5["args"]
    assert "6003" in (project / ".vscode" / "launch.json").read_text()
    assert "--nproc_per_node=4" in (project / "README.md").read_text()
    job = yaml.safe_load((project / "scripts" / "pytorchjob.yaml").read_text())
    assert job["spec"]["nprocPerNode"] == "4"
    shown = run_in(
        project, "-c", "from ddp_project.machinery import baked; print(baked.NPROC_PER_NODE, baked.DEBUG_PORT)"
    )
    assert shown.stdout.split() == ["4", "6000"]


BAD = [
    ("project_slug", "my-project", "is not a Python identifier"),
    ("project_slug", "class", "is a Python keyword"),
    ("project_slug", "torch", "shadows the module 'torch'"),
    ("project_slug", "logging", "shadows the module 'logging'"),
    ("project_slug", "wandb", "shadows the module 'wandb'"),
    ("project_slug", "debugpy", "shadows the module 'debugpy'"),
    ("project_slug", "1st", "is not a Python identifier"),
    ("nproc_per_node", "0", "is not an integer >= 1"),
    ("nproc_per_node", "two", "is not an integer >= 1"),
    ("nproc_per_node", "-1", "is not an integer >= 1"),
    ("debug_port", "80", "is out of range"),
    ("debug_port", "65535", "is out of range"),  # with 2 ranks, rank 1 would need 65536
    ("debug_port", "port", "is not an integer"),
    ("wandb_project", "a/b", "is not a valid wandb project name"),
    ("project_name", "two\nlines", "contains a line break", {"project_slug": "fine_slug"}),
    # a package named like one of the bake's own folders would be shadowed by it (or shadow it) on sys.path
    ("project_slug", "docs", "shadows the module 'docs'", {"project_name": "Docs"}),
    ("project_slug", "notebooks", "shadows the module 'notebooks'", {"project_name": "Notebooks"}),
    ("project_slug", "scripts", "shadows the module 'scripts'", {"project_name": "Scripts"}),
    ("project_slug", "tests", "shadows the module 'tests'", {"project_name": "Tests"}),
    ("project_slug", "export", "shadows the module 'export'", {"project_name": "Export"}),
    ("project_slug", "transformers", "shadows the module 'transformers'"),
    ("project_slug", "torchft", "shadows the module 'torchft'", {"replica_groups": "yes"}),
]


# Other answers that come with a bad one: a project name whose derived slug is the bad value, or the choice that
# makes it bad.
BAD = [(key, value, reason, more[0] if more else {}) for key, value, reason, *more in BAD]


@pytest.mark.parametrize("key, value, reason, more", BAD, ids=[f"{k}={v!r}" for k, v, *_ in BAD])
def test_bad_answer_stops_the_bake_with_one_clear_line(tmp_path, key, value, reason, more):
    answers = {key: value, **more}
    if key == "project_slug" and "project_name" in more:
        del answers["project_slug"]  # derived from the name, as a user who only names the project gets it
    cmd = [sys.executable, "-m", "cookiecutter", "--no-input", str(ROOT), "-o", str(tmp_path)]
    result = subprocess.run(cmd + [f"{k}={v}" for k, v in answers.items()], capture_output=True, text=True)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, result.stderr
    assert errors[0].startswith(f"error: {key}={value!r} {reason}") and "allowed" in errors[0], errors[0]
    assert list(tmp_path.iterdir()) == [], "a refused bake must leave nothing behind"


def test_choice_keys_refuse_unknown_values(tmp_path):
    cmd = [sys.executable, "-m", "cookiecutter", "--no-input", str(ROOT), "-o", str(tmp_path), "backend=mpi"]
    result = subprocess.run(cmd, capture_output=True, text=True)
    assert result.returncode != 0 and "mpi" in result.stderr + result.stdout
    assert list(tmp_path.iterdir()) == []


def test_template_vscode_configurations_parse_and_name_existing_tasks():
    launch = load_jsonc(ROOT / ".vscode" / "launch.json")
    tasks = load_jsonc(ROOT / ".vscode" / "tasks.json")
    labels = {task["label"] for task in tasks["tasks"]}
    for config in launch["configurations"]:
        assert config["type"] == "debugpy", config["name"]
        assert config.get("preLaunchTask", next(iter(labels))) in labels, config["name"]
        program = config.get("program", "").replace("${workspaceFolder}", str(ROOT))
        assert not program or Path(program).is_file(), program


def test_template_python_is_lint_clean():
    """The template's own tests, scripts, benchmarks, hooks and filters pass ruff with the root ruff.toml."""
    run_in(ROOT, "-m", "ruff", "check", "--no-cache", ".")
    run_in(ROOT, "-m", "ruff", "format", "--no-cache", "--check", ".")


# The baked tests a language model on a stream can break that hold no assumption about the model or its batches
# (each picked by reading it): `python train.py` without torchrun, loss falling, metrics, summary and export
# (test_train's first); dict batches through --clip-grad and the metrics file (test_seam's, on its one 2-rank run).
# Left out: test_train's second-launch test (the stream resumes by the same consumed-batch count in
# test_own_lm.py's SIGKILL restart, checked item by item there); test_seam's evaluation
# and export tests and test_fault_tolerance (they call loss_fn on (inputs, targets) pairs; test_own_lm.py checks
# the same claims on this model: exact val_loss, bitwise SIGKILL resume, no-decay groups across a resume), and
# test_config's too-small-dataset test (a stream has no len()).
OWN_LM_BAKED_TESTS = [
    "tests/test_train.py::test_single_process_trains_and_summarizes",
    "tests/test_seam.py::test_metrics_file_has_one_record_per_logged_step",
]


def test_a_transformer_lm_on_a_stream_passes_the_seam_tests(tmp_path):
    """A model the project never shows: dict batches padded by the user's collate, a token-weighted compute_loss,
    an IterableDataset without len(), the user's optimizer groups and schedule, blocks in an nn.ModuleList."""
    project = bake(tmp_path)
    swap_in_own_model(project, OWN_LM)
    shutil.copy(OWN_LM / "own_lm_tests.py", project / "tests" / "test_own_lm.py")
    tests = ["tests/test_own_lm.py", *OWN_LM_BAKED_TESTS]
    # One process: the whole-suite test runs beside this one on the other core.
    result = run_in(project, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests, timeout=900)
    summary = result.stdout.strip().splitlines()[-1]
    assert re.search(r"\d+ passed", summary) and not re.search(r"failed|error|skipped", summary), summary
    print(f"the language model's seam tests: {summary}")


def test_the_hugging_face_recipes_resume_bitwise_under_ddp_and_fsdp(tmp_path):
    """The recipes of the baked docs/recipes.md with the real libraries (a GPT-2 from a config with tied weights and
    dropout, a datasets.Dataset and a datasets stream split per rank, a pretrained GPT-2 fine-tuned from a folder
    that save_pretrained wrote, LoRA adapters with peft on a frozen base), SIGKILLed and resumed under ddp and fsdp (the
    stream under ddp)."""
    project = bake(tmp_path)
    shutil.copy(HF_RECIPE_TESTS, project / "tests" / "test_hf_recipes.py")
    # (the runs start in forks of tests/conftest.py's pool, which has transformers, datasets and peft imported)
    result = run_in(project, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_hf_recipes.py", timeout=900)
    summary = result.stdout.strip().splitlines()[-1]
    assert re.search(r"7 passed", summary) and not re.search(r"failed|error|skipped", summary), summary
