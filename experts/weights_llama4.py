"""On-disk names and the dense loader of Llama 4 text checkpoints (Llama4ForCausalLM, and the text part of
Llama4ForConditionalGeneration, whose names carry `cfg.weight_prefix` = "language_model.").

Per layer: `self_attn.{q,k,v,o}_proj` (biases with attention_bias), `input_layernorm`, `post_attention_layernorm`,
and a `feed_forward` that is either MoE (`router.weight` [E, H], `shared_expert.{gate,up,down}_proj`, routed experts
stacked in `experts.gate_up_proj` [E, H, 2I] / `experts.down_proj` [E, I, H], read by experts/weights.py's
`fused_in_out` layout) or a dense MLP (`{gate,up,down}_proj`, `intermediate_size_mlp` wide). The router gate stays
in the model dtype (transformers' Llama4Router is a plain Linear).
"""

from __future__ import annotations

import torch

from .config import MoEModelConfig
from .dense_weights import AttentionWeights, DenseWeights, LayerWeights, gated_mlp, mlp_names
from .reproducible import aligned

FAMILIES = ("llama4",)


def llama4_expert_prefix(cfg: MoEModelConfig, layer: int) -> str:
    """Where layer `layer` keeps its stacked routed experts (`gate_up_proj`, `down_proj`)."""
    return f"{cfg.weight_prefix}model.layers.{layer}.feed_forward.experts."


def llama4_dense_tensor_names(cfg: MoEModelConfig, stacked: bool = True) -> dict[str, tuple[int, ...]]:
    """Every non-expert tensor of a Llama 4 text model: name -> expected shape."""
    hidden, vocab, d, pre = cfg.hidden_size, cfg.vocab_size, cfg.head_dim, cfg.weight_prefix
    q_dim, kv_dim = cfg.num_heads * d, cfg.num_kv_heads * d
    names: dict[str, tuple[int, ...]] = {pre + "model.embed_tokens.weight": (vocab, hidden),
                                         pre + "model.norm.weight": (hidden,)}
    if not cfg.tie_word_embeddings:
        names[pre + "lm_head.weight"] = (vocab, hidden)
    for i in range(cfg.num_layers):
        p = f"{pre}model.layers.{i}."
        a, f = p + "self_attn.", p + "feed_forward."
        names |= {p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
                  a + "q_proj.weight": (q_dim, hidden), a + "k_proj.weight": (kv_dim, hidden),
                  a + "v_proj.weight": (kv_dim, hidden), a + "o_proj.weight": (hidden, q_dim)}
        if cfg.attention_bias:
            names |= {a + "q_proj.bias": (q_dim,), a + "k_proj.bias": (kv_dim,), a + "v_proj.bias": (kv_dim,),
                      a + "o_proj.bias": (hidden,)}
        if cfg.is_moe_layer(i):
            names[f + "router.weight"] = (cfg.num_experts, hidden)
            names |= mlp_names(f + "shared_expert.", hidden, cfg.shared_expert_intermediate_size)
        else:
            names |= mlp_names(f, hidden, cfg.dense_intermediate_size)
    return names


def load_llama4_dense_weights(reader, dtype: torch.dtype, progress: str | None = None,
                              device: str | torch.device = "cpu") -> DenseWeights:
    """-> DenseWeights of a Llama 4 text checkpoint (each tensor read in its stored dtype, moved and cast once)."""
    cfg = reader.config
    raw = reader.read_many(llama4_dense_tensor_names(cfg), progress=progress)
    # aligned: a few-row product's bits depend on where its weight starts (experts/reproducible.py)
    t = {k: aligned(raw.pop(k).to(device=device, dtype=dtype)) for k in list(raw)}

    pre = cfg.weight_prefix
    layers = []
    for i in range(cfg.num_layers):
        p = f"{pre}model.layers.{i}."
        a, f = p + "self_attn.", p + "feed_forward."
        attention = AttentionWeights(
            q=t[a + "q_proj.weight"], k=t[a + "k_proj.weight"], v=t[a + "v_proj.weight"], o=t[a + "o_proj.weight"],
            q_bias=t.get(a + "q_proj.bias"), k_bias=t.get(a + "k_proj.bias"), v_bias=t.get(a + "v_proj.bias"),
            o_bias=t.get(a + "o_proj.bias"),
        )
        layer = LayerWeights(input_norm=t[p + "input_layernorm.weight"],
                             post_attention_norm=t[p + "post_attention_layernorm.weight"], attention=attention)
        if cfg.is_moe_layer(i):
            layer.router = t[f + "router.weight"]  # [E, H], model dtype
            layer.shared_expert = gated_mlp(t, f + "shared_expert.")  # ungated: added to the routed experts' output
        else:
            layer.dense_mlp = gated_mlp(t, f)
        layers.append(layer)
    embed = t[pre + "model.embed_tokens.weight"]
    return DenseWeights(embed=embed, layers=layers, final_norm=t[pre + "model.norm.weight"],
                        lm_head=embed if cfg.tie_word_embeddings else t[pre + "lm_head.weight"])
