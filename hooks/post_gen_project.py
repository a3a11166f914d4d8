"""Tell the user what to run next."""

import os
import shlex

NPROC = {{ cookiecutter.nproc_per_node | int }}

print(
    f"Created {os.getcwd()}\n"
    "Next:\n"
    f"  cd {shlex.quote(os.getcwd())}\n"
    "  pip install -e '.[dev]'\n"
    f"  torchrun --standalone --nproc_per_node={NPROC} --max-restarts=3 train.py"
)
