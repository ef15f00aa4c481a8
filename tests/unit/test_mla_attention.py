"""Multi-head Latent Attention (`expertmesh.experts.mla_attention`), YaRN and FP8 dequantisation, layer by layer
against transformers' own modules (the whole-model comparison is in test_deepseek_vs_transformers)."""

from __future__ import annotations

import pytest
import torch

from expertmesh.experts.attention_core import attend_decode, attend_prefill
from expertmesh.experts.config import config_from_dict
from expertmesh.experts.fp8 import dequantize, quantize, scale_shape
from expertmesh.experts.mla_attention import AbsorbedMLAAttention, MLAAttention
from expertmesh.experts.rope_yarn import yarn_inv_freq
from expertmesh.experts.weights_deepseek import MLAWeights

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 16,
        "mscale": 0.9, "mscale_all_dim": 0.7, "beta_fast": 32, "beta_slow": 1}
VARIANTS = {
    "v2": ("deepseek_v2", dict(q_lora_rank=None)),
    "v2_lora_yarn": ("deepseek_v2", dict(q_lora_rank=24, rope_parameters=YARN)),
    "v3_yarn": ("deepseek_v3", dict(q_lora_rank=24, rope_parameters=YARN)),
    "v3_no_q_lora": ("deepseek_v3", dict(q_lora_rank=None)),
    "v3_rotate_half": ("deepseek_v3", dict(q_lora_rank=24, rope_interleave=False, attention_bias=True)),
}


def _hf_config(family: str, **overrides):
    from transformers import DeepseekV2Config, DeepseekV3Config

    cls = DeepseekV2Config if family == "deepseek_v2" else DeepseekV3Config
    cfg = cls(**(dict(vocab_size=32, hidden_size=40, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                      moe_intermediate_size=8,
                      kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=10,
                      max_position_embeddings=256) | overrides))
    cfg._attn_implementation = "eager"
    return cfg


def _modules(name: str):
    family, overrides = VARIANTS[name]
    hf_cfg = _hf_config(family, **overrides)
    if family == "deepseek_v2":
        from transformers.models.deepseek_v2.modeling_deepseek_v2 import (
            DeepseekV2Attention as Attention,
        )
        from transformers.models.deepseek_v2.modeling_deepseek_v2 import (
            DeepseekV2RotaryEmbedding as Rotary,
        )
    else:
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
            DeepseekV3Attention as Attention,
        )
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
            DeepseekV3RotaryEmbedding as Rotary,
        )
    torch.manual_seed(0)
    attn, rotary = Attention(hf_cfg, layer_idx=0).eval(), Rotary(hf_cfg)
    with torch.no_grad():
        for name_, p in attn.named_parameters():
            if "layernorm" in name_:
                p.add_(torch.randn_like(p) * 0.2)
            else:
                p.normal_(0, 0.2)
    raw = hf_cfg.to_dict() | {"architectures": [Attention.__name__.replace("Attention", "ForCausalLM")]}
    return attn, rotary, config_from_dict(raw)


def _mla_weights(attn) -> MLAWeights:
    sd = {k: v.detach() for k, v in attn.state_dict().items()}
    return MLAWeights(kv_a=sd["kv_a_proj_with_mqa.weight"], kv_a_norm=sd["kv_a_layernorm.weight"],
                      kv_b=sd["kv_b_proj.weight"], o=sd["o_proj.weight"], q=sd.get("q_proj.weight"),
                      q_a=sd.get("q_a_proj.weight"), q_a_norm=sd.get("q_a_layernorm.weight"),
                      q_b=sd.get("q_b_proj.weight"), q_a_bias=sd.get("q_a_proj.bias"),
                      kv_a_bias=sd.get("kv_a_proj_with_mqa.bias"), o_bias=sd.get("o_proj.bias"))


