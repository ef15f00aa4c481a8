"""config.json parsing for MiMo-V2-Flash (`mimo_v2_flash`, transformers' MiMoV2FlashForCausalLM).

Hybrid attention: `layer_types` marks each layer "full_attention" or "sliding_attention" (published: layer 0 and
every 6th full). Sliding layers attend to the last `sliding_window` positions (the query included), have **twice**
the KV heads of the full layers (so the KV cache's shape differs by layer), a learned per-head sink logit
(`self_attn.attention_sink_bias`) and their own RoPE base; both kinds rotate the first
int(head_dim * partial_rotary_factor) dims of a head. Values are `v_head_dim` wide (≠ the q/k `head_dim`) and scaled
by `attention_value_scale` before they are cached. `mlp_layer_types` marks each layer "dense" or "sparse". The router
is DeepSeek-V3's (sigmoid scores, a selection-only correction bias, `n_group` / `topk_group`, renormalised,
× `routed_scaling_factor`; gate and bias float32), no shared expert. The MTP layers (`model.mtp.*`) are not read.

Block-scaled FP8 files (`quantization_config.quant_method: fp8`) are dequantised on load, as DeepSeek's are.
Refused, naming the key: RoPE types other than default, per-type `partial_rotary_factor`s that differ, layer types
other than full / sliding attention, mlp types other than dense / sparse.
"""

from __future__ import annotations

from .errors import CheckpointError

ARCHITECTURES = {"MiMoV2FlashForCausalLM": "mimo_v2_flash"}
MODEL_TYPES = {"mimo_v2_flash": "mimo_v2_flash"}
_DEFAULT_ROPE = {"full_attention": {"rope_theta": 5_000_000.0, "partial_rotary_factor": 0.334},
                 "sliding_attention": {"rope_theta": 10_000.0, "partial_rotary_factor": 0.334}}  # transformers'


def normalise(raw: dict, source: str) -> dict:
    """The common key names config_from_dict reads (`num_experts` from `n_routed_experts`)."""
    raw = dict(raw)
    if raw.get("n_routed_experts") is not None:
        raw.setdefault("num_experts", raw["n_routed_experts"])
    return raw


def _layer_types(raw: dict, key: str, allowed: tuple[str, str], default: list[str], layers: int,
                 source: str) -> list[str]:
    value = raw.get(key) or default
    if not isinstance(value, list) or len(value) < layers:
        raise CheckpointError(f"{source}: key '{key}' must list at least num_hidden_layers={layers} entries")
    if set(value[:layers]) - set(allowed):
        raise CheckpointError(f"{source}: key '{key}'={sorted(set(value))} is not supported for mimo_v2_flash "
                              f"(supported: {', '.join(repr(a) for a in allowed)})")
    return value[:layers]


def _rope(raw: dict, head_dim: int, source: str) -> tuple[float, float, int]:
    """-> (full layers' theta, sliding layers' theta, rotary dims)."""
    params = raw.get("rope_parameters") or _DEFAULT_ROPE
    if "full_attention" not in params or "sliding_attention" not in params:
        params = {"full_attention": params, "sliding_attention": params}  # one set for both kinds
    partials = set()
    thetas = []
    for kind in ("full_attention", "sliding_attention"):
        p = params[kind] or {}
        rope_type = p.get("rope_type") or p.get("type") or "default"
        if rope_type != "default":
            raise CheckpointError(f"{source}: key 'rope_parameters.{kind}.rope_type'={rope_type!r} is not supported "
                                  "for mimo_v2_flash (supported: 'default')")
        thetas.append(float(p.get("rope_theta") or _DEFAULT_ROPE[kind]["rope_theta"]))
        partials.add(float(p.get("partial_rotary_factor", 0.334)))
    if len(partials) != 1:
        raise CheckpointError(f"{source}: key 'rope_parameters.partial_rotary_factor' differs between full and "
                              f"sliding layers ({sorted(partials)}); one value is supported")
    rotary = int(head_dim * partials.pop())  # transformers' compute_default_rope_parameters
    if not 0 < rotary <= head_dim or rotary % 2:
        raise CheckpointError(f"{source}: key 'rope_parameters.partial_rotary_factor' gives {rotary} rotary dims; "
                              f"they must be even and in 1..head_dim={head_dim}")
    return thetas[0], thetas[1], rotary


def mimo_v2_flash_fields(raw: dict, common: dict, need, source: str) -> dict:
    """The MoEModelConfig keyword arguments of a MiMo-V2-Flash config (beyond `common`)."""
    layers, head_dim = common["num_layers"], common["head_dim"]
    types = _layer_types(raw, "layer_types", ("full_attention", "sliding_attention"),
                         ["full_attention" if i == 0 or not (i + 1) % 6 else "sliding_attention"
                          for i in range(layers)], layers, source)
    mlp = _layer_types(raw, "mlp_layer_types", ("dense", "sparse"), ["dense"] + ["sparse"] * (layers - 1), layers,
                       source)
    window = raw.get("sliding_window", 129)
    if raw.get("sliding_window_size") is not None:  # the original spelling: previous tokens, the query not counted
        window = int(raw["sliding_window_size"]) + 1
    sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    if sliding and (not isinstance(window, int) or window <= 0):
        raise CheckpointError(f"{source}: key 'sliding_window'={window!r} must be a positive integer")
    full_theta, sliding_theta, rotary = _rope(raw, head_dim, source)
    n_group, topk_group = int(raw.get("n_group") or 1), int(raw.get("topk_group") or 1)
    experts = need("num_experts")
    if experts % n_group or not 0 < topk_group <= n_group:
        raise CheckpointError(f"{source}: key 'n_group'={n_group} / 'topk_group'={topk_group} do not divide "
                              f"n_routed_experts={experts} into groups")
    moe_layers = tuple(i for i, t in enumerate(mlp) if t == "sparse")
    bias = bool(raw.get("attention_bias", False))
    return dict(
        num_experts=experts,
        expert_intermediate_size=need("moe_intermediate_size"),
        norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
        rope_theta=full_theta,
        sliding_rope_theta=sliding_theta,
        rotary_dim=rotary,
        v_head_dim=int(raw.get("v_head_dim") or head_dim),
        attention_bias=bias,
        sliding_window=window if sliding else None,
        sliding_layers=sliding,
        sliding_kv_heads=2 * common["num_kv_heads"],
        attention_value_scale=float(raw["attention_value_scale"]) if raw.get("attention_value_scale") is not None
        else 1.0,
        attention_sinks=bool(sliding),  # on the sliding layers only
        dense_intermediate_size=need("intermediate_size") if len(moe_layers) < layers else 0,
        router_kind="sigmoid_grouped",
        topk_method="group_limited",
        n_group=n_group,
        topk_group=topk_group,
        routed_scaling_factor=float(raw.get("routed_scaling_factor") or 1.0),
        router_correction_bias=True,
        moe_layers=moe_layers,
    )
