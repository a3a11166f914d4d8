"""GPUs: the nccl backend, CUDA tensors, mixed precision with a gradient scaler, bitwise resume, background snapshots
of CUDA tensors, torch.compile and weights that load on a machine without GPUs.

Run them with `pytest -m gpu`. Where CUDA is absent, or has fewer GPUs than a test needs, the test is skipped and
says so. They name no setting of the model or the data, so they pass unchanged on your own model.py and data.py.

nccl does not put two ranks on one GPU, so several ranks on a machine with one GPU are tested with gloo, which
all-reduces CUDA tensors through host memory. The runs start train.py through PROBED_TRAIN below, which can place
every rank on one GPU and records each rank's backend, device and determinism switches.
A bitwise resume on GPUs is promised with --deterministic only: these tests pass it wherever they compare bits.
"""

import json
import os
import sys
import time

import pytest
import torch
from conftest import (
    QUICK,
    ROOT,
    assert_same_weights,
    child_env,
    default_config,
    default_datasets,
    final_model,
    metrics,
    outputs,
    run,
    summary,
    train_cmd,
)

GPU_COUNT = torch.cuda.device_count()
ARGS = QUICK + ["--max-steps", "60", "--snapshot-every", "20"]
KILL_AT = 40  # the worker is SIGKILLed right after it commits this step's snapshot
NO_DETERMINISTIC_OP = "does not have a deterministic implementation"  # what torch raises under --deterministic

# train.py with two additions: ALL_RANKS_ON_GPU=N puts every rank on GPU N, and each rank writes its backend,
# device and determinism switches to PROBE_DIR when training starts. tests/fault_injection.py is imported first, so
# the FAULT variables work here as they do there.
PROBED_TRAIN = """
import json
import os
import sys

import torch

import fault_injection  # noqa: F401  (the fault the FAULT variables ask for, if any)
import train
from {{ cookiecutter.project_slug }}.machinery import distributed, trainer

if os.environ.get("ALL_RANKS_ON_GPU"):
    shared_gpu = torch.device("cuda", int(os.environ["ALL_RANKS_ON_GPU"]))
    distributed.pick_device = lambda backend, local_rank: shared_gpu

run_training = trainer.train


def probed_training(cfg, env, *rest):
    record = {
        "backend": env.backend, "device": str(env.device),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "cudnn_deterministic": torch.backends.cudnn.deterministic, "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
    }
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    with open(os.path.join(os.environ["PROBE_DIR"], f"rank{env.rank}-attempt{attempt}.json"), "w") as handle:
        json.dump(record, handle)
    return run_training(cfg, env, *rest)


trainer.train = probed_training

if __name__ == "__main__":
    train.warmstart.run_and_exit(lambda: train.main(sys.argv[1:]))  # as train.py ends
"""


def gpus(count):
    """Skips a test where this machine has fewer than `count` CUDA GPUs, saying so."""
    have = f"{GPU_COUNT} GPU{'s' if GPU_COUNT != 1 else ''}" if torch.cuda.is_available() else "no CUDA"
    return pytest.mark.skipif(
        count > GPU_COUNT, reason=f"needs {count} CUDA GPU{'s' if count > 1 else ''}; this machine has {have}"
    )


def probed(tmp_path, nproc=None, torchrun_args=()):
    """The command line of a probed run: `python gpu_probe.py` when nproc is None, else under torchrun."""
    script = tmp_path / "gpu_probe.py"
    if not script.exists():
        script.write_text(PROBED_TRAIN)
    return train_cmd(nproc, torchrun_args, script=str(script))


