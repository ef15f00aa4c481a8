"""bf16 and fp16 end to end on a local Ray: expert actors computing in that dtype, every transport carrying the rows
and outputs bit for bit (Ray refs, gRPC, socket, compiled graph as raw bytes + dtype tag; rdt as the tensors' own
memory through NIXL). The distributed logits equal the in-process reference in the same dtype bit for bit, greedy
tokens equal the reference's, and against `transformers` both are judged by its own yardstick: no further from its
float32 logits than its own run in that dtype (how far that is depends on the CPU's bf16 kernels)."""

from __future__ import annotations

import pytest
import torch

from expertmesh.experts.reference import load_reference_model
from expertmesh.router_service.mesh import ExpertMesh, MeshConfig
from expertmesh.router_service.router import Router
from tests.tiny_checkpoints import VOCAB, assert_by_transformers_yardstick, greedy_tokens, max_diff

pytestmark = pytest.mark.usefixtures("local_ray")

# The margin over transformers' own error in the dtype, against its float32 logits (logits of order 1; transformers'
# own error measured 0.034 in bf16, 0.004 in fp16): a few units in the last place, far below a wrong op or lost bits.
TOL = {"bfloat16": 0.1, "float16": 0.01}
PROMPT = [3, 14, 15, 92, 65, 35, 89, 79]
MAX_TOKENS = 6
OTHER_TRANSPORTS = ("grpc", "socket", "compiled", "rdt")  # besides the mesh's own refs router


@pytest.fixture(scope="module", params=list(TOL))
def mesh(request, checkpoints):
    """A pool of expert actors in the dtype, and a router per transport over it (refs: the mesh's own)."""
    config = MeshConfig.from_dict({"model": {"path": str(checkpoints["mixtral"]), "dtype": request.param},
                                   "controller": {"enabled": False}, "router": {"transport": "refs"}})
    with ExpertMesh(config) as mesh:
        routers = {"refs": mesh.router}
        for name in OTHER_TRANSPORTS:
            routers[name] = Router(mesh.pool.spec, mesh.actors, config.replace(**{"router.transport": name}))
        try:
            yield request.param, mesh, routers
        finally:
            for name in OTHER_TRANSPORTS:
                routers[name].close()


@pytest.fixture(scope="module")
def hf_models(checkpoints):
    from transformers import AutoModelForCausalLM

    return {name: AutoModelForCausalLM.from_pretrained(checkpoints["mixtral"], dtype=getattr(torch, name)).eval()
            for name in (*TOL, "float32")}


def _sequences() -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (17, 5, 1)]


def test_every_transport_equals_the_reference_in_the_same_dtype_bit_for_bit(mesh, checkpoints):
    dtype, expert_mesh, routers = mesh
    assert {info["dtype"] for info in expert_mesh.actor_info()} == {dtype}  # the actors resolved it
    reference = load_reference_model(checkpoints["mixtral"], getattr(torch, dtype))
    seqs = _sequences()
    want = reference.forward([torch.tensor(s) for s in seqs])
    for name, router in routers.items():
        assert router.dtype_name == dtype and router.model.dtype == getattr(torch, dtype)
        got = router.score_batch(seqs)
        for g, w in zip(got, want):
            assert torch.equal(g, w.float()), (name, (g - w.float()).abs().max().item())
    assert routers["compiled"].transport.compiled_rounds > 0  # the graph itself carried them, not its fallback


def test_greedy_tokens_equal_the_reference_and_transformers_up_to_a_near_tie(mesh, checkpoints, hf_models):
    dtype, _, routers = mesh
    reference = load_reference_model(checkpoints["mixtral"], getattr(torch, dtype))
    want = greedy_tokens(reference, PROMPT, MAX_TOKENS)
    assert_by_transformers_yardstick(reference, hf_models[dtype], hf_models["float32"], torch.tensor(PROMPT),
                                     MAX_TOKENS, margin=TOL[dtype])
    for name, router in routers.items():
        assert router.generate(token_ids=PROMPT, max_tokens=MAX_TOKENS, stop_at_eos=False).token_ids == want, name


def test_logits_are_as_close_to_float32_as_transformers_in_the_dtype(mesh, hf_models):
    dtype, expert_mesh, _ = mesh
    seqs = _sequences()
    got = expert_mesh.score_batch(seqs)
    for seq, logits in zip(seqs, got):
        with torch.no_grad():
            theirs = hf_models[dtype](torch.tensor([seq])).logits[0].float()
            truth = hf_models["float32"](torch.tensor([seq])).logits[0]
        assert max_diff(logits, truth) <= 1.25 * max_diff(theirs, truth) + TOL[dtype]
