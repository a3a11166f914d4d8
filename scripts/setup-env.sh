#!/usr/bin/env bash
# Create (once) and update the virtual environment the demo and the tests run in; print its python.
# VENV overrides its location (default: .venv at the template root).
# uv installs (a minute faster than pip on a fresh environment), with the wheel folders and constraints of pip's
# configuration; where uv cannot be had or fails, pip installs as before.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=${VENV:-$root/.venv}
python3 -c 'import sys; sys.exit(sys.version_info < (3, 10))' || {
    echo "Python >= 3.10 is needed, found $(python3 --version 2>&1)" >&2
    exit 1
}
[ -x "$venv/bin/python" ] || python3 -m venv "$venv" >&2
python="$venv/bin/python"
requirements="$root/requirements-dev.txt"

# Some machines' pip configuration names index folders that do not exist; pip's warnings about them are noise.
quiet_pip() {
    "$python" -m pip --quiet --disable-pip-version-check "$@" 2>&1 | grep -v "is ignored: it is neither a file nor a directory" >&2
    return "${PIPESTATUS[0]}"
}

with_uv() {
    [ -x "$venv/bin/uv" ] || quiet_pip install uv || return 1
    local options=(--quiet --compile-bytecode --python "$python")  # bytecode: PYTHONDONTWRITEBYTECODE may be set
    local key value
    for key in find-links constraint; do  # what pip would use from its configuration (and PIP_* variables)
        value=$("$python" -m pip config get "global.$key" 2>/dev/null || true)
        value=${value:-$(printenv "PIP_$(echo "$key" | tr a-z- A-Z_)" || true)}
        for item in $value; do
            [ -e "${item#file://}" ] && options+=("--$key" "${item#file://}")
        done
    done
    "$venv/bin/uv" pip install "${options[@]}" -r "$requirements" >&2
}

with_uv || quiet_pip install -r "$requirements" || {
    echo "installing $requirements failed" >&2
    exit 1
}
echo "$python"
