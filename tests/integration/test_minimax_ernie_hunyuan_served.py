"""MiniMax-M2 (as published: block-scaled FP8, Mixtral's per-expert names), ERNIE 4.5 MoE (dense layer 0, shared
experts, softmax router with selection bias) and Hunyuan-A13B (transformers' stacked layout, shared MLP, NTK-alpha
RoPE) and Llama 4 (the multimodal wrapper's text part under `language_model.`: chunked attention, NoPE layers with
temperature, the router score scaling the expert input) and MiMo-V2-Flash (KV heads that differ by layer, sinks on
the sliding layers, grouped sigmoid router) and Qwen3.5-MoE (the VL wrapper's text part under
`model.language_model.`: Gated DeltaNet layers whose conv + recurrent state lives in the router's state cache, gated
full attention, shared expert with a sigmoid gate), LongCat-Flash (the shortcut MoE across two sublayers,
identity experts computed on the router, never sent to an actor) and Kimi-Linear (KDA layers with per-channel decay
whose conv + recurrent state lives in the router's state cache, MLA without RoPE, grouped sigmoid router with a
correction bias) through the distributed router on one local Ray: served
logits and routings == the in-process reference bit for bit, greedy tokens equal the reference's and `transformers`'
(on the unquantised twin for MiniMax-M2's FP8)."""

from __future__ import annotations

import pytest
import torch

from expertmesh.experts.reference import load_reference_model
from expertmesh.router_service.mesh import ExpertMesh, MeshConfig
from tests.tiny_checkpoints import greedy_tokens
from tests.tiny_fam1 import VOCAB, write_fam1_checkpoint
from tests.tiny_kimi_linear import write_kimi_linear_checkpoint
from tests.tiny_llama4 import load_hf, write_llama4_checkpoint
from tests.tiny_longcat_flash import write_longcat_checkpoint
from tests.tiny_mimo_v2_flash import write_mimo_checkpoint
from tests.tiny_qwen3_next import load_hf as load_hf_qwen3_next
from tests.tiny_qwen3_next import write_qwen3_next_checkpoint

pytestmark = pytest.mark.usefixtures("local_ray")

# name -> (family, writer options)
CASES = {"minimax_m2_fp8": ("minimax_m2", dict(fp8_block=(8, 8))),
         "ernie4_5_moe": ("ernie4_5_moe", {}),
         "hunyuan_v1_moe_fused": ("hunyuan_v1_moe", dict(fused=True)),
         "llama4_wrapper": ("llama4", dict(wrapper=True)),
         "mimo_v2_flash": ("mimo_v2_flash", dict(n_routed_experts=4)),  # 4 actors: 2 groups of 2, one chosen
         "qwen3_5_moe_vl": ("qwen3_5_moe", {}),  # Qwen3_5MoeForConditionalGeneration, 4 experts: 4 actors
         "longcat_flash": ("longcat_flash", {}),  # 4 real experts placed; 4 identity experts: nowhere
         "kimi_linear": ("kimi_linear", {})}  # transformers' default save (block_sparse_moe), 4 experts: 4 actors


def _write(kind: str, out, **options):
    if kind == "llama4":  # scout-like: chunk 8, so the 13-token sequence and the generation cross a chunk
        return write_llama4_checkpoint(out, seed=7, **options)
    if kind == "mimo_v2_flash":  # window 5: every sequence but the 4-token one outgrows it
        return write_mimo_checkpoint(out, seed=7, **options)
    if kind == "longcat_flash":  # 2 layers of 2 sublayers, top-3 of 4 real + 4 identity experts
        return write_longcat_checkpoint(out, seed=7, **options)
    if kind == "qwen3_5_moe":  # 3 DeltaNet layers then a full-attention one; decode runs the recurrent form
        return write_qwen3_next_checkpoint(out, "qwen3_5_vl", seed=7, **options)
    if kind == "kimi_linear":  # KDA, KDA, MLA, KDA; decode runs KDA's recurrent form
        return write_kimi_linear_checkpoint(out, seed=7, **options)
    return write_fam1_checkpoint(kind, out, seed=7, **options)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("served_fam1")
    return {name: _write(kind, root / name, **options) for name, (kind, options) in CASES.items()}


def _sequences() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (13, 4, 9)]


@pytest.mark.parametrize("name", sorted(CASES))
def test_distributed_equals_reference_bit_for_bit(folders, name):
    path = folders[name]
    reference = load_reference_model(path)
    seqs = _sequences()
    want = reference.forward([torch.tensor(s) for s in seqs])
    want_routing = {layer: r.experts.clone() for layer, r in reference.last_trace.routings.items()}
    want_identity = {layer: r.identity for layer, r in reference.last_trace.routings.items()}
    prompt = seqs[0][:6]
    want_tokens = greedy_tokens(reference, prompt, 8)
    with ExpertMesh(MeshConfig.from_dict({"model": {"path": str(path)}, "controller": {"enabled": False}})) as mesh:
        got = mesh.score_batch(seqs)
        routings = {layer: r.experts.clone() for layer, r in mesh.model.last_trace.routings.items()}
        identity = {layer: r.identity for layer, r in mesh.model.last_trace.routings.items()}
        placed = sorted(mesh.model.experts.table.replicas)  # the shards the routing table places
        result = mesh.generate(token_ids=prompt, max_tokens=8)
    assert sorted(routings) == list(reference.cfg.moe_layers)
    for layer in routings:
        assert torch.equal(routings[layer], want_routing[layer])
    assert identity == want_identity  # LongCat's identity slots, counted on the served path too
    if name == "longcat_flash":
        assert all(n > 0 for n in identity.values())
        # the real experts of every MoE sublayer are placed, no identity expert is
        assert placed == [(layer, e) for layer in reference.cfg.moe_layers for e in range(reference.cfg.num_experts)]
    for ours, theirs in zip(got, want):
        assert torch.equal(ours, theirs)
    assert result.token_ids == want_tokens


def test_greedy_tokens_equal_transformers(folders, tmp_path):
    """transformers' greedy tokens on each served checkpoint (MiniMax-M2: its unquantised twin, whose FP8 copy the
    mesh serves; the reference and FP8 against transformers' dequantisation are unit-tested)."""
    from transformers import AutoModelForCausalLM

    prompt = _sequences()[0][:6]
    for name, (kind, options) in CASES.items():
        path = folders[name]
        if options.get("fp8_block"):
            path = write_fam1_checkpoint(kind, tmp_path / kind, seed=7)
        if kind == "llama4":  # the wrapper's text model (its own generate needs the image path)
            hf = load_hf(path).language_model
        elif kind == "qwen3_5_moe":  # the VL wrapper generates from text ids alone
            hf = load_hf_qwen3_next(path)
        else:
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        with torch.no_grad():
            expected = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                                   pad_token_id=0)[0, len(prompt):].tolist()
        assert greedy_tokens(load_reference_model(path), prompt, 8) == expected, name
