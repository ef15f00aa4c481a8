"""Kimi-Linear (KDA linear-attention layers with per-channel decay and their conv + recurrent state, MLA without RoPE,
DeepSeek-V3's grouped sigmoid router with a correction bias, ungated shared expert, a dense first layer): the
in-process reference against `transformers` on tiny checkpoints it saved itself (its default save: block_sparse_moe,
per-expert w1/w2/w3, q/k/v_conv1d; and save_original_format=False: stacked experts, one conv1d, forget_gate.*),
fp32 and bf16, prompts of 150 tokens (three KDA chunks of 64); chunked prefill at several chunk sizes and continuous
batching == the one-request run; KDA's chunked form == its recurrent form in float64; quirks shown to matter; the
published config spellings; refusals.

Tolerances as tests/unit/test_qwen3_next_vs_transformers.py: ≤ 1e-4 in float32 against transformers; prefill cut
elsewhere than transformers' 64-token chunks ≤ 5e-4 in float32, ≤ 2e-6 with the model and delta rule in float64.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from expertmesh.experts import gated_delta, kda
from expertmesh.experts.checkpoint import CheckpointReader
from expertmesh.experts.config import config_from_dict
from expertmesh.experts.errors import CheckpointError
from expertmesh.experts.modeling import MoEDecoder
from expertmesh.experts.reference import load_reference_model
from expertmesh.experts.weights import check_checkpoint, expert_layout
from tests.tiny_checkpoints import chunked_logits, greedy_tokens, hf_logits, max_diff
from tests.tiny_kimi_linear import KINDS, VOCAB, config_kwargs, load_hf, write_kimi_linear_checkpoint

TOL = 1e-4
LONG = 150  # three 64-token chunks of KDA's chunked form, the last partial


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("kimi_ckpt")
    return {kind: write_kimi_linear_checkpoint(root / kind, kind, seed=i) for i, kind in enumerate(KINDS)}


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
    ids = _ids(70, 6)  # the prompt crosses a KDA chunk; decoding runs the recurrent form on the cache
    with torch.no_grad():
        expected = hf.generate(ids[None], attention_mask=torch.ones(1, ids.numel(), dtype=torch.long),
                               max_new_tokens=12, do_sample=False)[0, ids.numel():].tolist()
    assert greedy_tokens(model, ids.tolist(), 12) == expected


def test_chunked_prefill_at_several_chunk_sizes_equals_whole_prompt(models):
    model, _ = models["original"]
    ids = _ids(LONG, 3)
    full = model.forward([ids])[0]
    for cuts in ([64, 128], [5, 6, 70, 71, 140], list(range(7, LONG, 7)), list(range(1, 20)), [100]):
        assert max_diff(chunked_logits(model, ids, cuts), full) <= 5e-4, cuts
    assert max_diff(chunked_logits(model, ids, [64, 128]), full) <= 1e-5  # the same 64-token chunks


def test_chunked_prefill_equals_whole_prompt_in_float64(folders, monkeypatch):
    """With KDA's arithmetic in float64 too, any cut gives the whole prompt's logits: the state carried across a
    chunk boundary (conv inputs, per-channel-decayed recurrent matrix) is exact."""
    monkeypatch.setattr(gated_delta, "MATH_DTYPE", torch.float64)
    model = load_reference_model(folders["original"], dtype=torch.float64)
    ids = _ids(LONG, 3)
    full = model.forward([ids])[0]
    assert model.kv_pool.states.storage[0]["recurrent"].dtype == torch.float64
    for cuts in ([5, 6, 70, 71, 140], list(range(1, 10)), [3, 100]):
        assert max_diff(chunked_logits(model, ids, cuts), full) <= 2e-6, cuts


def test_continuous_batching_equals_each_sequence_alone(models):
    """Sequences joining and leaving a running batch, prefill chunks beside decode rows: each sequence's logits
    equal its own one-request run."""
    model, _ = models["fused"]
    a, b, c = _ids(80, 11), _ids(40, 12), _ids(30, 13)
    alone = {name: model.forward([ids])[0] for name, ids in (("a", a), ("b", b), ("c", c))}
    ca, cb, cc = model.new_cache(), model.new_cache(), model.new_cache()
    got = {"a": [model.forward([a[:30]], [ca])[0]], "b": [], "c": []}
    got["a"].append((s := model.forward([a[30:31], b[:25]], [ca, cb]))[0])  # a decodes, b's first chunk
    got["b"].append(s[1])
    s = model.forward([b[25:40], a[31:32], c[:30]], [cb, ca, cc])  # b's last chunk, a decodes, c whole
    got["b"].append(s[0]), got["a"].append(s[1]), got["c"].append(s[2])
    cc.free()
    for pos in range(32, 80):
        got["a"].append(model.forward([a[pos:pos + 1]], [ca])[0])
    assert max_diff(torch.cat(got["a"]), alone["a"]) <= 5e-4
    assert max_diff(torch.cat(got["b"]), alone["b"]) <= 5e-4
    assert max_diff(torch.cat(got["c"]), alone["c"]) <= 1e-5


def test_batched_decode_rows_equal_single_rows(models):
    model, _ = models["original"]
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
        assert max_diff(model.forward([p[-1:]], [c])[0], row) <= 1e-5


def test_overlap_schedule_equals_the_plain_one(folders, models):
    """Two micro-batches taking turns (each with its own sequences' KDA states) == one batch, prefill and decode."""
    model, _ = models["original"]
    other = load_reference_model(folders["original"], overlap=True)
    seqs = [_ids(n, 30 + n) for n in (20, 9, 70, 1)]
    ca, cb = [model.new_cache() for _ in seqs], [other.new_cache() for _ in seqs]
    for x, y in zip(model.forward(seqs, ca), other.forward(seqs, cb)):
        assert max_diff(x, y) <= 1e-5
    nxt = [s[-1:] for s in seqs]
    for x, y in zip(model.forward(nxt, ca), other.forward(nxt, cb)):
        assert max_diff(x, y) <= 1e-5


def test_bf16_reference_is_as_close_to_float32_as_transformers_bf16(folders, models):
    """bf16 by transformers' own yardstick: ours is no further from the float32 truth than transformers' bf16 (plus
    a margin), and no further from transformers' bf16 than that is from the truth."""
    folder = folders["original"]
    ours = load_reference_model(folder, dtype=torch.bfloat16)
    theirs = load_hf(folder, torch.bfloat16)
    ids = _ids(40, 7)
    with torch.no_grad():
        truth, want = hf_logits(models["original"][1], ids), hf_logits(theirs, ids)
    got = ours.forward([ids])[0]
    their_error = max_diff(want, truth)
    assert max_diff(got, truth) <= 1.25 * their_error + 0.05
    assert max_diff(got, want) <= their_error
    assert ours.kv_pool.states.storage[0]["recurrent"].dtype == torch.float32
    assert ours.kv_pool.states.storage[0]["conv"].dtype == torch.bfloat16
    kda_w = ours.w.layers[0].attention
    assert kda_w.dt_bias.dtype == torch.float32 and ours.w.layers[1].router.dtype == torch.float32


def test_fixture_config_layers_and_cache_shapes(models, folders):
    model, _ = models["original"]
    cfg = model.cfg
    assert cfg.family == "kimi_linear" and cfg.linear_layers == (0, 1, 3) and cfg.moe_layers == (1, 2, 3)
    assert cfg.router_kind == "sigmoid_grouped" and cfg.n_group == 2 and cfg.routed_scaling_factor == 2.0
    assert not cfg.mla_rope and cfg.attention_kind == "mla" and cfg.rms_norm_eps == 1e-5
    assert model.w.layers[0].dense_mlp is not None and model.w.layers[1].shared_expert_gate is None
    assert model.cache_specs() == [{}, {}, {"latent": (16 + 4,)}, {}]  # only the MLA layer has a KV history
    assert model.state_shapes()[0] == {"conv": (3 * 32, 3), "recurrent": (4, 8, 8)}
    assert model.kv_pool.prefix_root is None
    for kind in KINDS:
        reader = CheckpointReader(folders[kind])
        check_checkpoint(reader)  # every tensor named with its shape (dense layer 0 under block_sparse_moe.)
        assert expert_layout(reader.config, reader.has) == ("fused" if kind == "fused" else "per_expert")


def test_published_dense_layer_names_load(folders, models, tmp_path):
    """The published files keep the dense layer's MLP under `mlp.` (transformers' default save writes
    `block_sparse_moe.`): the same tensors under either name serve the same logits."""
    import shutil

    from safetensors.torch import load_file, save_file

    src = folders["original"]
    out = tmp_path / "published"
    shutil.copytree(src, out)
    tensors = load_file(str(src / "model.safetensors"))
    renamed = {k.replace("layers.0.block_sparse_moe.", "layers.0.mlp."): v for k, v in tensors.items()}
    assert "model.layers.0.mlp.gate_proj.weight" in renamed
    save_file(renamed, str(out / "model.safetensors"), metadata={"format": "pt"})
    check_checkpoint(CheckpointReader(out))
    ids = _ids(20, 5)
    assert torch.equal(load_reference_model(out).forward([ids])[0], models["original"][0].forward([ids])[0])


@pytest.mark.parametrize("change", ["rope", "one_group", "silu_output_gate"])
def test_each_quirk_changes_the_logits(models, change, monkeypatch):
    """Serving without one quirk moves the logits far beyond the tolerance: the exactness above covers each."""
    model, hf = models["original"]
    cfg = model.cfg
    if change == "rope":
        cfg = dataclasses.replace(cfg, mla_rope=True)
    elif change == "one_group":
        cfg = dataclasses.replace(cfg, n_group=1, topk_group=1)
    else:
        monkeypatch.setattr(torch, "sigmoid", torch.nn.functional.silu)  # Qwen3-Next's gated norm
    other = MoEDecoder(cfg, model.w, model.experts)
    ids = _ids(40, 9)
    with torch.no_grad():
        assert max_diff(other.forward([ids])[0], hf_logits(hf, ids)) > 100 * TOL


# ---------------------------------------------------------------- KDA, pure


def test_chunked_form_equals_recurrent_form_in_float64(monkeypatch):
    """KDA's chunked rule from any state == the recurrent one token at a time (float64: the algorithms only); a
    per-channel decay differs from its per-head mean (the decay really is per channel)."""
    monkeypatch.setattr(gated_delta, "MATH_DTYPE", torch.float64)
    gen = torch.Generator().manual_seed(0)
    b, s, h, d = 2, 150, 3, 8

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q, k, v = rand(b, s, h, d), rand(b, s, h, d), rand(b, s, h, d)
    g = -torch.rand(b, s, h, d, generator=gen, dtype=torch.float64) * 2
    beta = torch.rand(b, s, h, generator=gen, dtype=torch.float64)
    state = rand(b, h, d, d) * 0.1
    whole, end = kda.chunked(q, k, v, g, beta, state)
    outs, st = [], state
    for t in range(s):
        o, st = kda.recurrent_step(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], g[:, t:t + 1], beta[:, t:t + 1], st)
        outs.append(o)
    assert (torch.cat(outs, 1) - whole).abs().max() < 1e-10 and (st - end).abs().max() < 1e-10
    part1, mid = kda.chunked(q[:, :70], k[:, :70], v[:, :70], g[:, :70], beta[:, :70], state, chunk=16)
    part2, end2 = kda.chunked(q[:, 70:], k[:, 70:], v[:, 70:], g[:, 70:], beta[:, 70:], mid)
    assert (torch.cat([part1, part2], 1) - whole).abs().max() < 1e-10 and (end2 - end).abs().max() < 1e-10
    mean = g.mean(-1, keepdim=True).expand_as(g)
    assert (kda.chunked(q, k, v, mean, beta, state)[0] - whole).abs().max() > 1e-2


