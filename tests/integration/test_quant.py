"""Quantised experts (experts.quant) through real expert actors on a local Ray: the distributed logits equal the
in-process reference loaded with the same quant bit for bit, greedy generation equals the reference's, and each
actor reports its quant mode and its packed weight bytes (of this float32 checkpoint: INT8 about a quarter, INT4
about an eighth, plus scales)."""

from __future__ import annotations

import pytest
import torch

from expertmesh.experts.reference import load_reference_model
from expertmesh.router_service.mesh import ExpertMesh, MeshConfig
from tests.tiny_checkpoints import VOCAB, greedy_tokens

pytestmark = pytest.mark.usefixtures("local_ray")

PROMPT = [3, 14, 15, 92, 65, 35, 89, 79]
# Tiny Mixtral: 2 layers, 4 experts, gate_up [96, 32], down [32, 48], float32; one actor per expert (2 shards).
SHARD_SHAPES = ((96, 32), (32, 48))


@pytest.fixture(scope="module", params=["int8", "int4"])
def mesh(request, checkpoints):
    config = MeshConfig.from_dict({"model": {"path": str(checkpoints["mixtral"])},
                                   "experts": {"quant": request.param}, "controller": {"enabled": False}})
    with ExpertMesh(config) as mesh:
        yield request.param, mesh


def _sequences() -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (17, 5, 1)]


def test_distributed_equals_the_quantised_reference_bit_for_bit(mesh, checkpoints):
    quant, expert_mesh = mesh
    reference = load_reference_model(checkpoints["mixtral"], quant=quant)
    plain = load_reference_model(checkpoints["mixtral"])
    seqs = _sequences()
    want = reference.forward([torch.tensor(s) for s in seqs])
    float_logits = plain.forward([torch.tensor(s) for s in seqs])
    got = expert_mesh.score_batch(seqs)
    for g, w, f in zip(got, want, float_logits):
        assert torch.equal(g, w), (g - w).abs().max().item()
        assert not torch.equal(g, f)  # the quantised experts did run
    assert expert_mesh.router.generate(token_ids=PROMPT, max_tokens=6, stop_at_eos=False).token_ids == \
        greedy_tokens(reference, PROMPT, 6)


def test_actors_report_quant_and_packed_weight_bytes(mesh):
    quant, expert_mesh = mesh
    for info in expert_mesh.actor_info():
        assert info["quant"] == quant and info["dtype"] == "float32"
        per_shard = {"int8": sum(n * k + 4 * n for n, k in SHARD_SHAPES),  # int8 values + a float32 scale per row
                     "int4": sum(n * k // 2 + 8 * n for n, k in SHARD_SHAPES)}[quant]  # + scale, zero per row
        assert info["weight_bytes"] == per_shard * len(info["shards"])
        fp32 = sum(4 * n * k for n, k in SHARD_SHAPES) * len(info["shards"])
        # rows of 32 and 48 inputs carry a scale (and zero) each: 3.7x and 5.5x smaller than float32 here
        assert info["weight_bytes"] < fp32 / {"int8": 3.5, "int4": 5.0}[quant]
