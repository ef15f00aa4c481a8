"""Memory accounting for placement and `plan-cluster`: bytes from the name map equal the checkpoint's tensors, and
the packing arithmetic (slots, replicas on distinct GPUs, transition headroom, router GPU)."""

from __future__ import annotations

import json

import pytest
from safetensors import safe_open

from expertmesh.cluster.memory_plan import GIB, ModelMemory, missing_gpus_line, model_memory, plan_fit
from expertmesh.experts.checkpoint import CheckpointReader
from expertmesh.ops.cli import main


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "olmoe"])
def test_model_bytes_equal_the_checkpoint_tensors(checkpoints, name):
    folder = checkpoints[name]
    cfg = CheckpointReader(folder).config
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        stored = {key: f.get_slice(key).get_shape() for key in f.keys()}
    numel = {key: 1 for key in stored}
    for key, shape in stored.items():
        for n in shape:
            numel[key] *= n
    mem = model_memory(cfg, "float32")
    assert mem.total_bytes == 4 * sum(numel.values())  # every stored tensor counted once, in fp32
    assert model_memory(cfg, "bfloat16").total_bytes * 2 == mem.total_bytes
    assert mem.kv_bytes_per_token == cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4


def _mem(shard_gib: float, layers: int = 10, experts: int = 8, dense_gib: float = 2.0) -> ModelMemory:
    return ModelMemory(int(dense_gib * GIB), int(shard_gib * GIB), layers, experts, 1024)


def test_slots_replicas_and_transition_room():
    # 40 GiB GPU at 0.9 = 36 GiB, minus 2 GiB reserve = 34; a layer-slot is 10 x 0.5 = 5 GiB; 1 kept for remaps.
    fit = plan_fit(_mem(0.5), "A100-40GB", gpus_per_node=8, replicas=1)
    assert fit.slots_per_gpu == 5 and fit.expert_gpus == 2 and fit.transition_room
    assert fit.nodes == 1 and fit.router_gpus == 1 and fit.router_fits
    two = plan_fit(_mem(0.5), "A100-40GB", gpus_per_node=8, replicas=2)
    assert two.expert_gpus == 4  # 16 shard sets / 5 per GPU
    many = plan_fit(_mem(0.1), "A100-40GB", gpus_per_node=8, replicas=3)
    assert many.slots_per_gpu == 8 and many.expert_gpus == 3  # all experts fit one GPU, but replicas need 3 GPUs
    tight = plan_fit(_mem(3.0), "A100-40GB", gpus_per_node=8)  # a 30 GiB layer-slot: no room beside it
    assert tight.slots_per_gpu == 1 and not tight.transition_room and tight.expert_gpus == 8
    with pytest.raises(ValueError, match="does not fit"):
        plan_fit(_mem(4.0), "A100-40GB", gpus_per_node=8)
    assert "missing" in missing_gpus_line(two, 3) and "5 GPUs" in missing_gpus_line(two, 3)


def test_plan_cluster_cli_prints_json(checkpoints, capsys):
    assert main(["plan-cluster", "--model", str(checkpoints["mixtral"]), "--gpu-type", "L4", "--gpus-per-node",
                 "4", "--replicas", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["family"] == "mixtral" and out["experts"] == 4 and out["fits"][0]["expert_gpus"] == 2
    assert main(["plan-cluster", "--model", str(checkpoints["olmoe"]), "--node-type", "aws:g5.12xlarge"]) == 0
    assert "aws:g5.12xlarge" in capsys.readouterr().out


def test_the_planner_s_topology_uses_the_same_accounting():
    from expertmesh.cluster.memory_plan import slots_per_gpu
    from expertmesh.cluster.shard_placement import Topology

    gpu, shard, layers = 80 * GIB, GIB // 4, 58
    live = Topology.from_memory(1, 8, gpu, shard, layers, utilization=0.9, reserve_bytes=2 * GIB, remap_headroom=True)
    assert live.slots_per_gpu == slots_per_gpu(gpu, shard, layers)[0] == 3  # (72 - 2 - 14.5) // 14.5
    assert Topology.from_memory(1, 8, gpu, shard, layers).slots_per_gpu == 5  # the whole GPU, no headroom