def _tables(rotary, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [T, R] in the cat(freqs, freqs) layout (with the attention factor), from transformers' rotary."""
    out = rotary(torch.zeros(1, dtype=torch.float32), positions[None])
    if isinstance(out, tuple):
        return out[0][0], out[1][0]
    freqs_cis = out[0]  # DeepSeek-V2: complex [T, R/2]
    return torch.cat([freqs_cis.real] * 2, -1), torch.cat([freqs_cis.imag] * 2, -1)


def _attend(layer: MLAAttention, q: torch.Tensor, latent: torch.Tensor, start: int) -> torch.Tensor:
    """Plain causal softmax attention of q [S, nh, d] at positions start.. over all cached latents [L, .]."""
    k, v = layer.keys_values({"latent": latent})  # [L, nh, d_qk], [L, nh, d_v]
    scores = torch.einsum("snd,lnd->nsl", q, k) * layer.scale  # [nh, S, L]
    q_pos = torch.arange(start, start + q.shape[0])[:, None]
    scores = scores.masked_fill(torch.arange(latent.shape[0])[None, :] > q_pos, float("-inf"))
    out = torch.einsum("nsl,lnd->snd", torch.softmax(scores, -1), v)  # [S, nh, d_v]
    return layer.output(out.reshape(q.shape[0], -1))


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_mla_layer_matches_transformers_and_caches_the_latent(name):
    attn, rotary, cfg = _modules(name)
    layer = MLAAttention(cfg, _mla_weights(attn))
    assert layer.scale == pytest.approx(attn.scaling, rel=1e-12)
    assert layer.cache_spec == {"latent": (cfg.kv_lora_rank + cfg.qk_rope_head_dim,)}
    seq = 11
    h = torch.randn(seq, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    positions = torch.arange(seq)
    cos, sin = _tables(rotary, positions)
    mask = torch.full((seq, seq), float("-inf")).triu(1)[None, None]  # additive causal mask
    with torch.no_grad():
        theirs = attn(h[None], position_embeddings=rotary(h[None], positions[None]) if cfg.family == "deepseek_v2"
                      else (cos[None], sin[None]), attention_mask=mask)[0][0]
        q, entries = layer.project(h, cos, sin)
        assert entries["latent"].shape == (seq, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        ours = _attend(layer, q, entries["latent"], 0)
        assert (ours - theirs).abs().max().item() <= 1e-5
        assert theirs.std().item() > 0.05
        # incremental: the first 6 tokens' latents cached, then the rest attend over cache + their own
        q_a, first = layer.project(h[:6], cos[:6], sin[:6])
        q_b, second = layer.project(h[6:], cos[6:], sin[6:])
        latents = torch.cat([first["latent"], second["latent"]])
        assert (torch.cat([_attend(layer, q_a, first["latent"], 0), _attend(layer, q_b, latents, 6)])
                - theirs).abs().max().item() <= 1e-5


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_absorbed_mla_equals_the_expanded_form_through_the_attention_core(name):
    """Same cache entries; prefill and padded decode through attention_core, against transformers' layer."""
    attn, rotary, cfg = _modules(name)
    expanded, absorbed = MLAAttention(cfg, _mla_weights(attn)), AbsorbedMLAAttention(cfg, _mla_weights(attn))
    assert absorbed.cache_spec == expanded.cache_spec and absorbed.num_kv_heads == 1
    assert absorbed.scale == expanded.scale
    seq = 9
    h = torch.randn(seq, cfg.hidden_size, generator=torch.Generator().manual_seed(4))
    cos, sin = _tables(rotary, torch.arange(seq))
    mask = torch.full((seq, seq), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        theirs = attn(h[None], position_embeddings=rotary(h[None], torch.arange(seq)[None])
                      if cfg.family == "deepseek_v2" else (cos[None], sin[None]), attention_mask=mask)[0][0]
        outs = {}
        for label, layer in (("expanded", expanded), ("absorbed", absorbed)):
            q, entries = layer.project(h, cos, sin)
            assert torch.equal(entries["latent"], expanded.project(h, cos, sin)[1]["latent"])
            k, v = layer.keys_values(entries)
            prefill = layer.output(attend_prefill(q[:6], k[:6], v[:6], 0, layer.scale))  # [6, H]
            # then tokens 6, 7, 8 decode one by one as a padded batch of three histories of lengths 7, 8, 9
            lengths = torch.tensor([7, 8, 9])
            k_b = torch.stack([k] * 3)  # [B, L, kvh, Dqk]: padding beyond each length is masked
            v_b = torch.stack([v] * 3)
            decode = layer.output(attend_decode(q[6:], k_b, v_b, lengths, layer.scale))  # [3, H]
            outs[label] = torch.cat([prefill, decode])
            assert (outs[label] - theirs).abs().max().item() <= 1e-5
        assert (outs["absorbed"] - outs["expanded"]).abs().max().item() <= 1e-5


@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3"])
def test_yarn_frequencies_and_attention_factor_equal_transformers(family):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_cfg = _hf_config(family, rope_parameters=YARN)
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg)
    cfg = config_from_dict(hf_cfg.to_dict() | {"architectures": [
        "DeepseekV2ForCausalLM" if family == "deepseek_v2" else "DeepseekV3ForCausalLM"]})
    ours, our_factor = yarn_inv_freq(cfg.rotary_dim, cfg.rope_theta, cfg.yarn)
    assert torch.equal(ours, inv_freq)
    assert our_factor == pytest.approx(factor, rel=1e-12) and factor != 1.0


# ---------------------------------------------------------------- FP8 block scaling


@pytest.mark.parametrize("block", [(8, 8), (16, 8), (128, 128)])
def test_fp8_dequantisation_equals_transformers(block):
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    w = torch.randn(64, 48, generator=torch.Generator().manual_seed(2))
    q, scale_inv = quantize(w, block)
    assert q.dtype == torch.float8_e4m3fn and scale_inv.shape == scale_shape((64, 48), block)
    ours = dequantize(q, scale_inv, block)
    assert torch.equal(ours, Fp8Dequantize(None)._dequantize_one(q, scale_inv, torch.float32))
    assert (ours - w).abs().max().item() <= w.abs().max().item() / 8  # e4m3 keeps 3 mantissa bits


def test_fp8_partial_blocks_use_their_blocks_scale():
    """Shapes that are not multiples of the block (DeepSeek-V3 has some): the published formula, by hand."""
    w = torch.randn(20, 13, generator=torch.Generator().manual_seed(3)) * 5
    q, s = quantize(w, (8, 8))
    assert s.shape == (3, 2)
    expected = torch.empty(20, 13)
    for i in range(20):
        for j in range(13):
            expected[i, j] = q[i, j].float() * s[i // 8, j // 8]
    assert torch.equal(dequantize(q, s, (8, 8)), expected)
    # each block's largest magnitude maps to the e4m3 maximum
    assert q[:8, :8].float().abs().max().item() == 448.0
