"""DeepSeek-V3.2 (`deepseek_v32`) and GLM-5 (`glm_moe_dsa`): MLA with DeepSeek Sparse Attention's lightning indexer,
the in-process reference model against `transformers` on tiny checkpoints it saved itself. The tiny configs keep
index_topk = 8, so every prompt here (up to 30 tokens) is longer than the top-k and the indexer's mask selects; GLM-5's
checkpoint has "shared" layers (1 and 3) that reuse the top-k of the layer before.

Tolerance: max |Δlogits| ≤ 1e-4 in float32 (logits of order 1); bf16 within a few bf16 ulps of the logit scale.
"""

from __future__ import annotations

import pytest
import torch

from expertmesh.experts.checkpoint import CheckpointReader
from expertmesh.experts.config import config_from_dict, load_model_config
from expertmesh.experts.dsa_indexer import index_scores, top_k_mask
from expertmesh.experts.errors import CheckpointError
from expertmesh.experts.reference import load_reference_model
from expertmesh.experts.weights import load_dense_weights
from tests.tiny_checkpoints import (
    assert_by_transformers_yardstick,
    chunked_logits,
    hf_logits,
    load_hf_model,
    max_diff,
)
from tests.tiny_deepseek import DSA, DSA_KINDS, VOCAB, write_deepseek_checkpoint

TOL = 1e-4
TOPK = DSA["index_topk"]


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def _greedy(model, ids: torch.Tensor, steps: int) -> list[int]:
    cache, out, nxt = model.new_cache(), ids.tolist(), ids
    for _ in range(steps):
        token = int(model.forward([nxt], [cache])[0][-1].argmax())
        out.append(token)
        nxt = torch.tensor([token])
    return out


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("dsa_ckpt")
    return {kind: write_deepseek_checkpoint(kind, root / kind, seed=5, mtp=True) for kind in DSA_KINDS}


@pytest.fixture(scope="module")
def models(folders) -> dict:
    return {kind: (load_reference_model(folder), load_hf_model(folder)) for kind, folder in folders.items()}


def test_configs_parse_the_indexer(folders):
    v32, glm = load_model_config(folders["deepseek_v32"]), load_model_config(folders["glm_moe_dsa"])
    for cfg in (v32, glm):
        assert cfg.attention_kind == "mla" and cfg.rope_pairs_interleaved
        assert (cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk) == (8, 16, TOPK)
    assert v32.index_shared_layers == () and not v32.index_rope_interleaved
    assert glm.index_shared_layers == (1, 3) and glm.index_rope_interleaved
    assert [glm.has_indexer(i) for i in range(4)] == [True, False, True, False]


@pytest.mark.parametrize("kind", DSA_KINDS)
def test_logits_match_transformers_past_the_top_k(models, kind):
    model, hf = models[kind]
    long, short = _ids(30, 1), _ids(11, 2)
    out = model.forward([long, short])  # two prompts in one step: padded prefill rows
    for ids, ours in zip((long, short), out):
        theirs = hf_logits(hf, ids)
        assert max_diff(ours, theirs) <= TOL
        assert theirs.std().item() > 0.05


@pytest.mark.parametrize("kind", DSA_KINDS)
def test_the_top_k_mask_changes_attention_past_k_tokens(models, kind):
    """With index_topk at least the prompt, DSA is dense MLA: logits equal up to position k, differ after."""
    model, _ = models[kind]
    ids = _ids(30, 1)
    sparse = model.forward([ids])[0]
    layers = [a for a in model.attention if getattr(a, "index", None) is not None]
    for a in layers:
        a.index_topk = 10**6
    try:
        dense = model.forward([ids])[0]
    finally:
        for a in layers:
            a.index_topk = TOPK
    assert max_diff(sparse[:TOPK], dense[:TOPK]) <= 1e-5
    assert max_diff(sparse[TOPK:], dense[TOPK:]) > 1e-2


@pytest.mark.parametrize("kind", DSA_KINDS)
def test_chunked_prefill_and_batched_decode_equal_one_shot(models, kind, monkeypatch):
    """The indexer's keys come from the paged cache (index_k beside the latent) once a prompt has history; decode
    rows attend only their top-k latents, gathered (the one-shot prefill attends all of them under the mask)."""
    from expertmesh.experts import attention_core

    taken = []
    real = attention_core._take_picked
    monkeypatch.setattr(attention_core, "_take_picked", lambda c, m, p: taken.append(p.shape) or real(c, m, p))
    model, _ = models[kind]
    ids = _ids(26, 3)
    full = model.forward([ids])[0]
    assert max_diff(chunked_logits(model, ids, [5, 9, 17, 21]), full) <= 1e-5
    assert not taken
    assert max_diff(chunked_logits(model, ids, list(range(10, 26))), full) <= 1e-5  # decode past the top-k
    assert taken and all(shape == (1, TOPK) for shape in taken)
    a, b = _ids(21, 4), _ids(13, 5)
    ca, cb = model.new_cache(), model.new_cache()
    model.forward([a[:18]], [ca])
    model.forward([b[:10]], [cb])
    # a decoding row and a prefilling chunk with history in one step (continuous batching)
    step = model.forward([a[18:19], b[10:13]], [ca, cb])
    assert max_diff(step[0], model.forward([a[:19]])[0][18:]) <= 1e-5
    assert max_diff(step[1], model.forward([b])[0][10:]) <= 1e-5


