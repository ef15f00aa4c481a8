"""config.json parsing for Hunyuan-A13B (`hunyuan_v1_moe`, transformers' HunYuanMoEV1ForCausalLM).

Every layer is GQA attention + MoE with one ungated shared MLP (`mlp.shared_mlp`, `intermediate_size` wide, as are
the experts). Quirks: the per-head q/k RMSNorm (`query_layernorm` / `key_layernorm`, head_dim weights) runs *after*
RoPE; RoPE is NTK-alpha scaled (published as `rope_scaling: {type: dynamic, alpha: A}`: the base becomes
theta * A ** (d / (d - 2)), fixed, not length-dependent); the router (`mlp.gate.wg`, float32) is a softmax top-k,
renormalised. `moe_topk` and `num_experts` may be per-layer lists: lists whose entries differ are refused (the
experts are served one shape per model).
"""

from __future__ import annotations

from .errors import CheckpointError

ARCHITECTURES = {"HunYuanMoEV1ForCausalLM": "hunyuan_v1_moe"}
MODEL_TYPES = {"hunyuan_v1_moe": "hunyuan_v1_moe"}


def _one_value(raw: dict, key: str, source: str):
    value = raw.get(key)
    if isinstance(value, list):
        if not value or len(set(value)) != 1:
            raise CheckpointError(f"{source}: key '{key}'={value!r}: per-layer values that differ between layers "
                                  "are not supported for hunyuan_v1_moe (one value for every layer is)")
        return value[0]
    return value


def normalise(raw: dict, source: str) -> dict:
    """Hunyuan's own key names (and per-layer lists of one value) -> the common ones config_from_dict reads."""
    raw = dict(raw)
    top_k = _one_value(raw, "moe_topk", source)
    if "num_experts_per_tok" not in raw and top_k is not None:
        raw["num_experts_per_tok"] = top_k
    raw["num_experts"] = _one_value(raw, "num_experts", source)
    return raw


def hunyuan_rope_theta(raw: dict, head_dim: int, source: str) -> float:
    """The RoPE base: rope_theta, NTK-alpha stretched when the config asks for it."""
    params = dict(raw.get("rope_scaling") or {}) | dict(raw.get("rope_parameters") or {})
    theta = float(params.get("rope_theta") or raw.get("rope_theta") or 10000.0)
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type == "default":
        return theta
    alpha = params.get("alpha")
    if rope_type == "dynamic" and alpha:
        # transformers' HunYuanDenseV1RotaryEmbedding.compute_ntk_alpha_rope_parameters, the same float expression
        return theta * float(alpha) ** (head_dim / (head_dim - 2))
    raise CheckpointError(f"{source}: key 'rope_parameters.rope_type'={rope_type!r} is not supported for "
                          "hunyuan_v1_moe (supported: 'default', 'dynamic' with 'alpha' (NTK-alpha))")


def hunyuan_v1_moe_fields(raw: dict, common: dict, need, source: str) -> dict:
    """The MoEModelConfig keyword arguments of a Hunyuan-A13B config (beyond `common`)."""
    inter = need("intermediate_size")
    moe_inter = _one_value(raw, "moe_intermediate_size", source)
    if moe_inter is not None and moe_inter != inter:
        raise CheckpointError(f"{source}: key 'moe_intermediate_size'={moe_inter} differs from intermediate_size="
                              f"{inter}; transformers' hunyuan_v1_moe sizes experts by intermediate_size")
    shared = _one_value(raw, "num_shared_expert", source)
    if shared is not None and shared != 1:
        raise CheckpointError(f"{source}: key 'num_shared_expert'={shared} is not supported for hunyuan_v1_moe "
                              "(one shared MLP per layer is)")
    bias = bool(raw.get("attention_bias", False))
    return dict(
        num_experts=need("num_experts"),
        expert_intermediate_size=inter,
        norm_topk_prob=True,
        rope_theta=hunyuan_rope_theta(raw, common["head_dim"], source),
        qk_norm_per_head=True,
        qk_norm_after_rope=True,
        attention_bias=bias,
        attention_out_bias=bias,
        shared_expert_intermediate_size=inter,
        shared_expert_gated=False,
        moe_layers=tuple(range(common["num_layers"])),
    )