def probe_env(folder, **extra):
    """The environment of a probed run whose ranks write their records into `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    env = child_env(PROBE_DIR=folder, **extra)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests")])
    if "CUBLAS_WORKSPACE_CONFIG" not in extra:
        env.pop("CUBLAS_WORKSPACE_CONFIG", None)  # the run's own setting, not the caller's
    return env


def probes(folder):
    """{(rank, attempt): record} of every rank of every attempt of a probed run."""
    found = {}
    for path in folder.glob("rank*-attempt*.json"):
        rank, attempt = path.stem[len("rank") :].split("-attempt")
        found[int(rank), int(attempt)] = json.loads(path.read_text())
    return found


def run_deterministic(cmd, env):
    """run(), but skip the test when this model uses an operation torch has no deterministic implementation of."""
    result = run(cmd, env=env, check=False)
    if result.returncode != 0 and NO_DETERMINISTIC_OP in result.stdout:
        pytest.skip(
            "this model uses an operation with no deterministic implementation on CUDA, so a bitwise "
            "resume cannot be promised for it: "
            + next(line for line in result.stdout.splitlines() if NO_DETERMINISTIC_OP in line).strip()
        )
    if result.returncode != 0:
        pytest.fail(f"{' '.join(map(str, cmd))} exited {result.returncode}:\n{result.stdout[-6000:]}")
    return result


def killed_and_resumed(tmp_path, nproc, args, **env):
    """An uninterrupted run and one whose worker is SIGKILLed after the snapshot of step KILL_AT and restarted by
    torchrun; returns both final snapshots and the probes of the resumed run."""
    run_deterministic(
        probed(tmp_path, nproc) + args + outputs(tmp_path, "reference"),
        env=probe_env(tmp_path / "probe-reference", **env),
    )
    fault = {"FAULT": "kill_after_commit", "FAULT_STEP": KILL_AT, "FAULT_ONCE": tmp_path / "killed"}
    run_deterministic(
        probed(tmp_path, nproc, ["--max-restarts=1"]) + args + outputs(tmp_path),
        env=probe_env(tmp_path / "probe", **env, **fault),
    )
    assert (tmp_path / "killed").exists(), "the worker was not killed"
    done = summary(tmp_path)
    assert done["resumed_from"] == KILL_AT and done["steps"] == 60, done
    reference, resumed = final_model(tmp_path / "reference-snapshots"), final_model(tmp_path / "run-snapshots")
    return reference, resumed, probes(tmp_path / "probe")


# ---- one rank with nccl on one GPU ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def nccl_run(tmp_path_factory):
    """One rank under torchrun with --backend nccl: the folder holding its outputs and its probe records."""
    folder = tmp_path_factory.mktemp("nccl")
    run(probed(folder, 1) + ARGS + ["--backend", "nccl"] + outputs(folder), env=probe_env(folder / "probe"))
    return folder


@pytest.mark.gpu
@gpus(1)
def test_one_rank_trains_with_nccl_on_its_gpu(nccl_run):
    records = probes(nccl_run / "probe")
    assert set(records) == {(0, 0)}, records
    record = records[0, 0]
    assert (record["backend"], record["device"]) == ("nccl", "cuda:0"), record
    done = summary(nccl_run)
    assert done["steps"] == 60 and done["last_loss"] < done["first_loss"], done
    assert [entry["step"] for entry in metrics(nccl_run)][-1] == 60
    # The final snapshot went through the pinned buffers of a background save, the export through a plain copy:
    # the same weights, bit for bit.
    exported = torch.load(nccl_run / "run-export" / "model.pt", weights_only=True)
    assert_same_weights(exported, final_model(nccl_run / "run-snapshots")["model"])


LOAD_ON_CPU = """
import sys

import torch
from torch.utils.data import default_collate

from {{ cookiecutter.project_slug }} import config, model
from {{ cookiecutter.project_slug }}.data import build_datasets
from {{ cookiecutter.project_slug }}.machinery.snapshot import load_latest

