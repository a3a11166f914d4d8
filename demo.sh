#!/usr/bin/env bash
# The demo: bake the template with its defaults into a scratch folder and train on 2 CPU ranks under torchrun.
# Midway a worker is killed; torchrun restarts the job and it resumes from its newest snapshot.
# DEMO_DIR sets the scratch folder (default: a new temporary folder).
set -euo pipefail
root=$(cd "$(dirname "$0")" && pwd)
python=$("$root/scripts/setup-env.sh")
exec "$python" "$root/scripts/demo.py" "$@"
