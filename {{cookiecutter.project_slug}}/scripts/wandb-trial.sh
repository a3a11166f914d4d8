#!/usr/bin/env bash
# One run of a wandb sweep (scripts/wandb-sweep.yaml): torchrun with the agent's flags, in a folder of the run's own.
# NPROC_PER_NODE (default {{ cookiecutter.nproc_per_node }}) ranks; WANDB_RUN_ID is set by `wandb agent`.
set -euo pipefail
folder="sweeps/wandb/${WANDB_SWEEP_ID:-sweep}/${WANDB_RUN_ID:?run me through wandb agent}"
exec torchrun --standalone --nproc_per_node="${NPROC_PER_NODE:-{{ cookiecutter.nproc_per_node }}}" --max-restarts=2 train.py \
    --snapshot-dir "$folder/snapshots" --export-dir "$folder/export" --metrics-file "$folder/logs/metrics.jsonl" \
    --log-file "$folder/logs/train.log" --max-steps 300 --eval-every 50 "$@"
