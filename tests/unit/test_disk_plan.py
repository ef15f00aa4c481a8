"""Disk per node when every process fetches only what it reads (cluster/memory_plan.py:disk_per_node, stored_bytes),
and `expertmesh plan-cluster` printing it."""

from __future__ import annotations

import json

import pytest

from expertmesh.cluster.memory_plan import StoredBytes, disk_per_node, plan_fit, stored_bytes
from expertmesh.experts.checkpoint import CheckpointReader
from expertmesh.ops.cli import main
from tests.tiny_checkpoints import write_mixed_shards

GB = 10**9
# Mixtral-8x7B as published (bf16): a shard is w1, w3 [14336, 4096] + w2 [4096, 14336]; dense 1.6 B parameters.
MIXTRAL = StoredBytes(dense=3_211_272_192, shard=3 * 14336 * 4096 * 2, metadata=2_000_000, moe_layers=32, experts=8)


def test_each_role_s_disk():
    assert MIXTRAL.whole == pytest.approx(93.4 * GB, rel=0.01)  # what every node downloaded with whole files
    # 8 GPUs, one expert of every layer each, all on one node: that node holds every expert, the head none.
    one_node = disk_per_node(MIXTRAL, slots_per_gpu=1, expert_gpus=8, gpus_per_node=8)
    assert one_node == {"head": 2_000_000, "router_node": 3_213_272_192,
                        "expert_node": 2_000_000 + 8 * 32 * MIXTRAL.shard, "whole": MIXTRAL.whole}
    # 4 GPUs a node: a node's actors host 4 experts, half the expert bytes.
    assert disk_per_node(MIXTRAL, 1, 8, 4)["expert_node"] == 2_000_000 + 4 * 32 * MIXTRAL.shard
    # Two slots a GPU on 2 GPUs a node: 4 experts a node again.
    assert disk_per_node(MIXTRAL, 2, 4, 2)["expert_node"] == 2_000_000 + 4 * 32 * MIXTRAL.shard
    # Two replicas on 16 GPUs, 8 a node: a node has 8 distinct experts at most (replicas on a node share bytes).
    assert disk_per_node(MIXTRAL, 1, 16, 8, replicas=2)["expert_node"] == 2_000_000 + 8 * 32 * MIXTRAL.shard
    # Fewer experts than a node's GPUs could host: the node still holds each expert once.
    assert disk_per_node(MIXTRAL, 3, 4, 8)["expert_node"] == 2_000_000 + 8 * 32 * MIXTRAL.shard


def test_with_plan_fit_s_layout():
    """The disk figure follows the GPU plan of the same node type (H100 nodes of 8, bf16 Mixtral)."""
    from expertmesh.cluster.memory_plan import ModelMemory

    mem = ModelMemory(dense_bytes=MIXTRAL.dense, shard_bytes=MIXTRAL.shard, moe_layers=32, experts=8,
                      kv_bytes_per_token=131072)
    fit = plan_fit(mem, "H100", 8)
    disk = disk_per_node(MIXTRAL, fit.slots_per_gpu, fit.expert_gpus, fit.gpus_per_node)
    assert fit.slots_per_gpu == 5 and fit.expert_gpus == 2  # 11.3 GB a layer-slot
    assert disk["expert_node"] == 2_000_000 + 8 * 32 * MIXTRAL.shard  # both expert GPUs on one node


def test_stored_bytes_are_the_checkpoint_s(tmp_path):
    folder = write_mixed_shards(tmp_path / "m", files=3, layers=2, experts=4, hidden=32, inter=64)
    reader = CheckpointReader(folder)
    stored = stored_bytes(reader)
    total = json.loads((folder / "model.safetensors.index.json").read_text())["metadata"]["total_size"]
    assert stored.dense + stored.shard * 2 * 4 == total
    assert stored.shard == 3 * 32 * 64 * 4
    files = sum((folder / f).stat().st_size for f in ("config.json", "model.safetensors.index.json"))
    assert stored.metadata == files + reader.header_bytes()
    assert stored.whole == sum(p.stat().st_size for p in folder.iterdir())  # every byte of the folder, once


def test_plan_cluster_prints_disk_per_node(tmp_path, capsys):
    folder = write_mixed_shards(tmp_path / "m", files=3, layers=2, experts=4, hidden=32, inter=64)
    assert main(["plan-cluster", "--model", str(folder), "--gpu-type", "L4", "--gpus-per-node", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    stored = stored_bytes(CheckpointReader(folder))
    assert out["disk_bytes"] == {"head": stored.metadata, "router_node": stored.metadata + stored.dense,
                                 "whole_checkpoint": stored.whole}
    fit = out["fits"][0]
    assert fit["expert_node_disk_bytes"] == disk_per_node(stored, fit["slots_per_gpu"], fit["expert_gpus"],
                                                          fit["gpus_per_node"])["expert_node"]
    assert main(["plan-cluster", "--model", str(folder), "--gpu-type", "L4"]) == 0
    assert "disk per node (Hub cache, as stored): head " in capsys.readouterr().out
