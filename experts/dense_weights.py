"""The router's weights (everything but the routed experts) as dataclasses, shared by the family loaders.

weights.py (the common families) and weights_deepseek.py (DeepSeek-V2/V3, GLM-4.5) both build these; keeping them
here lets weights.py look the DeepSeek loader up in a family table without the two modules importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .ffn import GatedMLPWeights


@dataclass
class AttentionWeights:
    q: torch.Tensor  # [nh*D, H]
    k: torch.Tensor  # [kvh*D, H]
    v: torch.Tensor  # [kvh*D, H]
    o: torch.Tensor  # [H, nh*D]
    q_bias: torch.Tensor | None = None
    k_bias: torch.Tensor | None = None
    v_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None  # OLMoE: [nh*D]; Qwen3-MoE (per head): [D]
    k_norm: torch.Tensor | None = None  # OLMoE: [kvh*D]; Qwen3-MoE (per head): [D]
    o_bias: torch.Tensor | None = None  # gpt-oss: [H]
    sinks: torch.Tensor | None = None  # gpt-oss: [nh] per-head extra logit in the softmax


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [H]
    post_attention_norm: torch.Tensor  # [H]
    attention: AttentionWeights
    router: torch.Tensor | None = None  # [E, H] gate of an MoE layer
    router_bias: torch.Tensor | None = None  # gpt-oss: [E]
    dense_mlp: GatedMLPWeights | None = None  # Qwen2-MoE mlp_only layers
    shared_expert: GatedMLPWeights | None = None  # Qwen2-MoE
    shared_expert_gate: torch.Tensor | None = None  # [1, H]
    router_correction_bias: torch.Tensor | None = None  # [E] DeepSeek-V3 / GLM-4.5 e_score_correction_bias


@dataclass
class DenseWeights:
    """Everything but the routed experts: what the router holds."""

    embed: torch.Tensor  # [V, H]
    layers: list[LayerWeights] = field(default_factory=list)
    final_norm: torch.Tensor | None = None  # [H]
    lm_head: torch.Tensor | None = None  # [V, H]


def mlp_names(prefix: str, hidden: int, inter: int) -> dict[str, tuple[int, int]]:
    """A gated MLP's (dense layer, shared expert) on-disk names -> expected shapes, as every family names them."""
    return {
        prefix + "gate_proj.weight": (inter, hidden),
        prefix + "up_proj.weight": (inter, hidden),
        prefix + "down_proj.weight": (hidden, inter),
    }


def gated_mlp(t: dict[str, torch.Tensor], prefix: str) -> GatedMLPWeights:
    """The gated MLP whose gate_proj / up_proj / down_proj weights sit under `prefix` in a loaded tensor map (the
    layout every family's dense MLPs and shared experts use; mlp_names lists the same three)."""
    return GatedMLPWeights.from_parts(t[prefix + "gate_proj.weight"], t[prefix + "up_proj.weight"],
                                      t[prefix + "down_proj.weight"])
