"""What an expert actor or router does when Ray gave it a GPU that torch cannot see (experts/devices.py): refuse with
one line naming what it was given, why torch sees no CUDA and what to do, unless devices.gpu_without_cuda says cpu;
the setting in the one config tree, its flag, and finding the line inside Ray's and Serve's error text."""

from __future__ import annotations

import pytest

from expertmesh.experts.devices import (
    DevicesConfig,
    compute_device,
    find_refusal,
    gpus_given,
    local_device,
)
from expertmesh.experts.errors import ConfigError
from expertmesh.ops.cli import build_parser
from expertmesh.ops.commands.mesh_flags import mesh_config_from_args
from expertmesh.router_service.config import MeshConfig


def test_no_gpu_given_computes_on_the_cpu_and_a_visible_gpu_on_cuda0():
    assert compute_device("expert actor a", None, cuda_available=False) == "cpu"
    assert compute_device("expert actor a", None, cuda_available=True) == "cpu"  # not given: not used
    assert compute_device("expert actor a", gpus_given(["2"]), cuda_available=True) == "cuda:0"


def test_a_gpu_without_cuda_refuses_in_one_line_naming_what_to_do():
    with pytest.raises(ConfigError) as err:
        compute_device("expert actor expert-e3-r0", gpus_given(["0"]), False, "refuse", "2.13.0+cpu", None, "0")
    assert err.value.field == "devices.gpu_without_cuda"
    line = str(err.value)
    assert "\n" not in line
    assert line.startswith("devices.gpu_without_cuda: expert actor expert-e3-r0 was given GPU 0 by Ray, but torch "
                           "sees no CUDA (torch 2.13.0+cpu is a CPU-only build)")
    for hint in ("a CUDA build of torch", "NVIDIA runtime", "devices.gpu_without_cuda: cpu", "--gpu-without-cuda cpu"):
        assert hint in line


def test_a_cuda_torch_without_a_visible_gpu_says_so():
    with pytest.raises(ConfigError) as err:
        compute_device("router replica", gpus_given([0, 1]), False, "refuse", "2.11.0+cu128", "12.8", "0,1")
    assert "was given GPUs 0,1 by Ray" in err.value.message
    assert "built for CUDA 12.8 but no GPU is visible" in err.value.message
    assert "CUDA_VISIBLE_DEVICES=0,1" in err.value.message


def test_the_escape_hatch_computes_on_the_cpu():
    assert compute_device("expert actor a", gpus_given(["0"]), False, "cpu") == "cpu"
    assert str(local_device("expert actor a", gpus_given(["0"]), "cpu")) == "cpu"  # this box: no CUDA


def test_the_line_is_found_in_ray_and_serve_error_text():
    try:
        compute_device("expert actor expert-e0-r0", gpus_given(["0"]), False, "refuse", "2.13.0+cpu", None)
    except ConfigError as exc:
        line = str(exc)
    ray_text = ("The actor died because of an error raised in its creation task, ray::ExpertActor.__init__() ...\n"
                "  File \"experts/devices.py\", line 60, in compute_device\n"
                f"    raise ConfigError(...)\nexpertmesh.experts.errors.ConfigError: {line}\n")
    assert find_refusal(ray_text) == line.split(": ", 1)[1]
    assert find_refusal("RuntimeError: Deploying application expertmesh failed: something else") is None


def test_the_setting_lives_in_the_config_tree_with_a_flag_and_is_checked():
    assert MeshConfig().devices == DevicesConfig("refuse")
    config = MeshConfig.from_dict({"devices": {"gpu_without_cuda": "cpu"}})
    assert config.devices.gpu_without_cuda == "cpu" and MeshConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ConfigError) as err:
        MeshConfig().replace(**{"devices.gpu_without_cuda": "gpu"}).validate()
    assert err.value.field == "devices.gpu_without_cuda"
    for command in ("serve", "generate --local --prompt x", "bench dispatch", "drill --kill actor"):
        args = build_parser().parse_args([*command.split(), "--gpu-without-cuda", "cpu"])
        assert mesh_config_from_args(args).devices.gpu_without_cuda == "cpu", command
