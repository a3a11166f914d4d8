#!/usr/bin/env bash
# Every test: the template's own tests, which bake projects and run each baked project's test suite.
# Extra arguments go to pytest (e.g. ./test.sh -k bake -x; -n 0 runs in one process, as --pdb needs).
# Two workers: the groups of the model-swap test on one, the other bakes on the other (--dist worksteal balances them).
set -euo pipefail
root=$(cd "$(dirname "$0")" && pwd)
python=$("$root/scripts/setup-env.sh")
cd "$root"
exec "$python" -m pytest tests -n 2 --dist worksteal "$@"
