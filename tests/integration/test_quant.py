"""Quantised experts (experts.quant) through real expert actors on a local Ray: the distributed logits equal the
in-process reference loaded with the same quant bit for bit, greedy generation equals the reference's, and each
actor reports its quant mode and its packed weight bytes (INT8 about half, INT4 about a quarter of bf16, plus
scales)."""

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
    """bf16, where torch's packed kernels run (float32 dequantises per call, experts/quant.py): int8 takes its kernel
    for calls of ≤ 32 rows (decode) and dequantises larger ones (the 60-token prompt); int4 takes its kernel for
    gate_up (32 inputs) and dequantises down (48 inputs: no kernel for a group of 48)."""
    config = MeshConfig.from_dict({"model": {"path": str(checkpoints["mixtral"]), "dtype": "bfloat16"},
                                   "experts": {"quant": request.param}, "controller": {"enabled": False}})
    with ExpertMesh(config) as mesh:
        yield request.param, mesh


def _sequences() -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (60, 17, 5, 1)]


def test_distributed_equals_the_quantised_reference_bit_for_bit(mesh, checkpoints):
    quant, expert_mesh = mesh
    reference = load_reference_model(checkpoints["mixtral"], torch.bfloat16, quant=quant)
    plain = load_reference_model(checkpoints["mixtral"], torch.bfloat16)
    seqs = _sequences()
    want = reference.forward([torch.tensor(s) for s in seqs])
    float_logits = plain.forward([torch.tensor(s) for s in seqs])
    got = expert_mesh.score_batch(seqs)
    for g, w, f in zip(got, want, float_logits):
        assert torch.equal(g, w.float()), (g - w.float()).abs().max().item()
        assert not torch.equal(g, f.float())  # the quantised experts did run
    assert expert_mesh.router.generate(token_ids=PROMPT, max_tokens=6, stop_at_eos=False).token_ids == \
        greedy_tokens(reference, PROMPT, 6)


def test_actors_report_quant_and_packed_weight_bytes(mesh):
    quant, expert_mesh = mesh
    for info in expert_mesh.actor_info():
        assert info["quant"] == quant and info["dtype"] == "bfloat16"
        per_shard = {"int8": sum(n * k + 2 * n for n, k in SHARD_SHAPES),  # int8 values + a bf16 scale per row
                     "int4": sum(n * k // 2 + 4 * n for n, k in SHARD_SHAPES)}[quant]  # + scale, zero per row
        assert info["weight_bytes"] == per_shard * len(info["shards"])
        bf16 = sum(2 * n * k for n, k in SHARD_SHAPES) * len(info["shards"])
        # rows of 32 and 48 inputs carry a scale (and zero) each: 1.9x and 3.3x smaller than bf16 here
        assert info["weight_bytes"] < bf16 / {"int8": 1.8, "int4": 3.0}[quant]
