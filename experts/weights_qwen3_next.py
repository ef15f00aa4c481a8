"""On-disk names and the dense loader of Qwen3-Next and Qwen3.5-MoE checkpoints (the text model under
`cfg.weight_prefix`: "model." or the VL wrapper's "model.language_model."; `lm_head.weight` unprefixed).

Per layer: `input_layernorm`, `post_attention_layernorm` (zero-centred: x * (1 + w)), then either
- `linear_attn.` (Gated DeltaNet): Qwen3-Next `in_proj_qkvz` [nk * (2dk + 2r·dv), H] and `in_proj_ba` [nk * 2r, H],
  packed per key head (r = nv / nk value heads per key head: q, k, v, z rows of head 0, then of head 1, ..), which the
  loader unpacks into Qwen3.5's four projections `in_proj_qkv` [2nk·dk + nv·dv, H] (all q rows, all k, all v),
  `in_proj_z` [nv·dv, H], `in_proj_b` / `in_proj_a` [nv, H]; `conv1d.weight` [conv_dim, 1, K], `dt_bias` [nv],
  `A_log` [nv], `norm.weight` [dv] (a plain-weight gated RMSNorm), `out_proj` [H, nv·dv]; or
- `self_attn.` (gated full attention): `q_proj` [nh * 2D, H] (per head D query rows then D gate rows), `k_proj`,
  `v_proj`, `o_proj`, per-head `q_norm` / `k_norm` [D] (zero-centred);
and `mlp.` : `gate.weight` [E, H], `shared_expert.{gate,up,down}_proj`, `shared_expert_gate.weight` [1, H] and the
routed experts (experts/weights.py: per-expert `mlp.experts.E.*_proj` or stacked `mlp.experts.gate_up_proj`), or a
dense MLP (Qwen3-Next's `mlp_only_layers`). `mtp.*` and `model.visual.*` are never named.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import MoEModelConfig
from .dense_weights import AttentionWeights, DenseWeights, LayerWeights, gated_mlp, mlp_names
from .reproducible import aligned

FAMILIES = ("qwen3_next", "qwen3_5_moe")


@dataclass
class GatedDeltaWeights:
    """One Gated DeltaNet layer, in Qwen3.5's unpacked layout (F.linear's [out, in])."""

    qkv: torch.Tensor  # [2*nk*dk + nv*dv, H]: q rows, k rows, v rows (the conv's channels in order)
    z: torch.Tensor  # [nv*dv, H] output gate
    b: torch.Tensor  # [nv, H] -> beta = sigmoid(b)
    a: torch.Tensor  # [nv, H] -> decay log = -exp(A_log) * softplus(a + dt_bias)
    conv: torch.Tensor  # [conv_dim, K] depthwise causal conv taps
    dt_bias: torch.Tensor  # [nv]
    A_log: torch.Tensor  # [nv]
    norm: torch.Tensor  # [dv] gated RMSNorm weight (plain, not zero-centred)
    out: torch.Tensor  # [H, nv*dv]


def qwen3_next_expert_prefix(cfg: MoEModelConfig, layer: int) -> str:
    """Where layer `layer` keeps its routed experts (per-expert `E.gate_proj.weight`.., or stacked)."""
    return f"{cfg.weight_prefix}layers.{layer}.mlp.experts."


def qwen3_next_dense_tensor_names(cfg: MoEModelConfig, stacked: bool = False) -> dict[str, tuple[int, ...]]:
    """Every non-expert tensor of a Qwen3-Next / Qwen3.5-MoE text model: name -> expected shape."""
    hidden, vocab, d, pre, g = cfg.hidden_size, cfg.vocab_size, cfg.head_dim, cfg.weight_prefix, cfg.gated_delta
    names: dict[str, tuple[int, ...]] = {pre + "embed_tokens.weight": (vocab, hidden), pre + "norm.weight": (hidden,)}
    if not cfg.tie_word_embeddings:
        names["lm_head.weight"] = (vocab, hidden)
    for i in range(cfg.num_layers):
        p = f"{pre}layers.{i}."
        names |= {p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,)}
        if cfg.is_linear_layer(i):
            la = p + "linear_attn."
            if g.fused_projections:
                names |= {la + "in_proj_qkvz.weight": (2 * g.key_dim + 2 * g.value_dim, hidden),
                          la + "in_proj_ba.weight": (2 * g.num_v_heads, hidden)}
            else:
                names |= {la + "in_proj_qkv.weight": (g.conv_dim, hidden),
                          la + "in_proj_z.weight": (g.value_dim, hidden),
                          la + "in_proj_b.weight": (g.num_v_heads, hidden),
                          la + "in_proj_a.weight": (g.num_v_heads, hidden)}
            names |= {la + "conv1d.weight": (g.conv_dim, 1, g.conv_kernel), la + "dt_bias": (g.num_v_heads,),
                      la + "A_log": (g.num_v_heads,), la + "norm.weight": (g.v_head_dim,),
                      la + "out_proj.weight": (hidden, g.value_dim)}
        else:
            a = p + "self_attn."
            q_dim, kv_dim = cfg.num_heads * d, cfg.num_kv_heads * d
            names |= {a + "q_proj.weight": (2 * q_dim, hidden), a + "k_proj.weight": (kv_dim, hidden),
                      a + "v_proj.weight": (kv_dim, hidden), a + "o_proj.weight": (hidden, q_dim),
                      a + "q_norm.weight": (d,), a + "k_norm.weight": (d,)}
            if cfg.attention_bias:
                names |= {a + "q_proj.bias": (2 * q_dim,), a + "k_proj.bias": (kv_dim,), a + "v_proj.bias": (kv_dim,),
                          a + "o_proj.bias": (hidden,)}
        if cfg.is_moe_layer(i):
            names[p + "mlp.gate.weight"] = (cfg.num_experts, hidden)
            if cfg.shared_expert_intermediate_size > 0:
                names |= mlp_names(p + "mlp.shared_expert.", hidden, cfg.shared_expert_intermediate_size)
                names[p + "mlp.shared_expert_gate.weight"] = (1, hidden)
        else:
            names |= mlp_names(p + "mlp.", hidden, cfg.dense_intermediate_size)
    return names


def unpack_qkvz(cfg: MoEModelConfig, qkvz: torch.Tensor, ba: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Qwen3-Next's per-key-head packing -> (qkv [conv_dim, H], z [nv*dv, H], b [nv, H], a [nv, H]), the rows in
    the order transformers' fix_query_key_value_ordering puts its outputs."""
    g = cfg.gated_delta
    r, hidden = g.num_v_heads // g.num_k_heads, qkvz.shape[-1]
    per_head = qkvz.view(g.num_k_heads, 2 * g.k_head_dim + 2 * r * g.v_head_dim, hidden)
    q, k, v, z = per_head.split([g.k_head_dim, g.k_head_dim, r * g.v_head_dim, r * g.v_head_dim], dim=1)
    qkv = torch.cat([q.reshape(-1, hidden), k.reshape(-1, hidden), v.reshape(-1, hidden)])  # [conv_dim, H]
    b, a = ba.view(g.num_k_heads, 2 * r, hidden).split([r, r], dim=1)
    return qkv.contiguous(), z.reshape(-1, hidden).contiguous(), b.reshape(-1, hidden).contiguous(), \
        a.reshape(-1, hidden).contiguous()


