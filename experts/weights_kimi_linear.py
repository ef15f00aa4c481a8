"""On-disk names and the dense loader of Kimi-Linear checkpoints.

Two layouts, as published (and as transformers' save_pretrained writes by default) or as transformers holds them in
memory (`save_pretrained(save_original_format=False)`); the loader reads either:

- KDA layers `self_attn.`: `q_proj` / `k_proj` / `v_proj` [h*d, H]; `q_conv1d` / `k_conv1d` / `v_conv1d` [h*d, 1, K]
  (fused: one `conv1d` [3*h*d, 1, K]); the forget gate `f_a_proj` [d, H], `f_b_proj` [h*d, d], `dt_bias` [h*d],
  `A_log` [1, 1, h, 1] (fused: under `forget_gate.`); `b_proj` [h, H]; the output gate `g_a_proj` [d, H], `g_b_proj`
  [h*d, d]; `o_norm` [d]; `o_proj` [H, h*d].
- MLA layers `self_attn.`: DeepSeek's names (experts/weights_deepseek.py `MLAWeights`), no RoPE.
- MoE layers: `block_sparse_moe.` (fused: `mlp.`) `gate.weight` [E, H], `gate.e_score_correction_bias` [E],
  `shared_experts.{gate,up,down}_proj`, routed experts `experts.E.w1/w2/w3` (fused: `mlp.experts.gate_up_proj`,
  experts/weights.py).
- Dense layers: `mlp.{gate,up,down}_proj` as published; transformers' default save writes them under
  `block_sparse_moe.` (its rename rule, reversed, applies to every MLP), so per-expert files are looked up both ways.

The router gate, its correction bias and dt_bias stay float32, as transformers keeps them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .config import MoEModelConfig
from .dense_weights import DenseWeights, LayerWeights, gated_mlp, mlp_names
from .reproducible import aligned
from .weights_deepseek import MLAWeights, _attention_names

FAMILIES = ("kimi_linear",)
FLOAT32 = (".gate.weight", ".gate.e_score_correction_bias", "dt_bias")  # name endings kept float32


@dataclass
class KDAWeights:
    """One KDA layer (F.linear's [out, in])."""

    qkv: torch.Tensor  # [3*h*d, H] q rows, k rows, v rows (the conv's channels in order)
    conv: torch.Tensor  # [3*h*d, K] depthwise causal conv taps
    f_a: torch.Tensor  # [d, H] forget gate, low rank
    f_b: torch.Tensor  # [h*d, d]
    dt_bias: torch.Tensor  # [h*d] float32
    A_log: torch.Tensor  # [h]
    b: torch.Tensor  # [h, H] -> beta = sigmoid(b)
    g_a: torch.Tensor  # [d, H] output gate, low rank
    g_b: torch.Tensor  # [h*d, d]
    norm: torch.Tensor  # [d] o_norm weight
    out: torch.Tensor  # [H, h*d]


def kimi_expert_prefix(layer: int) -> str:
    """Where layer `layer` keeps its routed experts in the per-expert layout (`E.w1.weight`..)."""
    return f"model.layers.{layer}.block_sparse_moe.experts."


def _moe_module(stacked: bool) -> str:
    return "mlp." if stacked else "block_sparse_moe."


def kimi_dense_tensor_names(cfg: MoEModelConfig, stacked: bool = False,
                            has: Callable[[str], bool] | None = None) -> dict[str, tuple[int, ...]]:
    """Every non-expert tensor of a Kimi-Linear model: name -> expected shape. `has` (the checkpoint's names) picks
    where per-expert files keep the dense layers' MLP; without it, the published `mlp.`."""
    hidden, vocab, g = cfg.hidden_size, cfg.vocab_size, cfg.gated_delta
    names: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    if not cfg.tie_word_embeddings:
        names["lm_head.weight"] = (vocab, hidden)
    qkv, d, heads = g.key_dim, g.k_head_dim, g.num_k_heads
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        names |= {p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,)}
        if cfg.is_linear_layer(i):
            fg = a + "forget_gate." if stacked else a
            names |= {a + f"{n}_proj.weight": (qkv, hidden) for n in "qkv"}
            names |= {a + f"{n}_conv1d.weight": (qkv, 1, g.conv_kernel) for n in "qkv"} if not stacked else \
                {a + "conv1d.weight": (3 * qkv, 1, g.conv_kernel)}
            names |= {fg + "f_a_proj.weight": (d, hidden), fg + "f_b_proj.weight": (qkv, d), fg + "dt_bias": (qkv,),
                      fg + "A_log": (1, 1, heads, 1), a + "b_proj.weight": (heads, hidden),
                      a + "g_a_proj.weight": (d, hidden), a + "g_b_proj.weight": (qkv, d), a + "o_norm.weight": (d,),
                      a + "o_proj.weight": (hidden, qkv)}
        else:
            names |= _attention_names(cfg, a)
        if cfg.is_moe_layer(i):
            m = p + _moe_module(stacked)
            names |= {m + "gate.weight": (cfg.num_experts, hidden),
                      m + "gate.e_score_correction_bias": (cfg.num_experts,)}
            if cfg.shared_expert_intermediate_size > 0:
                names |= mlp_names(m + "shared_experts.", hidden, cfg.shared_expert_intermediate_size)
        else:
            names |= mlp_names(_dense_mlp_prefix(cfg, i, stacked, has), hidden, cfg.dense_intermediate_size)
    return names


