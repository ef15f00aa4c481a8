"""On-disk names and the dense loader of MiniMax-M2, ERNIE 4.5 MoE and Hunyuan-A13B checkpoints.

Routed experts use the common names (experts/weights.py `expert_tensor_names`: MiniMax-M2 Mixtral's
`block_sparse_moe.experts.E.w1/w2/w3`, the others `mlp.experts.E.{gate,up,down}_proj`; the stacked
`mlp.experts.gate_up_proj` layout for all three). Everything else is named here. Where a router tensor's name depends
on the layout, it follows what transformers writes:

- MiniMax-M2: per-expert files (and the published checkpoint) keep `block_sparse_moe.gate.weight` and
  `block_sparse_moe.e_score_correction_bias`; stacked files `mlp.gate.weight`, `mlp.e_score_correction_bias`;
- ERNIE 4.5: `mlp.gate.weight`; the bias `mlp.moe_statics.e_score_correction_bias` [1, E] (stacked files:
  `mlp.gate.moe_statics.e_score_correction_bias`); shared experts `mlp.shared_experts.*`;
- Hunyuan: `mlp.gate.wg.weight`, shared MLP `mlp.shared_mlp.*`, `self_attn.query_layernorm` / `key_layernorm`.

FP8 checkpoints (MiniMax-M2 as published, `cfg.fp8_block`) are dequantised on read (experts/fp8.py). ERNIE's and
Hunyuan's gates stay float32 (transformers keeps them so); MiniMax-M2's gate and correction bias take the model
dtype (the bias is held as float32 values, rounded to that dtype, as transformers' buffer is).
"""

from __future__ import annotations

import torch

from .config import MoEModelConfig
from .dense_weights import AttentionWeights, DenseWeights, LayerWeights, gated_mlp, mlp_names
from .fp8 import read_weights
from .reproducible import aligned

FAMILIES = ("minimax_m2", "ernie4_5_moe", "hunyuan_v1_moe")
_SHARED_PREFIX = {"ernie4_5_moe": "mlp.shared_experts.", "hunyuan_v1_moe": "mlp.shared_mlp."}


def _stacked(cfg: MoEModelConfig, has) -> bool:
    """Whether the experts are stored stacked (`mlp.experts.gate_up_proj`), which renames some router tensors."""
    return bool(cfg.moe_layers) and has(f"model.layers.{cfg.moe_layers[0]}.mlp.experts.gate_up_proj")


def _router_names(cfg: MoEModelConfig, p: str, stacked: bool) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """(gate weight, correction bias or None) names and shapes of layer prefix p's router."""
    e, hidden = cfg.num_experts, cfg.hidden_size
    if cfg.family == "minimax_m2":
        module = p + ("mlp." if stacked else "block_sparse_moe.")
        return (module + "gate.weight", (e, hidden)), (module + "e_score_correction_bias", (e,))
    if cfg.family == "ernie4_5_moe":
        bias = p + ("mlp.gate.moe_statics." if stacked else "mlp.moe_statics.") + "e_score_correction_bias"
        return (p + "mlp.gate.weight", (e, hidden)), (bias, (1, e))
    return ((p + "mlp.gate.wg.weight", (e, hidden)),)  # hunyuan_v1_moe


def _norm_names(cfg: MoEModelConfig, a: str) -> tuple[str, str] | None:
    if cfg.family == "minimax_m2":
        return a + "q_norm.weight", a + "k_norm.weight"
    if cfg.family == "hunyuan_v1_moe":
        return a + "query_layernorm.weight", a + "key_layernorm.weight"
    return None


