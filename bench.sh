#!/usr/bin/env bash
# The benchmark: bake the template, then measure the baked project against a bare DDP loop on 2 CPU ranks.
# Writes bench/RESULTS.md. Extra arguments go to bench/benchmark.py (e.g. ./bench.sh --quick, ./bench.sh --help).
set -euo pipefail
root=$(cd "$(dirname "$0")" && pwd)
python=$("$root/scripts/setup-env.sh")
exec "$python" "$root/bench/benchmark.py" "$@"
