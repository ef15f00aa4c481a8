"""On-disk names and the dense loader of DeepSeek-V2/V3/V3.2 and GLM-5 (MLA; V3.2 and GLM-5 with the DSA indexer's
`self_attn.indexer.*`) and GLM-4.5 (GQA) checkpoints.

Routed experts use the common per-expert names (`model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight`, see
`weights.expert_tensor_names`); everything else is named here. FP8 checkpoints (`cfg.fp8_block`) are dequantised on
read (experts/fp8.py). Layers from `num_hidden_layers` on (multi-token prediction) are never named, so never read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import MoEModelConfig
from .dense_weights import AttentionWeights, DenseWeights, LayerWeights, gated_mlp, mlp_names
from .fp8 import read_weights


@dataclass
class IndexerWeights:
    """DeepSeek Sparse Attention's lightning indexer of one layer (transformers' DeepseekV32Indexer)."""

    wq_b: torch.Tensor  # [nh_i*d_i, q_r] index queries from the q-LoRA latent
    wk: torch.Tensor  # [d_i, H] the one index key per token
    k_norm: torch.Tensor  # [d_i] LayerNorm weight ...
    k_norm_bias: torch.Tensor  # [d_i] ... and bias
    weights_proj: torch.Tensor  # [nh_i, H] per-head weights of the scores; float32, as transformers keeps it


@dataclass
class MLAWeights:
    """One Multi-head Latent Attention layer (transformers' DeepseekV2Attention / DeepseekV3Attention)."""

    kv_a: torch.Tensor  # [r + d_rope, H] kv_a_proj_with_mqa: the latent and the shared rope key
    kv_a_norm: torch.Tensor  # [r]
    kv_b: torch.Tensor  # [nh*(d_nope + d_v), r] the latent -> per-head key (no rope part) and value
    o: torch.Tensor  # [H, nh*d_v]
    q: torch.Tensor | None = None  # [nh*d_qk, H] without q_lora_rank
    q_a: torch.Tensor | None = None  # [q_r, H] with q_lora_rank
    q_a_norm: torch.Tensor | None = None  # [q_r]
    q_b: torch.Tensor | None = None  # [nh*d_qk, q_r]
    q_a_bias: torch.Tensor | None = None  # attention_bias
    kv_a_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None
    indexer: IndexerWeights | None = None  # DeepSeek-V3.2 / GLM-5 (not on GLM-5's "shared" layers)


def _indexer_names(cfg: MoEModelConfig, x: str) -> dict[str, tuple[int, ...]]:
    """The DSA indexer's tensors under `x` (`...self_attn.indexer.`)."""
    d = cfg.index_head_dim
    return {x + "wq_b.weight": (cfg.index_n_heads * d, cfg.q_lora_rank), x + "wk.weight": (d, cfg.hidden_size),
            x + "k_norm.weight": (d,), x + "k_norm.bias": (d,),
            x + "weights_proj.weight": (cfg.index_n_heads, cfg.hidden_size)}


def _attention_names(cfg: MoEModelConfig, a: str) -> dict[str, tuple[int, ...]]:
    hidden, nh = cfg.hidden_size, cfg.num_heads
    bias = cfg.attention_bias
    if cfg.attention_kind == "mla":
        d_qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        r = cfg.kv_lora_rank
        names: dict[str, tuple[int, ...]] = {
            a + "kv_a_proj_with_mqa.weight": (r + cfg.qk_rope_head_dim, hidden),
            a + "kv_a_layernorm.weight": (r,),
            a + "kv_b_proj.weight": (nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), r),
            a + "o_proj.weight": (hidden, nh * cfg.v_head_dim),
        }
        if cfg.q_lora_rank is None:
            names[a + "q_proj.weight"] = (nh * d_qk, hidden)
        else:
            names |= {a + "q_a_proj.weight": (cfg.q_lora_rank, hidden), a + "q_a_layernorm.weight": (cfg.q_lora_rank,),
                      a + "q_b_proj.weight": (nh * d_qk, cfg.q_lora_rank)}
            if bias:
                names[a + "q_a_proj.bias"] = (cfg.q_lora_rank,)
        if bias:
            names |= {a + "kv_a_proj_with_mqa.bias": (r + cfg.qk_rope_head_dim,), a + "o_proj.bias": (hidden,)}
        return names
    # GLM-4.5: GQA, q/k/v bias with attention_bias, o_proj never biased, per-head q/k norm with use_qk_norm
    d = cfg.head_dim
    q_dim, kv_dim = nh * d, cfg.num_kv_heads * d
    names = {a + "q_proj.weight": (q_dim, hidden), a + "k_proj.weight": (kv_dim, hidden),
             a + "v_proj.weight": (kv_dim, hidden), a + "o_proj.weight": (hidden, q_dim)}
    if bias:
        names |= {a + "q_proj.bias": (q_dim,), a + "k_proj.bias": (kv_dim,), a + "v_proj.bias": (kv_dim,)}
    if cfg.qk_norm_per_head:
        names |= {a + "q_norm.weight": (d,), a + "k_norm.weight": (d,)}
    return names