@pytest.mark.parametrize("blocks", [64, 9])
def test_continuous_batching_chunked_prefill_and_preemption_equal_solo_runs(models, blocks):
    """GLM-5 through the continuous batcher: prompts past the top-k prefilled in chunks of at most 7 tokens shared
    with other streams' decode rows; with 9 blocks of 4 decode outgrows the pool and the youngest is preempted
    (recomputed on resume, index keys included). Every stream equals its solo greedy run; every block comes back."""
    import asyncio

    from expertmesh.experts.kv_cache import KVCacheSettings
    from expertmesh.experts.modeling import MoEDecoder
    from expertmesh.router_service.batching import BatcherConfig, ContinuousBatcher, DoneEvent, GenerationRequest

    reference, _ = models["glm_moe_dsa"]
    model = MoEDecoder(reference.cfg, reference.w, reference.experts,
                       kv_cache=KVCacheSettings(4, max_tokens=blocks * 4))
    prompts, max_tokens = [_ids(n, 40 + n).tolist() for n in (12, 17, 9, 14)], 8
    solos = [_greedy(reference, torch.tensor(p), max_tokens)[len(p):] for p in prompts]

    async def collect(stream) -> list[int]:
        return [t for event in [e async for e in stream] if not isinstance(event, DoneEvent) for t in event.token_ids]

    async def main():
        batcher = ContinuousBatcher(model, None, BatcherConfig(max_prefill_tokens=7))
        got = await asyncio.wait_for(asyncio.gather(
            *(collect(batcher.stream(GenerationRequest(p, max_tokens))) for p in prompts)), 60)
        return batcher, got

    batcher, got = asyncio.run(main())
    assert got == solos
    if blocks < 16:
        assert batcher.preemptions >= 1
    assert model.kv_pool.allocator.num_free == blocks


def test_overlap_schedule_equals_the_plain_one(folders, models):
    """Two micro-batches taking turns (each keeps its own selection for GLM-5's shared layers) == one batch."""
    model, _ = models["glm_moe_dsa"]
    other = load_reference_model(folders["glm_moe_dsa"], overlap=True)
    seqs = [_ids(n, 30 + n) for n in (20, 9, 25, 1)]
    ca, cb = [model.new_cache() for _ in seqs], [other.new_cache() for _ in seqs]
    for x, y in zip(model.forward(seqs, ca), other.forward(seqs, cb)):
        assert max_diff(x, y) <= 1e-5
    nxt = [s[-1:] for s in seqs]
    for x, y in zip(model.forward(nxt, ca), other.forward(nxt, cb)):
        assert max_diff(x, y) <= 1e-5


@pytest.mark.parametrize("kind", DSA_KINDS)
def test_greedy_decode_equals_transformers_generate(models, kind):
    model, hf = models[kind]
    ids = _ids(12, 6)
    with torch.no_grad():
        expected = hf.generate(ids[None], attention_mask=torch.ones(1, 12, dtype=torch.long), max_new_tokens=10,
                               do_sample=False)[0].tolist()
    assert _greedy(model, ids, 10) == expected


def test_kv_cache_stores_the_index_key_only_where_an_indexer_runs(models):
    glm, _ = models["glm_moe_dsa"]
    specs = glm.cache_specs()
    assert [("index_k" in s) for s in specs] == [True, False, True, False]
    assert specs[0]["index_k"] == (16,) and specs[0]["latent"] == (16 + 8,)


@pytest.mark.parametrize("kind", DSA_KINDS)
def test_bf16_is_as_close_to_float32_as_transformers_bf16(folders, models, kind):
    ours = load_reference_model(folders[kind], dtype=torch.bfloat16)
    theirs = load_hf_model(folders[kind], torch.bfloat16)
    assert_by_transformers_yardstick(ours, theirs, models[kind][1], _ids(20, 7))
    assert ours.w.layers[0].attention.indexer.weights_proj.dtype == torch.float32  # as transformers keeps it


