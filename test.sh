#!/usr/bin/env bash
# Every test: the template's own tests, which bake projects and run each baked project's test suite.
# Extra arguments go to pytest (e.g. ./test.sh -k bake -x; -n 0 runs in one process, as --pdb needs).
# Three workers share out the bakes and the groups of the whole-suite test, the longest first (tests/conftest.py): the
# tests wait on timeouts and signals for much of their time, and a third worker fills it (two leave 40% of both
# cores idle).
set -euo pipefail
root=$(cd "$(dirname "$0")" && pwd)
python=$("$root/scripts/setup-env.sh")
cd "$root"
exec "$python" -m pytest tests -n 3 --dist load --maxschedchunk 1 "$@"
