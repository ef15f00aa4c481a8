"""The deployment configs users run: `ray up` YAMLs pass Ray's own validation, the Serve config passes Serve's
schema and names importable code, and the KubeRay manifest embeds the same Serve config. No Ray is started."""

from __future__ import annotations

import copy
import importlib
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
