"""Qwen3-Next and Qwen3.5-MoE (Gated DeltaNet linear-attention layers with their conv + recurrent state, gated full
attention with partial RoPE and zero-centred q/k norm, shared expert with a sigmoid gate; Qwen3-Next's packed
in_proj_qkvz / in_proj_ba; Qwen3.5's VL wrapper under model.language_model.): the in-process reference against
`transformers` on tiny checkpoints it saved itself, fp32 and bf16, prompts of 150 tokens (three DeltaNet chunks of
64); chunked prefill at several chunk sizes and continuous batching == the one-request run; the delta rule's chunked
form == its recurrent form in float64; each quirk shown to matter; config refusals.

Tolerance: max |Δlogits| ≤ 1e-4 in float32 against transformers (logits of order 1). Prefill cut where
transformers would not cut changes where the 64-token chunks of the delta rule fall, so float32 rounding differs
(transformers itself: 3e-5 for a prompt fed as 70 + 80 tokens); those compare within 5e-4 in float32, and in float64
(model and delta rule) within the float32 logits' last bits (2e-6), where only the algorithm could differ.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from expertmesh.experts import gated_delta
from expertmesh.experts.checkpoint import CheckpointReader
from expertmesh.experts.config import config_from_dict
from expertmesh.experts.errors import CheckpointError
from expertmesh.experts.modeling import MoEDecoder
from expertmesh.experts.reference import load_reference_model
from expertmesh.experts.weights import check_checkpoint, expert_layout
from tests.tiny_checkpoints import chunked_logits, greedy_tokens, hf_logits, max_diff
from tests.tiny_qwen3_next import KINDS, VOCAB, load_hf, text_config_kwargs, write_qwen3_next_checkpoint

TOL = 1e-4
LONG = 150  # three 64-token chunks of the delta rule's chunked form, the last partial


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("qwen3_next_ckpt")
    return {kind: write_qwen3_next_checkpoint(root / kind, kind, seed=i) for i, kind in enumerate(KINDS)}


@pytest.fixture(scope="module")
def models(folders) -> dict:
    return {kind: (load_reference_model(folder), load_hf(folder)) for kind, folder in folders.items()}


@pytest.mark.parametrize("kind", KINDS)
def test_batched_sequences_match_transformers(models, kind):
    model, hf = models[kind]
    ids0, ids1 = _ids(9, 1), _ids(LONG, 2)
    out = model.forward([ids0, ids1])
    with torch.no_grad():
        for ids, ours in zip((ids0, ids1), out):
            theirs = hf_logits(hf, ids)
            assert max_diff(ours, theirs) <= TOL
            assert theirs.std().item() > 0.05


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_decode_equals_transformers_generate(models, kind):
    model, hf = models[kind]
    ids = _ids(70, 6)  # the prompt crosses a delta-rule chunk; decoding runs the recurrent form on the cache
    with torch.no_grad():
        expected = hf.generate(ids[None], attention_mask=torch.ones(1, ids.numel(), dtype=torch.long),
                               max_new_tokens=12, do_sample=False)[0, ids.numel():].tolist()
    assert greedy_tokens(model, ids.tolist(), 12) == expected


@pytest.mark.parametrize("kind", ["next", "qwen3_5"])
def test_chunked_prefill_at_several_chunk_sizes_equals_whole_prompt(models, kind):
    model, _ = models[kind]
    ids = _ids(LONG, 3)
    full = model.forward([ids])[0]
    for cuts in ([64, 128], [5, 6, 70, 71, 140], list(range(7, LONG, 7)), list(range(1, 20)), [100]):
        assert max_diff(chunked_logits(model, ids, cuts), full) <= 5e-4, cuts
    assert max_diff(chunked_logits(model, ids, [64, 128]), full) <= 1e-5  # the same 64-token chunks: no rounding


def test_chunked_prefill_equals_whole_prompt_in_float64(folders, monkeypatch):
    """With the delta rule in float64 too, any cut gives the whole prompt's logits: the state carried across a
    chunk boundary (conv inputs and recurrent matrix) is exact, only float32 rounding differs above."""
    monkeypatch.setattr(gated_delta, "MATH_DTYPE", torch.float64)
    model = load_reference_model(folders["next"], dtype=torch.float64)
    ids = _ids(LONG, 3)
    full = model.forward([ids])[0]
    assert model.kv_pool.states.storage[0]["recurrent"].dtype == torch.float64
    for cuts in ([5, 6, 70, 71, 140], list(range(1, 10)), [3, 100]):
        assert max_diff(chunked_logits(model, ids, cuts), full) <= 2e-6, cuts  # the float32 logits' last bits


@pytest.mark.parametrize("kind", ["next", "qwen3_5_vl"])
def test_continuous_batching_equals_each_sequence_alone(models, kind):
    """Sequences joining and leaving a running batch, prefill chunks beside decode rows: each sequence's logits
    equal its own one-request run (each decode row's recurrent step and each prompt's chunk are its own)."""
    model, _ = models[kind]
    a, b, c = _ids(80, 11), _ids(40, 12), _ids(30, 13)
    alone = {name: model.forward([ids])[0] for name, ids in (("a", a), ("b", b), ("c", c))}
    ca, cb, cc = model.new_cache(), model.new_cache(), model.new_cache()
    got = {"a": [model.forward([a[:30]], [ca])[0]], "b": [], "c": []}
    got["a"].append((s := model.forward([a[30:31], b[:25]], [ca, cb]))[0])  # a decodes, b's first chunk
    got["b"].append(s[1])
    s = model.forward([b[25:40], a[31:32], c[:30]], [cb, ca, cc])  # b's last chunk, a decodes, c whole
    got["b"].append(s[0]), got["a"].append(s[1]), got["c"].append(s[2])
    cc.free()  # c leaves: its slot goes back and is reused below by nobody else's state
    for pos in range(32, 80):  # a and b decode together (b past its prompt: a's tokens stand in for generated ones)
        s = model.forward([a[pos:pos + 1]], [ca])
        got["a"].append(s[0])
    assert max_diff(torch.cat(got["a"]), alone["a"]) <= 5e-4
    assert max_diff(torch.cat(got["b"]), alone["b"]) <= 5e-4
    assert max_diff(torch.cat(got["c"]), alone["c"]) <= 1e-5  # fed whole, beside others: the same chunks


def test_batched_decode_rows_equal_single_rows(models):
    model, _ = models["next"]
    prompts = [_ids(n, 20 + n) for n in (10, 33, 65)]
    caches = [model.new_cache() for _ in prompts]
    for p, c in zip(prompts, caches):
        model.forward([p[:-1]], [c])
    together = model.forward([p[-1:] for p in prompts], caches)
    for p, row in zip(prompts, together):
        assert max_diff(row, model.forward([p])[0][-1:]) <= 5e-4
    singles = [model.new_cache() for _ in prompts]
    for p, c in zip(prompts, singles):
        model.forward([p[:-1]], [c])
    for p, c, row in zip(prompts, singles, together):
        assert max_diff(model.forward([p[-1:]], [c])[0], row) <= 1e-5  # one row alone == that row batched


def test_overlap_schedule_equals_the_plain_one(folders, models):
    """Two micro-batches taking turns (each with its own sequences' states) == one batch, prefill and decode."""
    model, _ = models["next"]
    other = load_reference_model(folders["next"], overlap=True)
    seqs = [_ids(n, 30 + n) for n in (20, 9, 70, 1)]
    ca, cb = [model.new_cache() for _ in seqs], [other.new_cache() for _ in seqs]
    for x, y in zip(model.forward(seqs, ca), other.forward(seqs, cb)):
        assert max_diff(x, y) <= 1e-5
    nxt = [s[-1:] for s in seqs]
    for x, y in zip(model.forward(nxt, ca), other.forward(nxt, cb)):
        assert max_diff(x, y) <= 1e-5


@pytest.mark.parametrize("kind", ["next", "qwen3_5_vl"])
def test_bf16_reference_is_as_close_to_float32_as_transformers_bf16(folders, models, kind):
    """These tiny hybrids are sensitive to bf16 rounding (transformers' own bf16 logits are ~1 away from its
    float32 ones, on logits of ~3), so bf16 is compared by that yardstick: ours is no further from the float32
    truth than transformers' bf16 (plus a margin), and no further from transformers' bf16 than that is from it."""
    folder = folders[kind]
    ours = load_reference_model(folder, dtype=torch.bfloat16)
    theirs = load_hf(folder, torch.bfloat16)
    ids = _ids(40, 7)
    with torch.no_grad():
        truth, want = hf_logits(models[kind][1], ids), hf_logits(theirs, ids)
    got = ours.forward([ids])[0]
    their_error = max_diff(want, truth)
    assert max_diff(got, truth) <= 1.25 * their_error + 0.05
    assert max_diff(got, want) <= their_error
    assert ours.kv_pool.states.storage[0]["recurrent"].dtype == torch.float32  # as transformers keeps it
    assert ours.kv_pool.states.storage[0]["conv"].dtype == torch.bfloat16


def test_fixture_config_layers_and_cache_shapes(models, folders):
    model, _ = models["next"]
    cfg = model.cfg
    assert cfg.linear_layers == (0, 1, 2) and cfg.moe_layers == (0, 2, 3) and cfg.rotary_dim == 4
    assert model.w.layers[1].dense_mlp is not None and model.w.layers[0].shared_expert_gate.shape == (1, 32)
    assert model.cache_specs() == [{}, {}, {}, {"k": (2, 8), "v": (2, 8)}]  # only the full layer has a KV history
    assert model.state_shapes()[0] == {"conv": (2 * 16 + 24, 3), "recurrent": (4, 8, 6)}
    assert model.kv_pool.prefix_root is None  # a cached block cannot restore a linear layer's state
    vl = models["qwen3_5_vl"][0].cfg
    assert vl.family == "qwen3_5_moe" and vl.weight_prefix == "model.language_model." and vl.moe_layers == (0, 1, 2, 3)
    for kind in KINDS:
        reader = CheckpointReader(folders[kind])
        check_checkpoint(reader)  # every tensor named with its shape
        assert expert_layout(reader.config, reader.has) == ("fused" if kind == "next_fused" else "per_expert")


def test_unpacked_qkvz_equals_transformers_ordering(models):
    """Qwen3-Next's per-key-head packing, unpacked at load, gives the q, k, v, z, b, a transformers' own
    fix_query_key_value_ordering derives."""
    model, hf = models["next"]
    la = hf.model.layers[0].linear_attn
    h = torch.randn(1, 5, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        q, k, v, z, b, a = la.fix_query_key_value_ordering(la.in_proj_qkvz(h), la.in_proj_ba(h))
    w = model.w.layers[0].attention
    qkv = h[0] @ w.qkv.t()
    assert torch.allclose(qkv, torch.cat([q.reshape(5, -1), k.reshape(5, -1), v.reshape(5, -1)], -1), atol=1e-6)
    assert torch.allclose(h[0] @ w.z.t(), z.reshape(5, -1), atol=1e-6)
    assert torch.allclose(h[0] @ w.b.t(), b[0], atol=1e-6) and torch.allclose(h[0] @ w.a.t(), a[0], atol=1e-6)


@pytest.mark.parametrize("change", ["no_unit_offset", "no_output_gate", "full_rotary", "no_shared_gate"])
def test_each_quirk_changes_the_logits(models, change):
    """Serving without one quirk moves the logits far beyond the tolerance: the exactness above covers each."""
    model, hf = models["next"]
    cfg, weights = model.cfg, model.w
    if change == "no_shared_gate":
        weights = dataclasses.replace(weights, layers=[dataclasses.replace(
            layer, shared_expert_gate=None if layer.shared_expert_gate is None else layer.shared_expert_gate * 0
            + 100.0) for layer in weights.layers])
    else:
        cfg = {"no_unit_offset": dataclasses.replace(cfg, norm_unit_offset=False),
               "no_output_gate": dataclasses.replace(cfg, attn_output_gate=False),
               "full_rotary": dataclasses.replace(cfg, rotary_dim=cfg.head_dim)}[change]
    if change == "no_output_gate":  # the plain GQA layer reads q_proj as the queries alone: keep those rows
        weights = dataclasses.replace(weights, layers=[dataclasses.replace(layer, attention=dataclasses.replace(
            layer.attention, q=layer.attention.q.view(4, 16, 32)[:, :8].reshape(32, 32)))
            if i == 3 else layer for i, layer in enumerate(weights.layers)])
        cfg = dataclasses.replace(cfg, norm_unit_offset=True)
    other = MoEDecoder(cfg, weights, model.experts)
    ids = _ids(40, 9)
    with torch.no_grad():
        assert max_diff(other.forward([ids])[0], hf_logits(hf, ids)) > 100 * TOL


# ---------------------------------------------------------------- the delta rule, pure


@pytest.mark.parametrize("rep", [1, 2])
def test_chunked_form_equals_recurrent_form_in_float64(monkeypatch, rep):
    """The chunked delta rule from any state == the recurrent one token at a time (float64: the algorithms only)."""
    monkeypatch.setattr(gated_delta, "MATH_DTYPE", torch.float64)
    gen = torch.Generator().manual_seed(rep)
    b, s, nk, dk, dv = 2, 150, 2, 8, 6
    nv = nk * rep

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q, k, v = rand(b, s, nk, dk), rand(b, s, nk, dk), rand(b, s, nv, dv)
    g = -torch.rand(b, s, nv, generator=gen, dtype=torch.float64) * 3
    beta = torch.rand(b, s, nv, generator=gen, dtype=torch.float64)
    state = rand(b, nv, dk, dv) * 0.1
    whole, end = gated_delta.chunked(q, k, v, g, beta, state)
    outs, st = [], state
    for t in range(s):
        o, st = gated_delta.recurrent_step(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], g[:, t:t + 1],
                                           beta[:, t:t + 1], st)
        outs.append(o)
    assert (torch.cat(outs, 1) - whole).abs().max() < 1e-10 and (st - end).abs().max() < 1e-10
    part1, mid = gated_delta.chunked(q[:, :70], k[:, :70], v[:, :70], g[:, :70], beta[:, :70], state, chunk=16)
    part2, end2 = gated_delta.chunked(q[:, 70:], k[:, 70:], v[:, 70:], g[:, 70:], beta[:, 70:], mid)
    assert (torch.cat([part1, part2], 1) - whole).abs().max() < 1e-10 and (end2 - end).abs().max() < 1e-10


def test_causal_conv_continues_from_its_state():
    x = torch.randn(1, 5, 12, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    w = torch.randn(5, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ident = torch.nn.Identity()
    whole, state = gated_delta.causal_conv(x, x.new_zeros(1, 5, 3), w, ident)
    a, s1 = gated_delta.causal_conv(x[..., :2], x.new_zeros(1, 5, 3), w, ident)  # shorter than the kernel
    b, s2 = gated_delta.causal_conv(x[..., 2:3], s1, w, ident)
    c, s3 = gated_delta.causal_conv(x[..., 3:], s2, w, ident)
    assert torch.allclose(torch.cat([a, b, c], -1), whole) and torch.equal(s3, state)
    assert torch.equal(state, x[..., -3:])


# ---------------------------------------------------------------- config


def _raw(family: str = "qwen3_next", **overrides) -> dict:
    arch = {"qwen3_next": "Qwen3NextForCausalLM", "qwen3_5_moe": "Qwen3_5MoeForCausalLM"}[family]
    model_type = {"qwen3_next": "qwen3_next", "qwen3_5_moe": "qwen3_5_moe_text"}[family]
    return text_config_kwargs(family) | {"architectures": [arch], "model_type": model_type} | overrides


def test_published_spellings_parse():
    """Qwen3-Next's published config.json: partial_rotary_factor and rope_theta at the top level, no layer_types
    (full_attention_interval 4); a config without partial_rotary_factor gets transformers' 0.25."""
    raw = _raw(layer_types=None, full_attention_interval=4, rope_parameters=None, rope_theta=10000000,
               partial_rotary_factor=0.25, num_hidden_layers=8, head_dim=16, mlp_only_layers=[])
    cfg = config_from_dict(raw)
    assert cfg.linear_layers == (0, 1, 2, 4, 5, 6) and cfg.rotary_dim == 4 and cfg.rope_theta == 1e7
    assert config_from_dict(_raw(rope_parameters={"rope_theta": 1e4}, head_dim=16)).rotary_dim == 4
    wrapped = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
               "text_config": _raw("qwen3_5_moe"), "vision_config": {}}
    cfg = config_from_dict(wrapped)
    assert cfg.family == "qwen3_5_moe" and cfg.weight_prefix == "model.language_model." and cfg.norm_topk_prob
    assert not cfg.gated_delta.fused_projections and config_from_dict(_raw()).gated_delta.fused_projections


@pytest.mark.parametrize("overrides,key", [
    (dict(layer_types=["linear_attention", "sliding_attention", "linear_attention", "full_attention"]),
     "layer_types"),
    (dict(layer_types=["linear_attention"]), "layer_types"),
    (dict(linear_num_value_heads=3), "linear_num_value_heads"),
    (dict(linear_conv_kernel_dim=0), "linear_conv_kernel_dim"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0,
                           "original_max_position_embeddings": 128}), "rope_type"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.1}),
     "partial_rotary_factor"),
    (dict(intermediate_size=None), "intermediate_size"),
    (dict(num_experts=None), "num_experts"),
])
def test_config_refusals_name_the_key(overrides, key):
    with pytest.raises(CheckpointError, match=key):
        config_from_dict(_raw(**overrides))
