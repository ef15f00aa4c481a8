"""DeepSeek-V3 (MLA, YaRN, sigmoid group-limited routing, shared experts, MTP layer in the checkpoint), GLM-4.5
(GQA with partial RoPE and per-head q/k norm, the same router), DeepSeek-V3.2 and GLM-5 (MLA with the DSA indexer's
top-k, index_topk 8 < the prompts; GLM-5 with shared-indexer layers) through the distributed router on one local
Ray: distributed == in-process reference bit for bit, and greedy tokens equal `transformers`."""

from __future__ import annotations

import pytest
import torch

from expertmesh.experts.reference import load_reference_model
from expertmesh.router_service.mesh import ExpertMesh, MeshConfig
from tests.tiny_deepseek import DSA_KINDS, VOCAB, write_deepseek_checkpoint

pytestmark = pytest.mark.usefixtures("local_ray")

# 8 routed experts (one actor each) keeps the module's actor start-up short on 2 cores; groups still limit routing.
SMALL = {"deepseek_v3": dict(n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2),
         "glm4_moe": dict(n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1),
         "deepseek_v32": dict(n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2),
         "glm_moe_dsa": {}}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("served_deepseek")
    return {kind: write_deepseek_checkpoint(kind, root / kind, seed=5, mtp=True, **overrides)
            for kind, overrides in SMALL.items()}


def _sequences() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (13, 4, 9)]


@pytest.mark.parametrize("kind", sorted(SMALL))
def test_distributed_equals_reference_bit_for_bit_and_transformers(folders, kind):
    from transformers import AutoModelForCausalLM

    path = folders[kind]
    reference = load_reference_model(path)
    seqs = _sequences()
    want = reference.forward([torch.tensor(s) for s in seqs])
    want_routing = {layer: r.experts.clone() for layer, r in reference.last_trace.routings.items()}
    prompt = seqs[0][:10] if kind in DSA_KINDS else seqs[0][:6]  # DSA: decode past index_topk
    with ExpertMesh(MeshConfig.from_dict({"model": {"path": str(path)}, "controller": {"enabled": False}})) as mesh:
        got = mesh.score_batch(seqs)
        routings = {layer: r.experts.clone() for layer, r in mesh.model.last_trace.routings.items()}
        result = mesh.generate(token_ids=prompt, max_tokens=8)
    assert sorted(routings) == list(range(1, reference.cfg.num_layers))  # layer 0 is dense (first_k_dense_replace)
    for layer in routings:
        assert torch.equal(routings[layer], want_routing[layer])
    for ours, theirs in zip(got, want):
        assert torch.equal(ours, theirs)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        # attention_mask given: without it generate masks every token equal to pad_token_id (the 10-token prompt
        # holds a 0) as padding
        expected = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                               max_new_tokens=8, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, len(prompt):].tolist()
    assert result.token_ids == expected
