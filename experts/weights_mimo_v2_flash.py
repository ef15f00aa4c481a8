"""On-disk names and the dense loader of MiMo-V2-Flash checkpoints (MiMoV2FlashForCausalLM).

Per layer: `self_attn.{q,k,v,o}_proj` (q/k/v biases with attention_bias; k/v rows per the layer's KV heads, v rows
`v_head_dim` wide), `self_attn.attention_sink_bias` [nh] on sliding layers, the two norms, and either a dense
`mlp.{gate,up,down}_proj` or an MoE layer's `mlp.gate.weight` [E, H] and `mlp.gate.e_score_correction_bias` [E] (both
float32, as transformers keeps them). Routed experts use the common names (experts/weights.py: per-expert
`mlp.experts.E.*_proj` or stacked `mlp.experts.gate_up_proj`). The MTP layers (`model.mtp.*`) are never named.
FP8 block-scaled files (`quantization_config.quant_method: fp8`) are dequantised on read (experts/fp8.py),
per-expert experts only. The sinks are `attention_sink_bias` in the published (original-format) files and `sinks`,
transformers' own name, in files saved with the stacked experts (`save_original_format=False`).
"""

from __future__ import annotations

import torch

from .config import MoEModelConfig
from .dense_weights import AttentionWeights, DenseWeights, LayerWeights, mlp_names
from .ffn import GatedMLPWeights
from .fp8 import read_weights
from .reproducible import aligned

FAMILIES = ("mimo_v2_flash",)


def _sink_name(stacked: bool) -> str:
    return "sinks" if stacked else "attention_sink_bias"


def mimo_dense_tensor_names(cfg: MoEModelConfig, stacked: bool = False) -> dict[str, tuple[int, ...]]:
    """Every non-expert tensor of a MiMo-V2-Flash model: name -> expected shape."""
    hidden, vocab, d, dv = cfg.hidden_size, cfg.vocab_size, cfg.head_dim, cfg.v_head_dim
    names: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    if not cfg.tie_word_embeddings:
        names["lm_head.weight"] = (vocab, hidden)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        kvh = cfg.kv_heads(i)
        names |= {p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
                  a + "q_proj.weight": (cfg.num_heads * d, hidden), a + "k_proj.weight": (kvh * d, hidden),
                  a + "v_proj.weight": (kvh * dv, hidden), a + "o_proj.weight": (hidden, cfg.num_heads * dv)}
        if cfg.attention_bias:
            names |= {a + "q_proj.bias": (cfg.num_heads * d,), a + "k_proj.bias": (kvh * d,),
                      a + "v_proj.bias": (kvh * dv,)}
        if i in cfg.sliding_layers:
            names[a + _sink_name(stacked)] = (cfg.num_heads,)
        if cfg.is_moe_layer(i):
            names |= {p + "mlp.gate.weight": (cfg.num_experts, hidden),
                      p + "mlp.gate.e_score_correction_bias": (cfg.num_experts,)}
        else:
            names |= mlp_names(p + "mlp.", hidden, cfg.dense_intermediate_size)
    return names


def load_mimo_dense_weights(reader, dtype: torch.dtype, progress: str | None = None,
                            device: str | torch.device = "cpu") -> DenseWeights:
    """-> DenseWeights of a MiMo-V2-Flash checkpoint (each tensor read in its stored dtype, moved and cast once; the
    router gate and correction bias to float32)."""
    cfg = reader.config
    stacked = bool(cfg.moe_layers) and reader.has(f"model.layers.{cfg.moe_layers[0]}.mlp.experts.gate_up_proj")
    names = mimo_dense_tensor_names(cfg, stacked)
    raw = read_weights(reader, names, cfg.fp8_block, progress=progress)  # FP8 files: dequantised (float32)
    kept_fp32 = {k for k in names if ".mlp.gate." in k}
    # aligned: a few-row product's bits depend on where its weight starts (experts/reproducible.py)
    t = {k: aligned(raw.pop(k).to(device=device, dtype=torch.float32 if k in kept_fp32 else dtype))
         for k in list(raw)}

    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        attention = AttentionWeights(
            q=t[a + "q_proj.weight"], k=t[a + "k_proj.weight"], v=t[a + "v_proj.weight"], o=t[a + "o_proj.weight"],
            q_bias=t.get(a + "q_proj.bias"), k_bias=t.get(a + "k_proj.bias"), v_bias=t.get(a + "v_proj.bias"),
            sinks=t.get(a + _sink_name(stacked)),
        )
        layer = LayerWeights(input_norm=t[p + "input_layernorm.weight"],
                             post_attention_norm=t[p + "post_attention_layernorm.weight"], attention=attention)
        if cfg.is_moe_layer(i):
            layer.router = t[p + "mlp.gate.weight"]  # [E, H] float32
            layer.router_correction_bias = t[p + "mlp.gate.e_score_correction_bias"]  # [E] float32
        else:
            layer.dense_mlp = GatedMLPWeights.from_parts(t[p + "mlp.gate_proj.weight"], t[p + "mlp.up_proj.weight"],
                                                         t[p + "mlp.down_proj.weight"])
        layers.append(layer)
    embed = t["model.embed_tokens.weight"]
    return DenseWeights(embed=embed, layers=layers, final_norm=t["model.norm.weight"],
                        lm_head=embed if cfg.tie_word_embeddings else t["lm_head.weight"])