def load_qwen3_next_dense_weights(reader, dtype: torch.dtype, progress: str | None = None,
                                  device: str | torch.device = "cpu") -> DenseWeights:
    """-> DenseWeights of a Qwen3-Next / Qwen3.5-MoE checkpoint (each tensor read in its stored dtype, moved and
    cast once; linear-attention layers carry GatedDeltaWeights in `attention`)."""
    cfg = reader.config
    raw = reader.read_many(qwen3_next_dense_tensor_names(cfg), progress=progress)
    # aligned: a few-row product's bits depend on where its weight starts (experts/reproducible.py)
    t = {k: aligned(raw.pop(k).to(device=device, dtype=dtype)) for k in list(raw)}

    pre = cfg.weight_prefix
    layers = []
    for i in range(cfg.num_layers):
        p = f"{pre}layers.{i}."
        if cfg.is_linear_layer(i):
            la = p + "linear_attn."
            if cfg.gated_delta.fused_projections:
                qkv, z, b, a = (aligned(x) for x in unpack_qkvz(cfg, t[la + "in_proj_qkvz.weight"],
                                                                t[la + "in_proj_ba.weight"]))
            else:
                qkv, z, b, a = (t[la + f"in_proj_{n}.weight"] for n in ("qkv", "z", "b", "a"))
            attention = GatedDeltaWeights(qkv=qkv, z=z, b=b, a=a, conv=t[la + "conv1d.weight"][:, 0].contiguous(),
                                          dt_bias=t[la + "dt_bias"], A_log=t[la + "A_log"],
                                          norm=t[la + "norm.weight"], out=t[la + "out_proj.weight"])
        else:
            a_ = p + "self_attn."
            attention = AttentionWeights(
                q=t[a_ + "q_proj.weight"], k=t[a_ + "k_proj.weight"], v=t[a_ + "v_proj.weight"],
                o=t[a_ + "o_proj.weight"], q_bias=t.get(a_ + "q_proj.bias"), k_bias=t.get(a_ + "k_proj.bias"),
                v_bias=t.get(a_ + "v_proj.bias"), o_bias=t.get(a_ + "o_proj.bias"),
                q_norm=t[a_ + "q_norm.weight"], k_norm=t[a_ + "k_norm.weight"])
        layer = LayerWeights(input_norm=t[p + "input_layernorm.weight"],
                             post_attention_norm=t[p + "post_attention_layernorm.weight"], attention=attention)
        if cfg.is_moe_layer(i):
            layer.router = t[p + "mlp.gate.weight"]  # [E, H], model dtype (a plain linear in transformers)
            if cfg.shared_expert_intermediate_size > 0:
                layer.shared_expert = gated_mlp(t, p + "mlp.shared_expert.")
                layer.shared_expert_gate = t[p + "mlp.shared_expert_gate.weight"]  # [1, H]: sigmoid gate
        else:
            layer.dense_mlp = gated_mlp(t, p + "mlp.")
        layers.append(layer)
    embed = t[pre + "embed_tokens.weight"]
    return DenseWeights(embed=embed, layers=layers, final_norm=t[pre + "norm.weight"],
                        lm_head=embed if cfg.tie_word_embeddings else t["lm_head.weight"])
