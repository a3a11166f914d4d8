"""A standing zygote per test process that the baked projects' runs start in (warm_pool), and the order of the
template's tests for ./test.sh's workers (-n 3 --dist load --maxschedchunk 1: each worker gets two tests to start
with, then the next one whenever it has fewer than two): the longest first, so they start at once on different
workers and the short ones fill the gaps at the end."""

import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The baked projects' tests start hundreds of Python processes, each of which would compile the project's modules
# from source again where PYTHONDONTWRITEBYTECODE is set (some CI images set it): their processes may cache bytecode
# (in the bakes' temporary folders, and cookiecutter's local_extensions.py here, which git ignores).
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

# The longest first (minutes each): the Hugging Face recipes and the replica groups' bake (on one worker), the
# whole-suite groups (two by two on the others), ...
LONGEST = (
    "test_the_hugging_face_recipes_resume_bitwise_under_ddp_and_fsdp",
    "test_replica_groups_yes_bakes_torchft_replica_groups_that_pass_their_tests",
    "test_the_readme_install_resolves_with_pip_for_every_dependency_option_and_its_quick_tier_passes_there",
    "test_own_model_and_data_pass_the_whole_suite",
    "test_dry_run_prepares_installs_tests_and_benchmarks_then_prints_one_table",
    "test_a_transformer_lm_on_a_stream_passes_the_seam_tests",
)


def pytest_collection_modifyitems(items):
    def place(item):
        name = item.originalname
        return LONGEST.index(name) if name in LONGEST else len(LONGEST)

    items.sort(key=place)  # stable: the others keep their order


@pytest.fixture(scope="session", autouse=True)
def warm_pool(tmp_path_factory):
    """One standing zygote (the baked machinery's warmstart.serve_pool) for every project this test process bakes:
    their tests' runs start in forks of it, with torch and the Hugging Face libraries imported once here, not once
    per baked test session (WARM_START_POOL, which a baked tests/conftest.py takes)."""
    if not sys.platform.startswith("linux"):
        yield
        return
    folder = tmp_path_factory.mktemp("pool")
    subprocess.run(
        [sys.executable, "-m", "cookiecutter", "--no-input", str(ROOT), "-o", str(folder)],
        check=True,
        capture_output=True,
    )
    name = f"template-{os.getpid()}-{random.SystemRandom().getrandbits(48):x}"
    preload = ("torch.distributed.run", "transformers", "datasets", "peft")
    script = f"from ddp_project.machinery import warmstart; warmstart.serve_pool({name!r}, {preload!r})"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WARM_", "PYTEST_"))}
    pool = subprocess.Popen(
        [sys.executable, "-c", script],
        cwd=folder / "ddp_project",
        env={**env, "PYTHONPATH": str(folder / "ddp_project")},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 120
    while pool.poll() is None and time.monotonic() < deadline:
        if f"@warm-start-pool-{name}" in Path("/proc/net/unix").read_text():  # the bake's warmstart.POOL_ADDRESS
            os.environ["WARM_START_POOL"] = name
            break
        time.sleep(0.05)
    yield
    os.environ.pop("WARM_START_POOL", None)
    pool.kill()
    pool.wait()