def deepseek_dense_tensor_names(cfg: MoEModelConfig) -> dict[str, tuple[int, ...]]:
    """Every non-expert tensor of a DeepSeek-V2/V3 or GLM-4.5 model: name -> expected shape."""
    hidden, vocab = cfg.hidden_size, cfg.vocab_size
    names: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    if not cfg.tie_word_embeddings:
        names["lm_head.weight"] = (vocab, hidden)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        names |= {p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,)}
        names |= _attention_names(cfg, p + "self_attn.")
        if cfg.has_indexer(i):
            names |= _indexer_names(cfg, p + "self_attn.indexer.")
        if cfg.is_moe_layer(i):
            names[p + "mlp.gate.weight"] = (cfg.num_experts, hidden)
            if cfg.router_correction_bias:
                names[p + "mlp.gate.e_score_correction_bias"] = (cfg.num_experts,)
            if cfg.has_shared_expert:
                names |= mlp_names(p + "mlp.shared_experts.", hidden, cfg.shared_expert_intermediate_size)
        else:
            names |= mlp_names(p + "mlp.", hidden, cfg.dense_intermediate_size)
    return names


def load_deepseek_dense_weights(reader, dtype: torch.dtype, progress: str | None = None,
                                device: str | torch.device = "cpu") -> DenseWeights:
    """-> DenseWeights of a DeepSeek-V2/V3 or GLM-4.5 checkpoint. The router gate and its correction bias
    stay float32 (transformers keeps them so and computes router logits in float32)."""
    cfg = reader.config
    raw = read_weights(reader, deepseek_dense_tensor_names(cfg), cfg.fp8_block, progress=progress)
    t = {k: v.to(device=device, dtype=dtype) for k, v in raw.items()}

    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        if cfg.attention_kind == "mla":
            attention = MLAWeights(
                kv_a=t[a + "kv_a_proj_with_mqa.weight"], kv_a_norm=t[a + "kv_a_layernorm.weight"],
                kv_b=t[a + "kv_b_proj.weight"], o=t[a + "o_proj.weight"], q=t.get(a + "q_proj.weight"),
                q_a=t.get(a + "q_a_proj.weight"), q_a_norm=t.get(a + "q_a_layernorm.weight"),
                q_b=t.get(a + "q_b_proj.weight"), q_a_bias=t.get(a + "q_a_proj.bias"),
                kv_a_bias=t.get(a + "kv_a_proj_with_mqa.bias"), o_bias=t.get(a + "o_proj.bias"),
            )
            if cfg.has_indexer(i):
                x = a + "indexer."
                attention.indexer = IndexerWeights(
                    wq_b=t[x + "wq_b.weight"], wk=t[x + "wk.weight"], k_norm=t[x + "k_norm.weight"],
                    k_norm_bias=t[x + "k_norm.bias"],
                    weights_proj=raw[x + "weights_proj.weight"].to(device=device, dtype=torch.float32))
        else:
            attention = AttentionWeights(
                q=t[a + "q_proj.weight"], k=t[a + "k_proj.weight"], v=t[a + "v_proj.weight"],
                o=t[a + "o_proj.weight"], q_bias=t.get(a + "q_proj.bias"), k_bias=t.get(a + "k_proj.bias"),
                v_bias=t.get(a + "v_proj.bias"), q_norm=t.get(a + "q_norm.weight"), k_norm=t.get(a + "k_norm.weight"),
            )
        layer = LayerWeights(input_norm=t[p + "input_layernorm.weight"],
                             post_attention_norm=t[p + "post_attention_layernorm.weight"], attention=attention)
        if cfg.is_moe_layer(i):
            layer.router = raw[p + "mlp.gate.weight"].to(device=device, dtype=torch.float32)  # [E, H]
            bias = raw.get(p + "mlp.gate.e_score_correction_bias")
            layer.router_correction_bias = None if bias is None else bias.to(device=device, dtype=torch.float32)
            if cfg.has_shared_expert:
                layer.shared_expert = gated_mlp(t, p + "mlp.shared_experts.")
        else:
            layer.dense_mlp = gated_mlp(t, p + "mlp.")
        layers.append(layer)
    embed = t["model.embed_tokens.weight"]
    return DenseWeights(embed=embed, layers=layers, final_norm=t["model.norm.weight"],
                        lm_head=embed if cfg.tie_word_embeddings else t["lm_head.weight"])
