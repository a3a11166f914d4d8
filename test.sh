#!/usr/bin/env bash
# Every test: the template's own tests, which bake projects and run each baked project's test suite.
# Extra arguments go to pytest (e.g. ./test.sh -k bake -x).
set -euo pipefail
root=$(cd "$(dirname "$0")" && pwd)
python=$("$root/scripts/setup-env.sh")
cd "$root"
exec "$python" -m pytest tests "$@"