assert not torch.cuda.is_available()
cfg = config.parse_args([])
train, _ = build_datasets(cfg)
network = model.build_model(cfg, train)
network.load_state_dict(torch.load(sys.argv[1], weights_only=True))  # as the README shows, no map_location
inputs, targets = default_collate([train[index] for index in range(4)])
loss = model.loss_fn(network.eval()(inputs), targets)
assert torch.isfinite(loss), loss
snapshot = load_latest(sys.argv[2])
network.load_state_dict(snapshot["model"])
print("loaded on CPU: step", snapshot["step"])
"""


@pytest.mark.gpu
@gpus(1)
def test_exported_weights_and_snapshots_of_a_gpu_run_load_on_a_machine_without_gpus(nccl_run):
    result = run(
        [sys.executable, "-c", LOAD_ON_CPU, str(nccl_run / "run-export" / "model.pt"), str(nccl_run / "run-snapshots")],
        env=child_env(CUDA_VISIBLE_DEVICES=""),
    )
    assert "loaded on CPU: step 60" in result.stdout


@pytest.mark.gpu
@gpus(1)
def test_two_ranks_with_nccl_on_one_gpu_are_refused_before_training(tmp_path):
    result = run(
        train_cmd(2) + QUICK + ["--max-steps", "5", "--backend", "nccl"] + outputs(tmp_path),
        env=child_env(CUDA_VISIBLE_DEVICES="0"),
        check=False,
        timeout=180,
    )
    assert result.returncode != 0
    assert "--nproc_per_node" in result.stdout, result.stdout[-3000:]
    assert not metrics(tmp_path), "refused before any step"


# ---- bitwise resume on GPUs -------------------------------------------------------------------------------------


@pytest.mark.gpu
@gpus(1)
@pytest.mark.parametrize("amp", ["off", "bf16", "fp16"])
def test_sigkill_and_restart_end_bitwise_equal_on_a_gpu(tmp_path, amp):
    args = ARGS + ["--backend", "nccl", "--deterministic", "--amp", amp]
    reference, resumed, records = killed_and_resumed(tmp_path, 1, args)
    assert {record["device"] for record in records.values()} == {"cuda:0"}, records
    assert_same_weights(reference["model"], resumed["model"])
    if amp == "fp16":
        # The gradient scaler runs on CUDA, and a resume takes its scale and growth count from the snapshot:
        # restarted at its initial state, it would end elsewhere than the uninterrupted run's.
        assert reference["scaler"].get("scale"), "no gradient scaler in an fp16 run on CUDA"
        assert resumed["scaler"] == reference["scaler"]


@pytest.mark.gpu
@gpus(1)
def test_two_ranks_share_one_gpu_with_gloo_and_resume_bitwise(tmp_path):
    args = ARGS + ["--backend", "gloo", "--deterministic"]
    reference, resumed, records = killed_and_resumed(tmp_path, 2, args, ALL_RANKS_ON_GPU=0)
    assert {(record["backend"], record["device"]) for record in records.values()} == {("gloo", "cuda:0")}, records
    assert {rank for rank, _ in records} == {0, 1}
    assert_same_weights(reference["model"], resumed["model"])


@pytest.mark.gpu
@gpus(2)
def test_two_ranks_with_nccl_on_two_gpus_resume_bitwise(tmp_path):
    args = ARGS + ["--backend", "nccl", "--deterministic"]
    reference, resumed, records = killed_and_resumed(tmp_path, 2, args)
    assert {record["device"] for (rank, _), record in records.items() if rank == 1} == {"cuda:1"}, records
    assert_same_weights(reference["model"], resumed["model"])


def test_deterministic_switches_are_on_before_training_and_off_without_the_flag(tmp_path):
    """Runs on CPU too: the switches are the same there, and cuBLAS reads its variable only once it is used."""
    for flag in ("--deterministic", "--no-deterministic"):
        folder = tmp_path / flag.lstrip("-")
        run(probed(tmp_path) + QUICK + ["--max-steps", "2", flag] + outputs(folder), env=probe_env(folder))
        record = probes(folder)[0, 0]
        switches = (record["deterministic_algorithms"], record["cudnn_deterministic"], not record["cudnn_benchmark"])
        if flag == "--deterministic":
            assert switches == (True, True, True), record
            assert record["cublas_workspace_config"] in (":4096:8", ":16:8"), record
        else:
            assert not record["deterministic_algorithms"] and record["cublas_workspace_config"] is None, record


# ---- background snapshots of CUDA tensors -----------------------------------------------------------------------


def cycles_per_second():
    """How many cycles torch.cuda._sleep spins per second on this GPU."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10**8)
    end.record()
    end.synchronize()
    return 10**8 / (start.elapsed_time(end) / 1000)


