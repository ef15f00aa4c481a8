"""The deployment configs users run: `ray up` YAMLs pass Ray's own validation, the Serve config passes Serve's
schema and names importable code, and the KubeRay manifest embeds the same Serve config. No Ray is started."""

from __future__ import annotations

import copy
import importlib
import re
from pathlib import Path

import pytest
import yaml

CONFIGS = Path(__file__).resolve().parents[2] / "cluster" / "configs"


def load(name: str) -> dict:
    return yaml.safe_load((CONFIGS / name).read_text())


@pytest.mark.parametrize("name", ["aws-gpu.yaml", "gcp-gpu.yaml"])
def test_launcher_yaml_passes_ray_validation(name):
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = load(name)
    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)  # raises on any schema or consistency error
    head = config["available_node_types"][config["head_node_type"]]
    workers = [t for n, t in config["available_node_types"].items() if n != config["head_node_type"]]
    assert head["resources"].get("GPU", 0) == 0, "experts belong on GPU workers"
    assert workers and all(0 < w["min_workers"] <= w["max_workers"] for w in workers)
    setup = " ".join(config["setup_commands"])
    assert setup.index("torch") < setup.index("expertmesh"), "install a CUDA torch before expertmesh"


def test_launcher_validation_rejects_a_broken_yaml():
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = load("aws-gpu.yaml")
    config["head_node_type"] = "no-such-type"
    with pytest.raises(ValueError):
        validate_config(prepare_config(config))


def test_serve_config_passes_serve_schema_and_names_importable_code():
    from ray.serve.schema import ServeDeploySchema

    config = load("serve_config.yaml")
    schema = ServeDeploySchema.model_validate(config)
    app = schema.applications[0]
    module, attr = app.import_path.split(":")
    assert callable(getattr(importlib.import_module(module), attr))
    for path in config["grpc_options"]["grpc_servicer_functions"]:
        module, _, attr = path.rpartition(".")
        assert callable(getattr(importlib.import_module(module), attr)), path
    assert config["http_options"]["host"] == "127.0.0.1"


def test_kuberay_manifest_embeds_the_serve_config():
    manifest = load("kuberay-rayservice.yaml")
    assert manifest["kind"] == "RayService" and manifest["apiVersion"] == "ray.io/v1"
    assert yaml.safe_load(manifest["spec"]["serveConfigV2"]) == load("serve_config.yaml")
    workers = manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    limits = workers[0]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert int(limits["nvidia.com/gpu"]) >= 1


PLACEHOLDER = re.compile(r"your[-_ ]|<[^<>\n]*>|\bTODO\b|CHANGEME|example\.com|\bxxx+\b|\bREPLACE", re.IGNORECASE)
DOCKERFILE = CONFIGS.parent / "docker" / "Dockerfile"


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")) + [DOCKERFILE], ids=lambda p: p.name)
def test_no_placeholders(path):
    text = path.read_text()
    found = [m.group(0) for m in PLACEHOLDER.finditer(text)]
    assert not found, f"{path.name}: placeholder text {found}"


def test_the_placeholder_check_catches_placeholders():
    for text in ("git+https://github.com/your-org/x", "image: <registry>/x", "project_id: CHANGEME"):
        assert PLACEHOLDER.search(text), text


def _dockerfile() -> tuple[str, str]:
    """(base image, torch install line) of the Dockerfile."""
    lines = [line.strip() for line in DOCKERFILE.read_text().splitlines() if line.strip() and not line.startswith("#")]
    base = next(line.split()[1] for line in lines if line.startswith("FROM "))
    torch = next(line for line in lines if "torch==" in line)
    return base, torch


@pytest.mark.parametrize("name", ["aws-gpu.yaml", "gcp-gpu.yaml"])
def test_launcher_yaml_runs_the_dockerfile_s_image_and_installs_this_checkout(name):
    config = load(name)
    base, torch_line = _dockerfile()
    assert config["docker"]["image"] == base
    pin = re.search(r"torch==\S+ --index-url \S+", torch_line).group(0)
    setup = config["setup_commands"]
    assert any(pin in command for command in setup), f"{name}: install {pin} as the Dockerfile does"
    # Every path a setup command installs from is mounted on every node.
    mounted = set(config["file_mounts"])
    for command in setup:
        for path in re.findall(r"(/home/\S+)", command):
            assert any(path == m or path.startswith(m + "/") for m in mounted), f"{name}: {path} is not mounted"
    assert config["file_mounts"]["/home/ray/expertmesh"] == "."
    # The nodes' OS image is pinned to an NVIDIA-driver image (not Ray's default AMI).
    for node in config["available_node_types"].values():
        image = node["node_config"].get("ImageId") or node["node_config"]["disks"][0]["initializeParams"]["sourceImage"]
        assert "nvidia" in image


def test_kuberay_runs_the_dockerfile_s_image_and_serves_a_hub_model():
    manifest = load("kuberay-rayservice.yaml")
    cluster = manifest["spec"]["rayClusterConfig"]
    pods = [cluster["headGroupSpec"]] + cluster["workerGroupSpecs"]
    images = {c["image"] for pod in pods for c in pod["template"]["spec"]["containers"]}
    assert images == {"expertmesh:0.1.0"}
    assert "-t expertmesh:0.1.0" in DOCKERFILE.read_text()
    args = load("serve_config.yaml")["applications"][0]["args"]
    from expertmesh.experts.model_source import is_repo_id

    assert is_repo_id(args["model"]["path"]) and args["model"]["dtype"] == "bfloat16" and args["router"]["gpus"] == 1