def family_dense_tensor_names(cfg: MoEModelConfig, stacked: bool = False) -> dict[str, tuple[int, ...]]:
    """Every non-expert tensor of a MiniMax-M2 / ERNIE 4.5 / Hunyuan model: name -> expected shape."""
    hidden, vocab, d = cfg.hidden_size, cfg.vocab_size, cfg.head_dim
    q_dim, kv_dim = cfg.num_heads * d, cfg.num_kv_heads * d
    names: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    if not cfg.tie_word_embeddings:
        names["lm_head.weight"] = (vocab, hidden)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        names |= {p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
                  a + "q_proj.weight": (q_dim, hidden), a + "k_proj.weight": (kv_dim, hidden),
                  a + "v_proj.weight": (kv_dim, hidden), a + "o_proj.weight": (hidden, q_dim)}
        if cfg.attention_bias:
            names |= {a + "q_proj.bias": (q_dim,), a + "k_proj.bias": (kv_dim,), a + "v_proj.bias": (kv_dim,)}
        if cfg.attention_out_bias:
            names[a + "o_proj.bias"] = (hidden,)
        if (norms := _norm_names(cfg, a)) is not None:
            widths = (d, d) if cfg.qk_norm_per_head else (q_dim, kv_dim)
            names |= dict(zip(norms, ((w,) for w in widths)))
        if cfg.is_moe_layer(i):
            names |= dict(_router_names(cfg, p, stacked))
            if cfg.has_shared_expert:
                names |= mlp_names(p + _SHARED_PREFIX[cfg.family], hidden, cfg.shared_expert_intermediate_size)
        else:
            names |= mlp_names(p + "mlp.", hidden, cfg.dense_intermediate_size)
    return names


def load_family_dense_weights(reader, dtype: torch.dtype, progress: str | None = None,
                              device: str | torch.device = "cpu") -> DenseWeights:
    """-> DenseWeights of a MiniMax-M2, ERNIE 4.5 MoE or Hunyuan-A13B checkpoint."""
    cfg = reader.config
    stacked = _stacked(cfg, reader.has)
    raw = read_weights(reader, family_dense_tensor_names(cfg, stacked), cfg.fp8_block, progress=progress)
    # aligned: a tensor read in place starts at its file offset, and a few-row product's bits depend on where its
    # weight starts (experts/reproducible.py): on a 64-byte boundary the router gives the same bits wherever it runs.
    t = {k: aligned(v.to(device=device, dtype=dtype)) for k, v in raw.items()}

    router_dtype = dtype if cfg.router_in_model_dtype else torch.float32
    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        norms = _norm_names(cfg, a)
        attention = AttentionWeights(
            q=t[a + "q_proj.weight"], k=t[a + "k_proj.weight"], v=t[a + "v_proj.weight"], o=t[a + "o_proj.weight"],
            q_bias=t.get(a + "q_proj.bias"), k_bias=t.get(a + "k_proj.bias"), v_bias=t.get(a + "v_proj.bias"),
            o_bias=t.get(a + "o_proj.bias"),
            q_norm=t[norms[0]] if norms else None, k_norm=t[norms[1]] if norms else None,
        )
        layer = LayerWeights(input_norm=t[p + "input_layernorm.weight"],
                             post_attention_norm=t[p + "post_attention_layernorm.weight"], attention=attention)
        if cfg.is_moe_layer(i):
            router = _router_names(cfg, p, stacked)
            layer.router = aligned(raw[router[0][0]].to(device=device, dtype=router_dtype))  # [E, H]
            if len(router) > 1:  # [E] (ERNIE stores [1, E]); rounded as transformers holds it (MiniMax: model dtype)
                bias = raw[router[1][0]].reshape(-1).to(device=device, dtype=router_dtype)
                layer.router_correction_bias = bias.float()
            if cfg.has_shared_expert:
                layer.shared_expert = gated_mlp(t, p + _SHARED_PREFIX[cfg.family])
        else:
            layer.dense_mlp = gated_mlp(t, p + "mlp.")
        layers.append(layer)
    embed = t["model.embed_tokens.weight"]
    return DenseWeights(embed=embed, layers=layers, final_norm=t["model.norm.weight"],
                        lm_head=embed if cfg.tie_word_embeddings else t["lm_head.weight"])
