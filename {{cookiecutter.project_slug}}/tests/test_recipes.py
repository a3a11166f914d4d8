"""The recipes of docs/recipes.md for your own model and data (a nanoGPT-style LM, a pretrained Hugging Face model
fine-tuned, a Hugging Face causal LM on a Dataset and on a stream split per rank, LoRA adapters with peft, a stream,
optimizer groups with a schedule of your own, an EMA and a second optimizer) train and evaluate as written, in a copy
of this project.

A recipe is the ```python blocks marked `<!-- recipe NAME: FILE -->` in README.md and docs/*.md (today all in
docs/recipes.md); `(with OTHER: FILE, ...)` in the mark takes those files of recipe OTHER first and adds this block
after them.
"""

import os
import re
import shutil
import socket
import sys

import pytest
from conftest import PACKAGE, QUICK, ROOT, child_env, outputs, run, save_base_model, save_tokenizer, summary, train_cmd

from {{ cookiecutter.project_slug }}.machinery.writeonce import write_once

MARK = re.compile(r"<!-- recipe ([\w-]+): ([\w.]+)(?: \(with ([\w-]+): ([\w., ]+)\))? -->\n```python\n(.*?)```", re.S)


def recipes():
    """{name: {file: source}} from the README and the docs, in that order."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    found: dict[str, dict[str, str]] = {}
    for page in pages:
        for name, file, other, other_files, code in MARK.findall(page.read_text(encoding="utf-8")):
            files = found.setdefault(name, {})
            if other:
                for taken in (part.strip() for part in other_files.split(",")):
                    files[taken] = found[other][taken] + files.get(taken, "")
            files[file] = files.get(file, "") + "\n\n" + code
    return found


RECIPES = recipes()


def test_the_docs_have_the_seven_recipes():
    assert set(RECIPES) == {"nanogpt", "hf-pretrained", "hf", "hf-stream", "lora", "stream", "nanogpt-optim", "ema"}
    assert all(set(files) == {"model.py", "data.py"} for files in RECIPES.values())


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_a_recipe_trains_and_evaluates(tmp_path, name):
    if "transformers" in "".join(RECIPES[name].values()):
        pytest.importorskip("transformers", reason="the Hugging Face recipes need pip install -e '.[dev]'")
        pytest.importorskip("datasets", reason="the Hugging Face recipes need pip install -e '.[dev]'")
    if "peft" in "".join(RECIPES[name].values()):
        pytest.importorskip("peft", reason="the LoRA recipe needs pip install -e '.[dev]'")
    workspace = tmp_path / "project"
    shutil.copytree(ROOT / PACKAGE, workspace / PACKAGE, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "train.py", workspace / "train.py")
    for file, source in RECIPES[name].items():
        (workspace / PACKAGE / file).write_text(source, encoding="utf-8")
    if "pretrained_weights" in RECIPES[name]["model.py"]:  # a model to start from, offline
        save_base_model(workspace / "base-model")
    args = QUICK + ["--max-steps", "4", "--batch-size", "4", "--eval-every", "0", "--snapshot-every", "2"]
    cmd = train_cmd(script=str(workspace / "train.py")) + args + outputs(tmp_path)
    run(cmd, env=child_env(PYTHONPATH=workspace), cwd=workspace)
    result = summary(tmp_path)
    assert result["steps"] == 4 and result["val_loss"] is not None and result["val_loss"] > 0
    assert (tmp_path / "run-export" / "model.pt").is_file()


# Two jobs that prepare one cache at once (a sweep on one machine): each forks from one process with the recipe's
# data.py imported, and both call prepare_data at the same moment, round after round.
RACE = """
import multiprocessing
import shutil
import sys

import datasets

from {package} import data


def prepare(barrier):
    barrier.wait()
    data.prepare_data(None)


data.AutoTokenizer.from_pretrained(data.BASE_MODEL)  # the tokenizer's modules imported once, before the forks
context = multiprocessing.get_context("fork")
caches = []
for _ in range({rounds}):
    shutil.rmtree(data.CACHE, ignore_errors=True)
    barrier = context.Barrier(2)
    jobs = [context.Process(target=prepare, args=(barrier,)) for _ in range(2)]
    for job in jobs:
        job.start()
    for job in jobs:
        job.join()
    print("exit codes", [job.exitcode for job in jobs], flush=True)
    caches.append(datasets.load_from_disk(data.CACHE).to_dict())
data.CACHE = sys.argv[1]  # the same cache made by one job alone
data.prepare_data(None)
alone = datasets.load_from_disk(data.CACHE).to_dict()
print("complete", [cache == alone for cache in caches])
"""


def test_jobs_that_prepare_the_recipes_cache_at_once_all_succeed_with_the_whole_cache(tmp_path):
    pytest.importorskip("transformers", reason="the Hugging Face recipes need pip install -e '.[dev]'")
    pytest.importorskip("datasets", reason="the Hugging Face recipes need pip install -e '.[dev]'")
    workspace = tmp_path / "project"
    shutil.copytree(ROOT / PACKAGE, workspace / PACKAGE, ignore=shutil.ignore_patterns("__pycache__"))
    (workspace / PACKAGE / "data.py").write_text(RECIPES["hf-pretrained"]["data.py"], encoding="utf-8")
    save_tokenizer(workspace / "base-model")  # all that prepare_data reads of it
    rounds = 3
    env = child_env(
        PYTHONPATH=workspace,
        DATA_CACHE=tmp_path / "cache",
        TOKENIZERS_PARALLELISM="false",
        HF_DATASETS_DISABLE_PROGRESS_BARS="1",
    )
    script = RACE.format(package=PACKAGE, rounds=rounds)
    out = run([sys.executable, "-c", script, str(tmp_path / "alone")], env=env, cwd=workspace, check=False).stdout
    assert out.count("exit codes [0, 0]") == rounds, out[-4000:]
    assert f"complete {[True] * rounds}" in out, out[-4000:]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["alone", "cache", "project"]  # no copy left over


def test_write_once_leaves_nothing_of_a_failed_build_and_clears_what_a_killed_one_left(tmp_path):
    def fails(folder):
        (folder / "half").write_text("written")
        raise ValueError("the download broke")

    with pytest.raises(ValueError, match="the download broke"):
        write_once(tmp_path / "cache", fails)
    assert list(tmp_path.iterdir()) == []
    host = socket.gethostname()
    gone, running = (
        tmp_path / f"cache.partial-{host}-{2**31 - 1}-0-x",
        tmp_path / f"cache.partial-{host}-{os.getpid()}-0-y",
    )
    for leftover in (gone, running):
        leftover.mkdir()
    assert write_once(tmp_path / "cache", lambda folder: (folder / "items").write_text("1 2 3")) == tmp_path / "cache"
    assert (tmp_path / "cache" / "items").read_text() == "1 2 3"
    assert sorted(tmp_path.iterdir()) == [tmp_path / "cache", running]  # a build in a live process is left alone
    assert write_once(tmp_path / "cache", fails) == tmp_path / "cache"  # there: not built again
