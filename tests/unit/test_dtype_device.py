"""dtype end to end and the device-aware router, without Ray: resolving model.dtype ("auto" against the checkpoint
and the device), the flags reaching the config from every entry point, what a router replica asks Ray for, weights
cast once per tensor without a widened copy, and one host synchronisation per layer however many calls it makes."""

from __future__ import annotations

import json

import pytest
import torch

from expertmesh.cluster.routing_table import RoutingTable
from expertmesh.experts.arrays import HostStager
from expertmesh.experts.checkpoint import CheckpointReader
from expertmesh.experts.dtypes import checkpoint_dtype, read_checkpoint_dtype, resolve_dtype, torch_dtype
from expertmesh.experts.gating import route
from expertmesh.experts.reproducible import CPU_ALIGN
from expertmesh.experts.weights import load_dense_weights, load_expert_shards
from expertmesh.ops.cli import build_parser
from expertmesh.ops.commands.mesh_flags import mesh_config_from_args
from expertmesh.router_service.config import ConfigError, MeshConfig
from expertmesh.router_service.deployment import replica_threads, router_options
from expertmesh.router_service.dispatch import RemoteExperts
from expertmesh.router_service.router import router_device
from tests.fakes import HIDDEN, FakeTransport, expert_weights


@pytest.mark.parametrize(("requested", "stored", "on_gpu", "want"), [
    ("auto", "bfloat16", True, "bfloat16"),  # a GPU computes in what the checkpoint stores
    ("auto", "float16", True, "float16"),
    ("auto", "bfloat16", False, "float32"),  # a CPU in float32 whatever is stored
    ("auto", None, True, "float32"),  # unknown (or float64) stored dtype: float32
    ("auto", None, False, "float32"),
    ("bfloat16", "float32", False, "bfloat16"),  # a named dtype is taken as is, on any device
    ("float16", "bfloat16", True, "float16"),
    ("float32", "bfloat16", True, "float32"),
])
def test_resolve_dtype(requested, stored, on_gpu, want):
    assert resolve_dtype(requested, stored, on_gpu) == want
    assert torch_dtype(want) == getattr(torch, want)


def test_resolve_dtype_refuses_unknown_names():
    with pytest.raises(ValueError, match="dtype: must be one of"):
        resolve_dtype("int8", None, False)
    with pytest.raises(ValueError, match="dtype: must be one of"):
        torch_dtype("auto")


@pytest.mark.parametrize(("raw", "want"), [
    ({"torch_dtype": "bfloat16"}, "bfloat16"),  # transformers < 5
    ({"dtype": "float16"}, "float16"),  # transformers 5
    ({"dtype": "torch.bfloat16"}, "bfloat16"),
    ({"dtype": "bfloat16", "torch_dtype": "float32"}, "bfloat16"),  # the newer key wins
    ({"torch_dtype": "float64"}, None),
    ({}, None),
])
def test_checkpoint_dtype_reads_either_key(raw, want):
    assert checkpoint_dtype(raw) == want


def test_read_checkpoint_dtype_of_a_saved_checkpoint(checkpoints, tmp_path):
    assert read_checkpoint_dtype(checkpoints["mixtral"]) == "float32"  # save_pretrained wrote it
    assert read_checkpoint_dtype(tmp_path) is None  # no config.json


def test_defaults_are_auto_dtype_cpu_router_and_unset_threads():
    config = MeshConfig()
    assert (config.model.dtype, config.router.gpus, config.router.threads) == ("auto", 0.0, None)


COMMANDS = ["serve", "generate --local --prompt x", "score --local --token-ids 1,2", "bench dispatch",
            "drill --kill actor"]


@pytest.mark.parametrize("command", COMMANDS)
def test_dtype_router_gpus_and_threads_flags_reach_the_config_from_every_entry_point(command):
    args = build_parser().parse_args([*command.split(), "--dtype", "bfloat16", "--router-gpus", "0.5",
                                      "--router-threads", "3"])
    config = mesh_config_from_args(args)
    assert (config.model.dtype, config.router.gpus, config.router.threads) == ("bfloat16", 0.5, 3)
    assert mesh_config_from_args(build_parser().parse_args(command.split())).model.dtype == "auto"


def test_the_config_file_and_serve_args_carry_them(tmp_path):
    path = tmp_path / "mesh.json"
    path.write_text(json.dumps({"model": {"dtype": "float16"}, "router": {"gpus": 1, "threads": 2}}))
    config = MeshConfig.load(path).validate()
    assert (config.model.dtype, config.router.gpus, config.router.threads) == ("float16", 1.0, 2)
    assert MeshConfig.from_dict(config.to_dict()) == config  # what Serve ships to a replica


@pytest.mark.parametrize(("settings", "field"), [
    ({"model.dtype": "int8"}, "model.dtype"),
    ({"router.gpus": -1.0}, "router.gpus"),
    ({"router.gpus": 1.5}, "router.gpus"),
    ({"router.gpus": float("inf")}, "router.gpus"),
    ({"router.threads": 0}, "router.threads"),
])
def test_bad_values_are_refused_naming_the_field(settings, field):
    with pytest.raises(ConfigError) as err:
        MeshConfig().replace(**settings).validate()
    assert err.value.field == field


@pytest.mark.parametrize(("router", "cpus", "gpus"), [
    ({}, 0, 0.0),  # default: no reservation (the actors own the node's CPUs), CPU router
    ({"gpus": 0.5}, 1, 0.5),  # a GPU router reserves one CPU to feed it
    ({"threads": 4}, 4, 0.0),  # threads reserve as many CPUs
    ({"threads": 2, "gpus": 1}, 2, 1.0),
])
def test_router_replica_asks_ray_for_its_cpus_and_gpus(router, cpus, gpus):
    options = router_options(MeshConfig.from_dict({"router": router}))
    actor = options["ray_actor_options"]
    assert (actor["num_cpus"], actor["num_gpus"]) == (cpus, gpus)
    assert "RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH" in actor["runtime_env"]["env_vars"]


