"""config.json parsing for Kimi-Linear (`kimi_linear`, transformers' KimiLinearForCausalLM; moonshotai's
Kimi-Linear-48B-A3B).

A hybrid: `layer_types` marks each layer `linear_attention` (Kimi Delta Attention, KDA: a gated delta rule whose decay
is per key channel, from a low-rank forget gate; separate q/k/v causal conv1d; a low-rank sigmoid output gate;
experts/kda.py) or `full_attention` (DeepSeek's Multi-head Latent Attention without RoPE: the shared key part is not
rotated, softmax scale (d_nope + d_rope)^-0.5; experts/mla_attention.py). MoE: DeepSeek-V3's router (sigmoid scores,
a correction bias that only ranks, group-limited top-k, renormalised, scaled by routed_scaling_factor), ungated shared
experts; the first `first_k_dense_replace` layers (or `mlp_layer_types` "dense") are a dense MLP.

The published config.json keeps the KDA settings in `linear_attn_config` (`kda_layers` / `full_attn_layers`
1-indexed, `head_dim`, `num_heads`, `short_conv_kernel_size`) and names several keys as transformers' attribute_map
does (`num_experts`, `num_experts_per_token`, `num_shared_experts`, `moe_renormalize`, `num_expert_group`,
`model_max_length`); transformers' own save writes those names too. Both spellings are read, as are the published
`moe_layer_freq` (Moonshot's code: MoE where i >= first_k_dense_replace and i % freq == 0) and `use_grouped_topk`.
Refused, naming the key: layer types other than these two, `mla_use_nope` false, a router activation other than
sigmoid, an expert count that does not split into the groups.
"""

from __future__ import annotations

from .config_qwen3_next import GatedDeltaDims
from .errors import CheckpointError

ARCHITECTURES = {"KimiLinearForCausalLM": "kimi_linear"}
MODEL_TYPES = {"kimi_linear": "kimi_linear"}
FAMILIES = ("kimi_linear",)
# transformers' KimiLinearConfig.attribute_map: the name a checkpoint may use -> the one read here
ALIASES = {"model_max_length": "max_position_embeddings", "moe_renormalize": "norm_topk_prob",
           "num_expert_group": "n_group", "num_experts": "num_local_experts",
           "num_experts_per_token": "num_experts_per_tok", "num_shared_experts": "n_shared_experts"}
# transformers' KimiLinearConfig defaults (Kimi-Linear-48B-A3B), for keys a config may leave out
DEFAULTS = dict(max_position_embeddings=1048576, num_experts_per_tok=8, num_local_experts=256, n_shared_experts=1,
                n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.446, kv_lora_rank=512,
                qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, moe_intermediate_size=1024,
                intermediate_size=9216, rms_norm_eps=1e-5, linear_head_dim=128, linear_num_heads=32,
                linear_conv_kernel_dim=4)


def normalise(raw: dict, source: str) -> dict:
    """The config with attribute_map names mapped onto the common ones and transformers' defaults filled in."""
    out = dict(raw)
    for alias, key in ALIASES.items():
        if alias in raw and raw[alias] is not None and out.get(key) is None:
            out[key] = raw[alias]
    for key, value in DEFAULTS.items():
        if out.get(key) is None:
            out[key] = value
    return out


def _positive(value, key: str, source: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise CheckpointError(f"{source}: key '{key}' must be a positive integer, got {value!r}")
    return value


def _layer_types(raw: dict, layers: int, source: str) -> list[str]:
    """Per layer "linear_attention" | "full_attention": `layer_types`, else linear_attn_config's 1-indexed lists,
    else transformers' default (every 4th layer from layer 4 full)."""
    types = raw.get("layer_types")
    lac = raw.get("linear_attn_config") or {}
    if types is None and "full_attn_layers" in lac and "kda_layers" in lac:
        types = [None] * layers
        for key, kind in (("full_attn_layers", "full_attention"), ("kda_layers", "linear_attention")):
            for n in lac[key]:
                if not isinstance(n, int) or not 1 <= n <= layers:
                    raise CheckpointError(f"{source}: key 'linear_attn_config.{key}' holds {n!r}, not a layer "
                                          f"number in 1..{layers}")
                types[n - 1] = kind
    if types is None:
        types = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(layers)]
    if not isinstance(types, list) or len(types) < layers:
        raise CheckpointError(f"{source}: key 'layer_types' must list num_hidden_layers={layers} entries")
    types = types[:layers]
    if set(types) - {"linear_attention", "full_attention"}:
        raise CheckpointError(f"{source}: key 'layer_types'={sorted(set(map(str, types)))} is not supported for "
                              "kimi_linear (supported: 'linear_attention', 'full_attention')")
    return types