def test_top_k_mask_keeps_only_allowed_keys():
    scores = torch.tensor([[[5.0, 1.0, 3.0, 9.0], [0.0, 2.0, 1.0, 7.0]]])  # [1, 2, 4]
    allowed = torch.tensor([[[True, True, True, False], [True, True, False, False]]])
    picked = top_k_mask(scores, allowed, 2)
    assert picked.tolist() == [[[True, False, True, False], [True, True, False, False]]]
    assert top_k_mask(scores, allowed, 10).tolist() == allowed.tolist()  # fewer allowed keys than k: all of them


def test_index_scores_in_query_pieces_equal_one_piece():
    gen = torch.Generator().manual_seed(0)
    q, k, w = torch.randn(2, 7, 4, 16, generator=gen), torch.randn(2, 11, 16, generator=gen), torch.randn(2, 7, 4)
    whole = index_scores(q, k, w)
    assert whole.shape == (2, 7, 11)
    assert max_diff(index_scores(q, k, w, piece_bytes=2 * 4 * 11 * 4 * 3), whole) <= 1e-5  # pieces of 3 query rows
    assert max_diff(index_scores(q, k, w, piece_bytes=1), whole) <= 1e-5  # one row at a time


def test_config_errors_name_the_key():
    base = {"architectures": ["GlmMoeDsaForCausalLM"], "vocab_size": 32, "hidden_size": 16,
            "num_hidden_layers": 4, "num_attention_heads": 2, "num_experts_per_tok": 2, "n_routed_experts": 8,
            "moe_intermediate_size": 8, "intermediate_size": 16, "first_k_dense_replace": 1, "kv_lora_rank": 8,
            "q_lora_rank": 8, "qk_rope_head_dim": 4, "qk_nope_head_dim": 4, "v_head_dim": 4,
            "index_topk": 4, "index_head_dim": 8, "index_n_heads": 2}
    assert config_from_dict(base).index_shared_layers == ()  # transformers' default schedule: every layer full
    assert config_from_dict(base | {"index_topk_freq": 2}).index_shared_layers == (2,)
    assert config_from_dict(base | {"index_topk_pattern": "FSFS"}).index_shared_layers == (1, 3)
    # a later GLM-5.x schedule (index_topk_freq 4, index_skip_topk_offset 3 over 78 layers): layers 0-2 full, then
    # every 4th from 6; the rest reuse the top-k before them
    later = config_from_dict(base | {"num_hidden_layers": 78, "index_topk_freq": 4, "index_skip_topk_offset": 3})
    assert [i for i in range(78) if later.has_indexer(i)] == [0, 1, 2, *range(6, 78, 4)]
    assert config_from_dict(base).index_rope_interleaved
    assert not config_from_dict(base | {"indexer_rope_interleave": False}).index_rope_interleaved
    with pytest.raises(CheckpointError, match="index_topk_pattern"):
        config_from_dict(base | {"index_topk_pattern": "FXFS"})
    with pytest.raises(CheckpointError, match="indexer_types"):
        config_from_dict(base | {"indexer_types": ["shared", "full", "full", "full"]})
    with pytest.raises(CheckpointError, match="index_head_dim"):
        config_from_dict(base | {"index_head_dim": 2})
    with pytest.raises(CheckpointError, match="'q_lora_rank'"):
        config_from_dict(base | {"q_lora_rank": None})
    with pytest.raises(CheckpointError, match="'index_topk'"):
        config_from_dict({k: v for k, v in base.items() if k != "index_topk"})


@pytest.mark.parametrize("kind", DSA_KINDS)
def test_fp8_checkpoint_equals_transformers_dequantised_model(tmp_path, kind):
    """Item 8: the published FP8 layout (block-scaled e4m3, the indexer's wq_b / wk included, weights_proj bf16)."""
    from tests.tiny_deepseek import hf_with_transformers_dequantisation

    plain = write_deepseek_checkpoint(kind, tmp_path / "plain", seed=11)
    fp8 = write_deepseek_checkpoint(kind, tmp_path / "fp8", seed=11, fp8_block=(8, 8), mtp=True)
    assert load_model_config(fp8).fp8_block == (8, 8)
    assert "model.layers.0.self_attn.indexer.wq_b.weight_scale_inv" in CheckpointReader(fp8).keys()
    hf, dequantised = hf_with_transformers_dequantisation(plain, fp8)
    dense = load_dense_weights(CheckpointReader(fp8))
    name = "model.layers.2.self_attn.indexer.wk.weight"
    assert torch.equal(dense.layers[2].attention.indexer.wk, dequantised[name])
    model = load_reference_model(fp8)
    ids = _ids(20, 12)
    assert max_diff(model.forward([ids])[0], hf_logits(hf, ids)) <= TOL
    with torch.no_grad():
        expected = hf.generate(ids[None, :10], attention_mask=torch.ones(1, 10, dtype=torch.long), max_new_tokens=6,
                               do_sample=False)[0].tolist()
    assert _greedy(model, ids[:10], 6) == expected