@pytest.mark.gpu
@gpus(1)
def test_a_snapshot_of_cuda_tensors_leaves_the_training_thread_free_and_holds_the_state_at_save(tmp_path):
    """save() and wait_until_copied() return while the GPU is still busy with earlier work, without one
    host-device synchronization; the snapshot still holds the values that work produced, and not the changes
    enqueued after wait_until_copied() (what the optimizer does next)."""
    from {{ cookiecutter.project_slug }}.machinery.distributed import DistEnv
    from {{ cookiecutter.project_slug }}.machinery.snapshot import Snapshots, capture_rng, load_latest

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    weights = torch.zeros(1024, 1024, device=device)
    moments = [torch.zeros(1024, 1024, device=device), torch.zeros(1024, device=device)]
    snapshots = Snapshots(str(tmp_path / "snapshots"), DistEnv(device=device), keep=2)
    snapshots.prepare(2**26)
    try:

        def state(step):
            return {"model": {"weights": weights}, "optimizer": {"moments": moments}, "step": step}

        snapshots.save(1, state(1), {"rng": capture_rng()})  # the first save allocates the pinned buffers
        snapshots.wait_until_copied()
        snapshots.wait()

        busy_seconds = 2.0
        torch.cuda._sleep(int(busy_seconds * cycles_per_second()))  # the GPU is busy for two seconds...
        weights.fill_(1.0)  # ...and then computes the state the snapshot must hold
        for tensor in moments:
            tensor.fill_(2.0)
        shared, rank_state = state(2), {"rng": capture_rng()}
        started = time.perf_counter()
        torch.cuda.set_sync_debug_mode("error")  # any host-device synchronization on this path raises
        try:
            snapshots.save(2, shared, rank_state)
            snapshots.wait_until_copied()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        held = time.perf_counter() - started
        still_busy = not torch.cuda.current_stream(device).query()
        weights.add_(10.0)  # the optimizer's in-place step, enqueued after wait_until_copied()
        for tensor in moments:
            tensor.add_(10.0)
        snapshots.wait()
    finally:
        snapshots.close()

    assert still_busy, "the GPU finished its work before save() returned: the timing says nothing"
    assert held < busy_seconds / 4, f"the training thread waited {held:.2f} s in save() and wait_until_copied()"
    saved = load_latest(str(tmp_path / "snapshots"))
    assert saved["step"] == 2
    assert saved["model"]["weights"].device.type == "cpu"
    assert torch.equal(saved["model"]["weights"], torch.ones(1024, 1024))
    assert all(
        torch.equal(saved_moment, torch.full_like(saved_moment, 2.0)) for saved_moment in saved["optimizer"]["moments"]
    )


# ---- torch.compile ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@gpus(1)
def test_compile_on_a_gpu_trains_and_keeps_the_models_own_names(tmp_path):
    """Inductor on CUDA (the CPU tests use dynamo's eager backend); snapshots and the export hold the model's own
    state_dict names."""
    args = QUICK + ["--compile", "--backend", "nccl", "--max-steps", "20", "--snapshot-every", "10"]
    run(probed(tmp_path, 1) + args + outputs(tmp_path), env=probe_env(tmp_path / "probe"))
    done = summary(tmp_path)
    assert done["steps"] == 20 and done["last_loss"] < done["first_loss"], done
    assert probes(tmp_path / "probe")[0, 0]["device"] == "cuda:0"
    own_names = default_model_names()
    assert set(final_model(tmp_path / "run-snapshots")["model"]) == own_names
    assert set(torch.load(tmp_path / "run-export" / "model.pt", weights_only=True)) == own_names


def default_model_names():
    """The state_dict names of the model this project builds, unwrapped: no `module.` or `_orig_mod.` prefix."""
    from {{ cookiecutter.project_slug }} import model

    return set(model.build_model(default_config(), default_datasets()[0]).state_dict())


@pytest.mark.gpu
@gpus(1)
@pytest.mark.parametrize("amp", ["off", "bf16"])
def test_fsdp_on_a_gpu_resumes_bitwise_and_exports_plain_cpu_weights(tmp_path, amp):
    args = ARGS + ["--backend", "nccl", "--deterministic", "--amp", amp, "--strategy", "fsdp"]
    killed_and_resumed(tmp_path, 1, args)
    reference = torch.load(tmp_path / "reference-export" / "model.pt", weights_only=True, map_location="cpu")
    resumed = torch.load(tmp_path / "run-export" / "model.pt", weights_only=True)  # no map_location: saved on CPU
    assert_same_weights(reference, resumed)
    from {{ cookiecutter.project_slug }}.model import build_model

    train, _ = default_datasets()
    build_model(default_config(), train).load_state_dict(resumed)  # the plain model, on a CPU


@pytest.mark.gpu
@gpus(2)
def test_fsdp_with_nccl_on_two_gpus_resumes_bitwise(tmp_path):
    killed_and_resumed(tmp_path, 2, ARGS + ["--backend", "nccl", "--deterministic", "--strategy", "fsdp"])
    reference = torch.load(tmp_path / "reference-export" / "model.pt", weights_only=True, map_location="cpu")
    assert_same_weights(reference, torch.load(tmp_path / "run-export" / "model.pt", weights_only=True))
