"""How a rank's process exits (machinery/processexit.py's run_and_exit): with the code the interpreter would give,
and, on an error, without freeing what the error passed through. Freeing it would destroy DDP's reducer and the
process group while a gloo thread may wait for the GIL (a hang until torchrun's SIGKILL, 30 s after SIGTERM)."""

import sys

import pytest
from conftest import PACKAGE, child_env, run

# main() holds an object that says when it is freed, then ends as argv[1] says.
SCRIPT = f"""
import sys
from {PACKAGE}.machinery import processexit

class Held:
    def __del__(self):
        print("freed", flush=True)

def main():
    held = Held()
    if sys.argv[1] == "error":
        raise ValueError("an error in training")
    sys.exit(int(sys.argv[1]))

processexit.run_and_exit(main)
"""


@pytest.mark.parametrize("ending, code", [("error", 1), ("3", 3), ("0", 0)])
def test_a_rank_that_ends_by_raising_exits_with_its_code_and_frees_nothing_on_the_way(ending, code):
    result = run([sys.executable, "-c", SCRIPT, ending], env=child_env(WARM_START_POOL=""), check=False)
    assert result.returncode == code, result.stdout
    assert "freed" not in result.stdout.split(), result.stdout