def kimi_linear_fields(raw: dict, common: dict, need, source: str) -> dict:
    """The MoEModelConfig keyword arguments of a Kimi-Linear config (beyond `common`)."""
    layers, heads = common["num_layers"], common["num_heads"]
    types = _layer_types(raw, layers, source)
    lac = raw.get("linear_attn_config") or {}
    head_dim = _positive(lac.get("head_dim", raw["linear_head_dim"]), "linear_head_dim", source)
    dims = GatedDeltaDims(  # KDA: as many key as value heads, keys and values of one width
        num_k_heads=_positive(lac.get("num_heads", raw["linear_num_heads"]), "linear_num_heads", source),
        num_v_heads=_positive(lac.get("num_heads", raw["linear_num_heads"]), "linear_num_heads", source),
        k_head_dim=head_dim, v_head_dim=head_dim,
        conv_kernel=_positive(lac.get("short_conv_kernel_size", raw["linear_conv_kernel_dim"]),
                              "linear_conv_kernel_dim", source),
        fused_projections=False,
    )
    act = raw.get("moe_router_activation_func", "sigmoid")
    if act != "sigmoid":
        raise CheckpointError(f"{source}: key 'moe_router_activation_func'={act!r} is not supported for kimi_linear "
                              "(supported: 'sigmoid')")
    if raw.get("mla_use_nope") is False:  # transformers' KimiLinearAttention is always NoPE
        raise CheckpointError(f"{source}: key 'mla_use_nope'=false (MLA with RoPE) is not supported for kimi_linear")
    mlp_types = raw.get("mlp_layer_types")
    if mlp_types is None:  # Moonshot's modeling_kimi.py rule (transformers reads first_k_dense_replace alone)
        first_dense = int(raw.get("first_k_dense_replace", 1) or 0)
        freq = _positive(raw.get("moe_layer_freq", 1), "moe_layer_freq", source)
        mlp_types = ["sparse" if i >= first_dense and i % freq == 0 else "dense" for i in range(layers)]
    if not isinstance(mlp_types, list) or len(mlp_types) < layers or set(mlp_types[:layers]) - {"dense", "sparse"}:
        raise CheckpointError(f"{source}: key 'mlp_layer_types' must list 'dense' or 'sparse' for each of the "
                              f"{layers} layers")
    experts = _positive(raw["num_local_experts"], "num_experts", source)
    n_group = _positive(raw["n_group"], "num_expert_group", source)
    topk_group = _positive(raw["topk_group"], "topk_group", source)
    if raw.get("use_grouped_topk") is False:  # the published config's switch: plain top-k over all experts
        n_group = topk_group = 1
    if experts % n_group or topk_group > n_group:
        raise CheckpointError(f"{source}: num_experts={experts} must split into num_expert_group={n_group} equal "
                              f"groups, with 1 <= topk_group={topk_group} <= num_expert_group")
    if topk_group * (experts // n_group) < common["top_k"]:
        raise CheckpointError(f"{source}: topk_group={topk_group} groups of {experts // n_group} experts hold "
                              f"fewer than num_experts_per_token={common['top_k']}")
    moe_inter = _positive(raw["moe_intermediate_size"], "moe_intermediate_size", source)
    rope_dim = _positive(raw["qk_rope_head_dim"], "qk_rope_head_dim", source)
    nope_dim = _positive(raw["qk_nope_head_dim"], "qk_nope_head_dim", source)
    q_lora = raw.get("q_lora_rank")
    return dict(
        num_experts=experts,
        expert_intermediate_size=moe_inter,
        norm_topk_prob=bool(raw["norm_topk_prob"]),
        rms_norm_eps=float(raw["rms_norm_eps"]),
        max_position_embeddings=int(raw["max_position_embeddings"]),
        rope_theta=10000.0,  # no layer rotates; the decoder's (unused) tables need a base
        dense_intermediate_size=_positive(raw["intermediate_size"], "intermediate_size", source),
        shared_expert_intermediate_size=moe_inter * int(raw["n_shared_experts"] or 0),
        shared_expert_gated=False,
        moe_layers=tuple(i for i, t in enumerate(mlp_types[:layers]) if t == "sparse"),
        router_kind="sigmoid_grouped", topk_method="group_limited", router_correction_bias=True,
        n_group=n_group, topk_group=topk_group, routed_scaling_factor=float(raw["routed_scaling_factor"]),
        attention_kind="mla", mla_rope=False,
        num_kv_heads=heads,
        head_dim=nope_dim + rope_dim,
        q_lora_rank=int(q_lora) if q_lora else None,
        kv_lora_rank=_positive(raw["kv_lora_rank"], "kv_lora_rank", source),
        qk_nope_head_dim=nope_dim, qk_rope_head_dim=rope_dim,
        v_head_dim=_positive(raw["v_head_dim"], "v_head_dim", source),
        rotary_dim=rope_dim,
        attention_bias=bool(raw.get("attention_bias", False)),
        linear_layers=tuple(i for i, t in enumerate(types) if t == "linear_attention"),
        gated_delta=dims,
    )