def test_replica_threads_default_to_the_cpus_it_was_given():
    assert replica_threads(None, 4.0) == 4
    assert replica_threads(None, 0.0) == 1  # none reserved: one thread
    assert replica_threads(3, 8.0) == 3


def test_router_device():
    assert router_device(0.0, True) == torch.device("cpu")  # no GPU asked for: CPU even when one is visible
    assert router_device(0.0, False) == torch.device("cpu")
    assert router_device(0.5, True) == torch.device("cuda:0")
    assert router_device(1.0, True, gpu_ids=[3]) == torch.device("cuda:0")  # cuda:0 is the GPU Ray assigned


def test_a_router_given_a_gpu_torch_cannot_see_refuses_unless_told_to_use_the_cpu():
    with pytest.raises(ConfigError) as err:
        router_device(1.0, False, gpu_ids=[3])  # a Serve replica Ray gave GPU 3
    assert err.value.field == "devices.gpu_without_cuda" and "\n" not in str(err.value)
    assert err.value.message.startswith("router replica was given GPU 3 by Ray, but torch sees no CUDA")
    with pytest.raises(ConfigError, match="router asks for router.gpus 0.5, but torch sees no CUDA"):
        router_device(0.5, False)  # the in-process router asks; nobody gives
    assert router_device(1.0, False, "cpu", gpu_ids=[3]) == torch.device("cpu")  # the escape hatch


def _bf16_checkpoint(checkpoints, tmp_path):
    """The tiny Mixtral saved in bfloat16 (as published checkpoints are)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoints["mixtral"], dtype=torch.bfloat16)
    model.save_pretrained(tmp_path / "bf16")
    return tmp_path / "bf16"


def test_weights_are_read_in_their_stored_dtype_and_never_widened(checkpoints, tmp_path, monkeypatch):
    folder = _bf16_checkpoint(checkpoints, tmp_path)
    assert read_checkpoint_dtype(folder) == "bfloat16"
    reader = CheckpointReader(folder)
    read: list[torch.Tensor] = []
    original = CheckpointReader.read_many

    def recording(self, wanted, progress=None, **options):
        out = original(self, wanted, progress, **options)
        read.extend(out.values())
        return out

    monkeypatch.setattr(CheckpointReader, "read_many", recording)
    dense = load_dense_weights(reader, torch.bfloat16)
    assert read and all(t.dtype == torch.bfloat16 for t in read)  # read as stored: no fp32 copy was made
    stored = {t.data_ptr() for t in read}
    assert dense.embed.dtype == torch.bfloat16 and dense.embed.data_ptr() in stored  # cast to its own dtype: no copy
    shards = [(0, 0), (1, 3)]
    experts = load_expert_shards(reader, shards, torch.bfloat16)
    assert all(w.gate_up.dtype == w.down.dtype == torch.bfloat16 for w in experts.values())
    # Used as read, except that a tensor read off the 64-byte boundary is copied once onto it, in its own dtype
    # (experts/reproducible.py: a one-row product's bits depend on where its weight starts).
    assert all(w.down.data_ptr() % CPU_ALIGN == 0 for w in experts.values())
    copied = sum(w.down.data_ptr() not in {t.data_ptr() for t in read} for w in experts.values())
    assert copied <= sum(1 for t in read if t.data_ptr() % CPU_ALIGN)


def test_a_cast_happens_once_per_tensor(checkpoints, monkeypatch):
    reader = CheckpointReader(checkpoints["mixtral"])
    casts = []
    original = torch.Tensor.to

    def counting(self, *args, **kwargs):
        casts.append(self.dtype)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", counting)
    load_dense_weights(reader, torch.bfloat16)
    from expertmesh.experts.weights import dense_tensor_names

    assert len(casts) == len(dense_tensor_names(reader.config))
    assert set(casts) == {torch.float32}  # each stored tensor cast once, straight to bf16


def _remote(stager: HostStager):
    shards = expert_weights(layers=2, experts=4)
    table = RoutingTable.from_actor_shards({f"a{e}": [(layer, e) for layer in range(2)] for e in range(4)})
    backend = RemoteExperts(table, FakeTransport(table, shards))
    backend.stager = stager
    return backend


def test_one_host_synchronisation_per_layer_not_per_call():
    syncs: list[torch.device] = []
    stager = HostStager(synchronize=syncs.append, always_stage=True)  # stage host tensors as if on a device
    backend = _remote(stager)
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(24, HIDDEN, generator=gen)  # [T, H]
    routing = route(torch.randn(24, 4, generator=gen), top_k=2, renormalize=True)  # reaches all 4 actors
    plain = _remote(HostStager())
    for layer in range(2):
        got = backend.run(layer, hidden, routing)
        assert backend.calls_per_layer[layer] == 4
        assert torch.equal(got, plain.run(layer, hidden, routing))  # staging changes no bit
    # Per layer the routing's tensors (experts, weights, probs) and the hidden state [T, H] cross once (the rows of all
    # 4 calls are gathered from that host copy), whatever the number of calls ...
    assert stager.copies == 8
    assert stager.syncs == len(syncs) == 2  # ... with one wait per layer


def test_host_tensors_need_no_staging_and_no_wait():
    stager = HostStager(synchronize=lambda device: pytest.fail("no wait for host tensors"))
    x = torch.randn(3, 4)
    assert stager.stage(x).data_ptr() == x.data_ptr()
    stager.finish()
    assert (stager.copies, stager.syncs) == (0, 0)
