"""The command line: every contract flag is there, bad values stop the run with a clear message."""

import pytest
import torch
from conftest import QUICK, default_datasets, metrics, outputs, run, train_cmd

CONTRACT_FLAGS = [
    "--epochs",
    "--batch-size",
    "--lr",
    "--seed",
    "--max-steps",
    "--snapshot-dir",
    "--snapshot-every",
    "--keep-snapshots",
    "--amp",
    "--grad-accum",
    "--wandb",
    "--log-file",
    "--eval-every",
    "--resume",
    "--clip-grad",
    "--compile",
    "--no-compile",
    "--metrics-file",
    "--export-dir",
]


def test_help_lists_every_contract_flag():
    result = run(train_cmd() + ["--help"])
    missing = [flag for flag in CONTRACT_FLAGS if flag not in result.stdout]
    assert not missing, f"--help lacks {missing}"
    assert "{off,bf16,fp16}" in result.stdout and "{online,offline,disabled}" in result.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--keep-snapshots", "1"], "--keep-snapshots must be >= 2"),
        (["--batch-size", "0"], "--batch-size must be >= 1"),
        (["--amp", "fp8"], "invalid choice: 'fp8'"),
        (["--lr", "abc"], "invalid float value: 'abc'"),
        (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    ],
)
def test_bad_values_are_refused_before_training(tmp_path, args, message):
    result = run(train_cmd() + args + outputs(tmp_path), check=False)
    assert result.returncode == 2
    assert message in result.stdout
    assert not (tmp_path / "run-snapshots").exists()


def test_dataset_smaller_than_one_step_is_explained(tmp_path):
    train, _ = default_datasets()
    result = run(train_cmd() + QUICK + ["--batch-size", str(len(train) + 1)] + outputs(tmp_path), check=False)
    assert result.returncode == 2, result.stdout[-3000:]
    errors = [line for line in result.stdout.splitlines() if " ERROR [rank 0] " in line]
    assert len(errors) == 1 and "--batch-size" in errors[0] and str(len(train)) in errors[0], result.stdout[-3000:]
    assert "Traceback" not in result.stdout
    assert not (tmp_path / "run-snapshots").exists() and not metrics(tmp_path), "nothing is trained or saved"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA GPUs")
def test_nccl_without_gpus_is_explained(tmp_path):
    result = run(train_cmd(nproc=1) + QUICK + ["--backend", "nccl"] + outputs(tmp_path), check=False)
    assert result.returncode != 0
    assert "--backend nccl needs CUDA GPUs" in result.stdout
