"""Tell the user what to run next."""

import os
import shlex

# Jinja fills this in; the formatter would squeeze the spaces out of the braces.
# fmt: off
NPROC = {{ cookiecutter.nproc_per_node | int }}
# fmt: on

print(
    f"Created {os.getcwd()}\n"
    "Next:\n"
    f"  cd {shlex.quote(os.getcwd())}\n"
    "  pip install -e '.[dev]'\n"
    f"  torchrun --standalone --nproc_per_node={NPROC} --max-restarts=3 train.py"
)
