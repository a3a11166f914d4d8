"""Leave out the optional parts the answers did not ask for, then tell the user what to run next."""

import os
import shlex

# Jinja fills these in; the formatter would squeeze the spaces out of the braces.
# fmt: off
NPROC = {{ cookiecutter.nproc_per_node | int }}
SLUG = {{ cookiecutter.project_slug | py_str }}
REPLICA_GROUPS = {{ cookiecutter.replica_groups == "yes" }}
# fmt: on

if not REPLICA_GROUPS:  # opt-in torchft replica groups: their module and tests (other files hold the rest behind Jinja)
    for path in (f"{SLUG}/machinery/replicas.py", "tests/test_replica_groups.py", "docs/replica-groups.md"):
        os.remove(path)

print(
    f"Created {os.getcwd()}\n"
    "Next:\n"
    f"  cd {shlex.quote(os.getcwd())}\n"
    "  pip install -e '.[dev]'\n"
    f"  torchrun --standalone --nproc_per_node={NPROC} --max-restarts=3 train.py"
)