def test_forget_gate_softplus_as_transformers():
    f = torch.tensor([[-30.0, 0.0, 19.0, 25.0]])
    g = kda.forget_gate(f, torch.zeros(4), torch.tensor([0.0]), 4)
    assert torch.allclose(g, -torch.nn.functional.softplus(f)[None], atol=1e-6)


# ---------------------------------------------------------------- config


def _raw(**overrides) -> dict:
    return config_kwargs() | {"architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear"} | overrides


def test_published_spellings_parse():
    """The published config.json: linear_attn_config (1-indexed kda/full layer lists, head_dim, num_heads,
    short_conv_kernel_size), first_k_dense_replace, and attribute_map names (num_experts, num_experts_per_token,
    num_shared_experts, moe_renormalize, num_expert_group, model_max_length)."""
    published = {"architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "vocab_size": 96,
                 "hidden_size": 32, "intermediate_size": 40, "moe_intermediate_size": 16, "num_hidden_layers": 8,
                 "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 16, "qk_rope_head_dim": 4,
                 "qk_nope_head_dim": 8, "v_head_dim": 8, "num_experts": 8, "num_experts_per_token": 2,
                 "num_shared_experts": 2, "moe_renormalize": True, "num_expert_group": 2, "topk_group": 1,
                 "model_max_length": 4096, "first_k_dense_replace": 2, "moe_router_activation_func": "sigmoid",
                 "routed_scaling_factor": 2.446, "mla_use_nope": True, "moe_layer_freq": 1, "use_grouped_topk": True,
                 "num_nextn_predict_layers": 0,
                 "linear_attn_config": {"full_attn_layers": [4, 8], "kda_layers": [1, 2, 3, 5, 6, 7], "head_dim": 8,
                                        "num_heads": 4, "short_conv_kernel_size": 4}}
    cfg = config_from_dict(published)
    assert cfg.linear_layers == (0, 1, 2, 4, 5, 6) and cfg.moe_layers == (2, 3, 4, 5, 6, 7)
    assert cfg.num_experts == 8 and cfg.top_k == 2 and cfg.shared_expert_intermediate_size == 32
    assert cfg.n_group == 2 and cfg.max_position_embeddings == 4096 and cfg.gated_delta.conv_kernel == 4
    assert cfg.gated_delta.num_v_heads == 4 and cfg.head_dim == 12 and cfg.num_kv_heads == 4
    ungrouped = config_from_dict(published | {"use_grouped_topk": False, "moe_layer_freq": 2})
    assert ungrouped.n_group == 1 and ungrouped.topk_group == 1 and ungrouped.moe_layers == (2, 4, 6)
    default = config_from_dict(_raw(layer_types=None, mlp_layer_types=None, num_hidden_layers=9))  # every 4th from 4
    assert default.linear_layers == (0, 1, 2, 3, 5, 6, 7)


@pytest.mark.parametrize("overrides,key", [
    (dict(layer_types=["linear_attention", "sliding_attention", "linear_attention", "full_attention"]),
     "layer_types"),
    (dict(layer_types=["linear_attention"]), "layer_types"),
    (dict(linear_conv_kernel_dim=0), "linear_conv_kernel_dim"),
    (dict(moe_router_activation_func="softmax"), "moe_router_activation_func"),
    (dict(mla_use_nope=False), "mla_use_nope"),
    (dict(mlp_layer_types=None, moe_layer_freq=0), "moe_layer_freq"),
    (dict(num_local_experts=5), "num_expert_group"),
    (dict(mlp_layer_types=["dense", "moe", "sparse", "sparse"]), "mlp_layer_types"),
    (dict(layer_types=None, linear_attn_config={"full_attn_layers": [9], "kda_layers": [1]}),
     "linear_attn_config.full_attn_layers"),
])
def test_config_refusals_name_the_key(overrides, key):
    with pytest.raises(CheckpointError, match=key):
        config_from_dict(_raw(**overrides))
