"""On-disk names and the dense loader of LongCat-Flash checkpoints (LongcatFlashForCausalLM).

Logical layer L holds two sublayers j = 0, 1 (our decoder layers 2L + j, experts/config_longcat_flash.py):
`model.layers.L.input_layernorm.j`, `post_attention_layernorm.j`, the MLA `self_attn.j.*` (q_a_proj, q_a_layernorm,
q_b_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj) and the dense `mlps.j.{gate,up,down}_proj`; and
one MoE, `mlp.router.classifier.weight` [E + Z, H] with `mlp.router.e_score_correction_bias` [E + Z] (rows E.. are
the Z identity experts). Routed experts: `mlp.experts.E.{gate,up,down}_proj` per expert, or stacked
`mlp.experts.gate_up_proj` [E, 2I, H] (transformers <= 5.24 wrote [E + Z, 2I, H], gate/up rows for the identity
experts too, never read; both load, experts/weights.py FUSED_IDENTITY_ROWS) and `down_proj` [E, H, I]. The MTP
layers (`model.mtp.*`) are never named.
"""

from __future__ import annotations

import torch

from .config import MoEModelConfig
from .dense_weights import DenseWeights, LayerWeights, gated_mlp, mlp_names
from .reproducible import aligned
from .weights_deepseek import MLAWeights, _attention_names

FAMILIES = ("longcat_flash",)


def longcat_prefix(layer: int) -> str:
    """Decoder (sub)layer -> its logical layer's prefix."""
    return f"model.layers.{layer // 2}."


def longcat_dense_tensor_names(cfg: MoEModelConfig, stacked: bool = False) -> dict[str, tuple[int, ...]]:
    """Every non-expert tensor of a LongCat-Flash model: name -> expected shape."""
    hidden, vocab = cfg.hidden_size, cfg.vocab_size
    names: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    if not cfg.tie_word_embeddings:
        names["lm_head.weight"] = (vocab, hidden)
    for i in range(cfg.num_layers):
        p, j = longcat_prefix(i), i % 2
        names |= {f"{p}input_layernorm.{j}.weight": (hidden,), f"{p}post_attention_layernorm.{j}.weight": (hidden,)}
        names |= _attention_names(cfg, f"{p}self_attn.{j}.")
        names |= mlp_names(f"{p}mlps.{j}.", hidden, cfg.dense_intermediate_size)
        if cfg.is_moe_layer(i):
            names |= {p + "mlp.router.classifier.weight": (cfg.router_width, hidden),
                      p + "mlp.router.e_score_correction_bias": (cfg.router_width,)}
    return names


def load_longcat_dense_weights(reader, dtype: torch.dtype, progress: str | None = None,
                               device: str | torch.device = "cpu") -> DenseWeights:
    """-> DenseWeights of a LongCat-Flash checkpoint. The router's classifier stays float32 (transformers keeps it
    so and scores in float32); its correction bias is held in the model dtype, as transformers holds the buffer,
    then widened."""
    cfg = reader.config
    raw = reader.read_many(longcat_dense_tensor_names(cfg), progress=progress)
    t = {}
    for name in list(raw):
        value = raw.pop(name)
        if name.endswith("classifier.weight"):
            value = value.to(device=device, dtype=torch.float32)
        elif name.endswith("e_score_correction_bias"):
            value = value.to(device=device, dtype=dtype).float()
        else:
            value = value.to(device=device, dtype=dtype)
        t[name] = aligned(value)  # a few-row product's bits depend on where its weight starts

    layers = []
    for i in range(cfg.num_layers):
        p, j = longcat_prefix(i), i % 2
        a = f"{p}self_attn.{j}."
        attention = MLAWeights(
            kv_a=t[a + "kv_a_proj_with_mqa.weight"], kv_a_norm=t[a + "kv_a_layernorm.weight"],
            kv_b=t[a + "kv_b_proj.weight"], o=t[a + "o_proj.weight"], q_a=t[a + "q_a_proj.weight"],
            q_a_norm=t[a + "q_a_layernorm.weight"], q_b=t[a + "q_b_proj.weight"], q_a_bias=t.get(a + "q_a_proj.bias"),
            kv_a_bias=t.get(a + "kv_a_proj_with_mqa.bias"), o_bias=t.get(a + "o_proj.bias"),
        )
        layer = LayerWeights(input_norm=t[f"{p}input_layernorm.{j}.weight"],
                             post_attention_norm=t[f"{p}post_attention_layernorm.{j}.weight"], attention=attention,
                             dense_mlp=gated_mlp(t, f"{p}mlps.{j}."))
        if cfg.is_moe_layer(i):
            layer.router = t[p + "mlp.router.classifier.weight"]  # [E + Z, H] float32
            layer.router_correction_bias = t[p + "mlp.router.e_score_correction_bias"]  # [E + Z]
        layers.append(layer)
    embed = t["model.embed_tokens.weight"]
    return DenseWeights(embed=embed, layers=layers, final_norm=t["model.norm.weight"],
                        lm_head=embed if cfg.tie_word_embeddings else t["lm_head.weight"])
