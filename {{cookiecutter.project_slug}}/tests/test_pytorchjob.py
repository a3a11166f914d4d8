"""scripts/pytorchjob.yaml against the Kubeflow training operator's published models and docs/scaling.md."""

import json
import re
import shlex
import sys
from types import SimpleNamespace

import pytest
from conftest import ROOT

yaml = pytest.importorskip("yaml")
training = pytest.importorskip("kubeflow.training", reason="pip install -e '.[dev]' installs kubeflow-training")

sys.path.insert(0, str(ROOT))

from {{ cookiecutter.project_slug }} import config

MANIFEST = ROOT / "scripts" / "pytorchjob.yaml"
DOCS = ROOT / "docs" / "scaling.md"


@pytest.fixture(scope="module")
def job():
    return yaml.safe_load(MANIFEST.read_text(encoding="utf-8"))


def container(job):
    """The container the operator gives its variables and ports to: the one named "pytorch"."""
    template = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]
    return next(c for c in template["spec"]["containers"] if c["name"] == "pytorch")


def operator_env(job):
    """The variables the training operator (v1) sets in each pod of an elastic PyTorchJob, from its spec."""
    spec, policy = job["spec"], job["spec"]["elasticPolicy"]
    port = next(p["containerPort"] for p in container(job)["ports"] if p["name"] == "pytorchjob-port")
    return {
        "PET_NNODES": f"{policy['minReplicas']}:{policy['maxReplicas']}",
        "PET_NPROC_PER_NODE": spec["nprocPerNode"],
        "PET_RDZV_BACKEND": policy["rdzvBackend"],
        "PET_RDZV_ENDPOINT": f"{job['metadata']['name']}-worker-0:{port}",
        "PET_MAX_RESTARTS": str(policy["maxRestarts"]),
    }


def docs_kubernetes_blocks():
    """The code blocks of docs/scaling.md's Kubernetes section, continuation lines joined."""
    text = DOCS.read_text(encoding="utf-8")
    section = text.split("\n## Kubernetes")[1].split("\n## ")[0]
    return [block.split("\n", 1)[1].replace("\\\n", " ") for block in section.split("```")[1::2]]


def lost(kept, given, path="$"):
    """Where `kept` (the manifest as the models hold it) differs from `given` (the manifest as written)."""
    if isinstance(given, dict) and isinstance(kept, dict):
        return [p for key in given.keys() | kept.keys() for p in lost(kept.get(key), given.get(key), f"{path}.{key}")]
    if isinstance(given, list) and isinstance(kept, list) and len(given) == len(kept):
        return [p for i, (k, g) in enumerate(zip(kept, given, strict=True)) for p in lost(k, g, f"{path}[{i}]")]
    return [] if kept == given else [f"{path}: {given!r} in the manifest, {kept!r} in the models"]


def test_the_operator_models_hold_every_field_as_written(job):
    client = training.ApiClient()
    model = client.deserialize(SimpleNamespace(data=json.dumps(job)), "KubeflowOrgV1PyTorchJob")
    differences = "\n".join(lost(client.sanitize_for_serialization(model), job))
    assert not differences, f"the training operator's models do not hold the manifest as written:\n{differences}"
    # What the operator's admission webhook refuses: a name that is no DNS-1035 label (with room for the pods'
    # "-worker-N"), no container named "pytorch", no image.
    assert re.fullmatch(r"[a-z]([-a-z0-9]{0,48}[a-z0-9])?", job["metadata"]["name"]), job["metadata"]["name"]
    assert container(job)["image"]


def test_each_pod_runs_the_torchrun_line_the_docs_show(job):
    env = operator_env(job)
    unset = set(re.findall(r"\$\((\w+)\)", " ".join(container(job)["command"]))) - env.keys()
    assert not unset, f"the command uses variables the operator does not set: {sorted(unset)}"
    command = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], arg) for arg in container(job)["command"]]
    shown = [shlex.split(block) for block in docs_kubernetes_blocks() if block.startswith("torchrun ")]
    assert shown == [command]
    policy = job["spec"]["elasticPolicy"]
    assert policy["rdzvBackend"] == "c10d" and policy["minReplicas"] <= policy["maxReplicas"]


def test_snapshots_go_to_a_bucket_with_credentials_from_the_documented_secret(job):
    command = container(job)["command"]
    cfg = config.parse_args(command[command.index("train.py") + 1 :])
    assert cfg.snapshot_dir.startswith("s3://")
    secrets = [source["secretRef"]["name"] for source in container(job)["envFrom"]]
    created = [
        shlex.split(line)
        for block in docs_kubernetes_blocks()
        for line in block.splitlines()
        if line.startswith("kubectl create secret generic ")
    ]
    assert [args[4] for args in created] == secrets
    keys = {arg.split("=")[1] for arg in created[0] if arg.startswith("--from-literal=")}
    assert {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} <= keys
