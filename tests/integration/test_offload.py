"""Expert memory tiers and prefetch through the real actors and routers (README: Offload): with a device budget of
one shard per actor (half of what each hosts), served logits and greedy tokens equal the in-process all-resident
reference bit for bit, on the refs and socket transports with pre-gating prefetch and on gRPC with history prefetch
(hints riding with each layer's calls on all three, and as calls of their own to actors a layer does not call); the
actors stay within budget and count their misses and loads."""

from __future__ import annotations

import pytest
import torch

from expertmesh.experts.checkpoint import CheckpointReader
from expertmesh.experts.weights import load_expert_shards
from expertmesh.router_service.mesh import ExpertMesh, MeshConfig
from expertmesh.router_service.prefetch import prefetch_note
from expertmesh.router_service.router import Router
from tests.tiny_checkpoints import VOCAB, greedy_tokens

pytestmark = pytest.mark.usefixtures("local_ray")
PROMPT = [3, 14, 15, 92, 65, 35, 89, 79]


@pytest.fixture(scope="module")
def shard_bytes(checkpoints) -> int:
    return load_expert_shards(CheckpointReader(checkpoints["mixtral"]), [(0, 0)])[(0, 0)].nbytes()


@pytest.fixture(scope="module")
def mesh(checkpoints, shard_bytes):
    """One actor per expert (the per-expert layout, not the default sized to this machine's cores), each with a
    budget of one shard (they host two: expert e of both MoE layers); the mesh's own router
    prefetches by pre-gating (auto) over refs, a second router over the socket transport likewise, a third over gRPC
    by history."""
    config = MeshConfig.from_dict({"model": {"path": str(checkpoints["mixtral"])}, "controller": {"enabled": False},
                                   "experts": {"memory_gb": shard_bytes / 2**30, "layout": "per-expert"},
                                   "router": {"transport": "refs"}})
    with ExpertMesh(config) as mesh:
        socket_router = Router(mesh.pool.spec, mesh.actors, config.replace(**{"router.transport": "socket"}))
        grpc_router = Router(mesh.pool.spec, mesh.actors,
                             config.replace(**{"router.transport": "grpc", "experts.prefetch": "history"}))
        try:
            yield mesh, {"refs+gate": mesh.router, "socket+gate": socket_router, "grpc+history": grpc_router}
        finally:
            socket_router.close()
            grpc_router.close()


def _sequences() -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (17, 5, 1)]


def test_offloaded_serving_equals_the_resident_reference_bit_for_bit(mesh, reference):
    _, routers = mesh
    seqs = _sequences()
    want = reference.forward([torch.tensor(s) for s in seqs])
    tokens = greedy_tokens(reference, PROMPT, 6)
    for name, router in routers.items():
        for got, w in zip(router.score_batch(seqs), want):
            assert torch.equal(got, w), (name, (got - w).abs().max().item())
        assert router.generate(token_ids=PROMPT, max_tokens=6, stop_at_eos=False).token_ids == tokens, name
        stats = router.backend.prefetcher.stats()
        assert stats["actual_shards"] > 0 and stats["hit_shards"] > 0, (name, stats)
        # The governor (on by default) is in its first, hinted window after 5 decode steps: still measuring.
        assert stats["governor"]["measuring"] and prefetch_note(router.backend.prefetcher).endswith("measuring")
        # Hints ride with the layer's calls on every transport here; actors a layer does not call get their own.
        assert router.backend.prefetch_riding > 0 and router.backend.prefetch_calls > 0, name


def test_actors_keep_to_their_budget_and_count_loads(mesh, shard_bytes):
    expert_mesh, routers = mesh
    routers["refs+gate"].generate(token_ids=PROMPT, max_tokens=4, stop_at_eos=False)
    infos = expert_mesh.actor_info()
    assert len(infos) == 4
    for info in infos:
        tiers = info["tiers"]
        assert tiers["tier"] == "disk" and tiers["budget_bytes"] == shard_bytes and tiers["hosted_shards"] == 2
        assert tiers["resident_bytes"] <= shard_bytes and info["weight_bytes"] == tiers["resident_bytes"]
        assert len(info["shards"]) == 2
    total = {key: sum(i["tiers"][key] for i in infos) for key in ("misses", "bytes_moved", "prefetch_issued")}
    assert total["misses"] > 0 and total["bytes_moved"] >= shard_bytes and total["prefetch_issued"] > 0, total
