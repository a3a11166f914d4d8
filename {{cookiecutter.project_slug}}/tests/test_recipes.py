"""The recipes of docs/recipes.md for your own model and data (a nanoGPT-style LM, a pretrained Hugging Face model
fine-tuned, a Hugging Face causal LM on a Dataset and on a stream split per rank, LoRA adapters with peft, a stream,
optimizer groups with a schedule of your own, an EMA and a second optimizer) train and evaluate as written, in a copy
of this project.

A recipe is the ```python blocks marked `<!-- recipe NAME: FILE -->` in README.md and docs/*.md (today all in
docs/recipes.md); `(with OTHER: FILE, ...)` in the mark takes those files of recipe OTHER first and adds this block
after them.
"""

import re
import shutil

import pytest
from conftest import PACKAGE, QUICK, ROOT, child_env, outputs, run, save_base_model, summary, train_cmd

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
