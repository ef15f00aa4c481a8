"""Memory accounting for placement and `plan-cluster`: bytes from the name map equal the checkpoint's tensors, and
the packing arithmetic (slots, replicas on distinct GPUs, transition headroom, router GPU)."""

from __future__ import annotations

import json
import math

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


def test_router_gpus_are_kept_apart_on_one_node_or_on_router_nodes():
    # 5 slots per A100-40GB (see above); 8 experts x 2 replicas = 4 expert GPUs.
    one = plan_fit(_mem(0.5), "A100-40GB", gpus_per_node=8, replicas=2, routers=1)
    assert (one.expert_gpus, one.router_gpus, one.nodes, one.router_nodes) == (4, 1, 1, 0)
    assert one.layout == ("1 node of 8 GPUs: 1 GPU kept for 1 router replica x 1 GPU (1 on node 1); experts on 4 "
                          "of the other 7")
    # Experts fill a node exactly: the router's GPU needs a second node, not a share of an expert GPU.
    full = plan_fit(_mem(0.5), "A100-40GB", gpus_per_node=4, replicas=2, routers=1)
    assert (full.expert_gpus, full.router_gpus, full.nodes) == (4, 1, 2)
    assert missing_gpus_line(full, 4).startswith("the model needs 5 GPUs")
    halves = plan_fit(_mem(0.5), "A100-40GB", gpus_per_node=8, replicas=2, routers=3, router_gpus=0.5)
    assert halves.router_gpus == 2  # 2 + 1 replicas on two kept GPUs
    cpu = plan_fit(_mem(0.5), "A100-40GB", gpus_per_node=4, replicas=2, routers=2, router_gpus=0.0)
    assert (cpu.router_gpus, cpu.nodes) == (0, 1) and cpu.layout.startswith("1 node of 4 GPUs: routers on the CPU")
    # aws-gpu.yaml's shape: routers on a 1 x L40S g6e.xlarge of their own, experts on g6e.12xlarge (4 x L40S).
    aws = plan_fit(_mem(0.5), "L40S", gpus_per_node=4, replicas=2, routers=1, router_node=("aws:g6e.xlarge", "L40S", 1))
    assert (aws.router_nodes, aws.router_gpus, aws.nodes) == (1, 1, 1 + math.ceil(aws.expert_gpus / 4))
    assert aws.layout.startswith("router: 1 x aws:g6e.xlarge (1 GPU kept for 1 router replica x 1 GPU); experts: ")
    two = plan_fit(_mem(0.5), "L40S", gpus_per_node=4, replicas=2, routers=2, router_node=("aws:g6e.xlarge", "L40S", 1))
    assert two.router_nodes == 2
    with pytest.raises(ValueError, match="does not fit a aws:g6e.xlarge"):
        plan_fit(_mem(0.5), "L40S", gpus_per_node=4, router_gpus=2, router_node=("aws:g6e.xlarge", "L40S", 1))


def test_plan_cluster_cli_shows_the_router_gpus_kept(checkpoints, capsys):
    assert main(["plan-cluster", "--model", str(checkpoints["mixtral"]), "--node-type", "aws:p5.48xlarge"]) == 0
    out = capsys.readouterr().out
    assert "router GPUs" in out and "1 GPU kept for 1 router replica x 1 GPU (1 on node 1); experts on" in out
    assert main(["plan-cluster", "--model", str(checkpoints["mixtral"]), "--node-type", "gcp:g2-standard-48",
                 "--router-node-type", "gcp:g2-standard-12", "--replicas", "2", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)["fits"][0]
    assert (row["router_nodes"], row["router_gpus"], row["router_gpus_per_replica"]) == (1, 1, 1.0)
    assert row["layout"].startswith("router: 1 x gcp:g2-standard-12 (1 GPU kept")
