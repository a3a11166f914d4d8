#!/usr/bin/env bash
# Create (once) and update the virtual environment the demo and the tests run in; print its python.
# VENV overrides its location (default: .venv at the template root).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=${VENV:-$root/.venv}
python3 -c 'import sys; sys.exit(sys.version_info < (3, 10))' || {
    echo "Python >= 3.10 is needed, found $(python3 --version 2>&1)" >&2
    exit 1
}
[ -x "$venv/bin/python" ] || python3 -m venv "$venv" >&2
# Some machines' pip configuration names index folders that do not exist; pip's warnings about them are noise.
set +e
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r "$root/requirements-dev.txt" 2>&1 \
    | grep -v "is ignored: it is neither a file nor a directory" >&2
status=${PIPESTATUS[0]}
set -e
[ "$status" -eq 0 ] || { echo "installing $root/requirements-dev.txt failed" >&2; exit "$status"; }
echo "$venv/bin/python"
