"""GPU check of the expert memory tiers, Ray-free: shards in pinned host memory (the GPU's lower tier) brought onto
CUDA on demand and by prefetch, within the budget, and calls over them equal the all-resident per-expert compute on
the same GPU bit for bit. Run with `ops/gpu_check.sh`; skips cleanly without CUDA."""

from __future__ import annotations

import threading

import pytest
import torch

from expertmesh.experts.checkpoint import CheckpointReader
from expertmesh.experts.ffn import activation, gated_mlp
from expertmesh.experts.tier_store import HostTier, TierStore, pinned_copy
from expertmesh.experts.weights import load_expert_shards
from tests.tiny_checkpoints import write_direct_mixtral

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
CUDA = torch.device("cuda:0")


def test_host_tier_on_cuda_equals_resident_bit_for_bit(tmp_path):
    reader = CheckpointReader(write_direct_mixtral(tmp_path / "m", layers=3, experts=4))
    shards = [(layer, e) for layer in range(3) for e in range(4)]
    resident = load_expert_shards(reader, shards, torch.float32, CUDA)
    host = {s: pinned_copy(w) for s, w in load_expert_shards(reader, shards, torch.float32, "cpu").items()}
    assert all(w.gate_up.is_pinned() for w in host.values())
    size = resident[(0, 0)].nbytes()
    store = TierStore(shards, HostTier(host, CUDA), 3 * size)
    silu = activation("silu")
    gen = torch.Generator().manual_seed(0)
    for layer in [0, 1, 2, 0, 1, 2]:
        store.prefetch([(layer + 1, 0), (layer + 1, 1)] if layer < 2 else [])
        experts, counts = [0, 2], [3, 5]
        x = torch.randn(8, 32, generator=gen).to(CUDA)  # [N, H]
        weights = store.acquire(layer, experts)
        assert all(w.gate_up.device.type == "cuda" for w in weights)
        got = torch.cat([gated_mlp(r, w, silu) for w, r in zip(weights, x.split(counts))])
        store.release(layer, experts)
        want = torch.cat([gated_mlp(r, resident[(layer, e)], silu) for e, r in zip(experts, x.split(counts))])
        assert torch.equal(got, want)
        assert store.resident_bytes() <= store.budget_bytes
    threading.Event().wait(0.1)
    assert store.stats()["bytes_moved"] > 0 and store.stats()["tier"] == "host"
    store.close()


def test_a_host_tier_load_overlaps_kernels_already_queued_on_the_compute_stream(tmp_path):
    """The copy runs on the tier's own stream: a load started while the default stream is busy returns before that
    work ends (a copy on the default stream would queue behind it and return only after)."""
    reader = CheckpointReader(write_direct_mixtral(tmp_path / "m", layers=1, experts=2))
    host = {s: pinned_copy(w) for s, w in load_expert_shards(reader, [(0, 0)], torch.float32, "cpu").items()}
    tier = HostTier(host, CUDA)
    tier.fetch((0, 0))  # the copy stream exists, the allocator has warmed up
    a = torch.randn(4096, 4096, device=CUDA)
    torch.cuda.synchronize()
    for _ in range(50):  # ~100 ms or more of kernels queued on the default stream
        a = torch.tanh(a @ a)
    tier.fetch((0, 0))
    busy_after_load = not torch.cuda.default_stream(CUDA).query()
    torch.cuda.synchronize()
    assert busy_after_load, "the load waited for the compute stream's queued kernels"
