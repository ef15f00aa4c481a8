"""config.json parsing for MiniMax-M2 (`minimax_m2`, transformers' MiniMaxM2ForCausalLM).

Every layer is GQA attention + a sparse MoE block, no shared expert. Quirks: the q/k RMSNorm runs over the whole
projected q (all heads, `num_attention_heads * head_dim` weights) and k before they are split into heads (our
`qk_norm`, as OLMoE); RoPE rotates only the first `rotary_dim` dims of each head (the published config's legacy
`rotary_dim`, or `partial_rotary_factor`); the router is a sigmoid whose experts are chosen by score +
`e_score_correction_bias` but weighted by the score alone, renormalised over the top-k (DeepSeek-V3's router with one
group, experts/gating.py `route_sigmoid_grouped`). The gate runs in the model dtype, the sigmoid in float32. The
published checkpoint is block-scaled FP8 (`quantization_config.quant_method: fp8`, experts/fp8.py).
"""

from __future__ import annotations

from .config_deepseek import rope_settings
from .errors import CheckpointError

ARCHITECTURES = {"MiniMaxM2ForCausalLM": "minimax_m2"}
MODEL_TYPES = {"minimax_m2": "minimax_m2"}


def normalise(raw: dict, source: str) -> dict:
    """The keys config_from_dict reads in common, under their common names."""
    return raw


def minimax_m2_fields(raw: dict, common: dict, need, source: str) -> dict:
    """The MoEModelConfig keyword arguments of a MiniMax-M2 config (beyond `common`)."""
    head_dim = common["head_dim"]
    # What transformers' MiniMaxM2 cannot express: refused rather than served differently from the checkpoint.
    if raw.get("scoring_func", "sigmoid") != "sigmoid":
        raise CheckpointError(f"{source}: key 'scoring_func'={raw['scoring_func']!r} is not supported for "
                              "minimax_m2 (supported: 'sigmoid')")
    if raw.get("qk_norm_type", "per_layer") != "per_layer":
        raise CheckpointError(f"{source}: key 'qk_norm_type'={raw['qk_norm_type']!r} is not supported for "
                              "minimax_m2 (supported: 'per_layer', one RMSNorm over all heads)")
    if raw.get("use_qk_norm") is False:
        raise CheckpointError(f"{source}: key 'use_qk_norm'=false is not supported for minimax_m2")
    if int(raw.get("shared_intermediate_size") or 0) > 0:
        raise CheckpointError(f"{source}: key 'shared_intermediate_size'={raw['shared_intermediate_size']} is not "
                              "supported for minimax_m2 (no shared expert)")
    kinds = set(raw.get("attn_type_list") or [1])
    if kinds != {1}:
        raise CheckpointError(f"{source}: key 'attn_type_list' has lightning-attention layers (0); only full "
                              "attention (1) is supported for minimax_m2")
    theta, partial, yarn = rope_settings(raw, source)
    rotary = raw.get("rotary_dim")
    rotary = int(rotary) if rotary else int(head_dim * partial)
    if not 0 < rotary <= head_dim or rotary % 2:
        raise CheckpointError(f"{source}: key 'rotary_dim'={rotary} must be even and in 1..head_dim={head_dim}")
    experts = raw.get("num_local_experts") or need("num_experts")
    return dict(
        num_experts=experts,
        expert_intermediate_size=need("intermediate_size"),
        norm_topk_prob=True,
        qk_norm=True,
        rotary_dim=rotary,
        rope_theta=theta,
        yarn=yarn,
        router_kind="sigmoid_grouped",
        topk_method="group_limited",  # one group: plain top-k of score + bias
        router_correction_bias=True,
        router_in_model_dtype=True,
        moe_layers=tuple(range(common["num_layers"])),
    )