def _dense_mlp_prefix(cfg: MoEModelConfig, layer: int, stacked: bool, has: Callable[[str], bool] | None) -> str:
    p = f"model.layers.{layer}."
    if not stacked and has is not None and not has(p + "mlp.gate_proj.weight") \
            and has(p + "block_sparse_moe.gate_proj.weight"):
        return p + "block_sparse_moe."  # transformers' default save of a dense layer
    return p + "mlp."


def load_kimi_dense_weights(reader, dtype: torch.dtype, progress: str | None = None,
                            device: str | torch.device = "cpu") -> DenseWeights:
    """-> DenseWeights of a Kimi-Linear checkpoint (each tensor read in its stored dtype, moved and cast once; KDA
    layers carry KDAWeights in `attention`, MLA layers MLAWeights)."""
    cfg = reader.config
    stacked = reader.has(f"model.layers.{cfg.moe_layers[0]}.mlp.experts.gate_up_proj") if cfg.moe_layers else False
    names = kimi_dense_tensor_names(cfg, stacked, reader.has)
    raw = reader.read_many(names, progress=progress)
    # aligned: a few-row product's bits depend on where its weight starts (experts/reproducible.py)
    t = {k: aligned(raw.pop(k).to(device=device, dtype=torch.float32 if k.endswith(FLOAT32) else dtype))
         for k in list(raw)}
    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        if cfg.is_linear_layer(i):
            fg = a + "forget_gate." if stacked else a
            conv = t[a + "conv1d.weight"] if stacked else torch.cat([t[a + f"{n}_conv1d.weight"] for n in "qkv"])
            attention = KDAWeights(
                qkv=aligned(torch.cat([t[a + f"{n}_proj.weight"] for n in "qkv"])), conv=conv[:, 0].contiguous(),
                f_a=t[fg + "f_a_proj.weight"], f_b=t[fg + "f_b_proj.weight"], dt_bias=t[fg + "dt_bias"],
                A_log=t[fg + "A_log"].reshape(-1), b=t[a + "b_proj.weight"], g_a=t[a + "g_a_proj.weight"],
                g_b=t[a + "g_b_proj.weight"], norm=t[a + "o_norm.weight"], out=t[a + "o_proj.weight"])
        else:
            attention = MLAWeights(
                kv_a=t[a + "kv_a_proj_with_mqa.weight"], kv_a_norm=t[a + "kv_a_layernorm.weight"],
                kv_b=t[a + "kv_b_proj.weight"], o=t[a + "o_proj.weight"], q=t.get(a + "q_proj.weight"),
                q_a=t.get(a + "q_a_proj.weight"), q_a_norm=t.get(a + "q_a_layernorm.weight"),
                q_b=t.get(a + "q_b_proj.weight"), q_a_bias=t.get(a + "q_a_proj.bias"),
                kv_a_bias=t.get(a + "kv_a_proj_with_mqa.bias"), o_bias=t.get(a + "o_proj.bias"))
        layer = LayerWeights(input_norm=t[p + "input_layernorm.weight"],
                             post_attention_norm=t[p + "post_attention_layernorm.weight"], attention=attention)
        if cfg.is_moe_layer(i):
            m = p + _moe_module(stacked)
            layer.router = t[m + "gate.weight"]  # [E, H] float32
            layer.router_correction_bias = t[m + "gate.e_score_correction_bias"]  # [E] float32
            if cfg.shared_expert_intermediate_size > 0:
                layer.shared_expert = gated_mlp(t, m + "shared_experts.")
        else:
            layer.dense_mlp = gated_mlp(t, _dense_mlp_prefix(cfg, i, stacked, reader.has))
        layers.append(layer)
    embed = t["model.embed_tokens.weight"]
    return DenseWeights(embed=embed, layers=layers, final_norm=t["model.norm.weight"],
                        lm_head=embed if cfg.tie_word_embeddings else t["lm_head.weight"])
