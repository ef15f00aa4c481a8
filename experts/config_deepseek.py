"""config.json parsing for the DeepSeek-V2/V3/V3.2, GLM-4.5 and GLM-5 families (hooked into `config.config_from_dict`).

All route with DeepSeek's routers (experts/gating.py: `route_deepseek_v2`, `route_sigmoid_grouped`), add ungated
shared experts (`n_shared_experts` x `moe_intermediate_size`), and keep the first `first_k_dense_replace` layers
dense. DeepSeek uses Multi-head Latent Attention (experts/mla_attention.py); GLM-4.5 uses GQA with q/k/v bias,
partial RoPE and optional per-head q/k norm. DeepSeek-V3.2 (`deepseek_v32`) and GLM-5 (`glm_moe_dsa`) are MLA (always
with q_lora_rank) plus DeepSeek Sparse Attention: a lightning indexer picks each query's top-k past tokens
(experts/dsa_indexer.py). Layers numbered `num_hidden_layers` and up (the multi-token-prediction modules of V3,
V3.2, GLM-4.5 and GLM-5) are never named by the loaders, so a checkpoint that carries them loads unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import CheckpointError

ARCHITECTURES = {
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "Glm4MoeForCausalLM": "glm4_moe",
    "DeepseekV32ForCausalLM": "deepseek_v32",
    "GlmMoeDsaForCausalLM": "glm_moe_dsa",
}
MODEL_TYPES = {"deepseek_v2": "deepseek_v2", "deepseek_v3": "deepseek_v3", "glm4_moe": "glm4_moe",
               "deepseek_v32": "deepseek_v32", "glm_moe_dsa": "glm_moe_dsa"}
FAMILIES = tuple(MODEL_TYPES.values())
MLA_FAMILIES = ("deepseek_v2", "deepseek_v3", "deepseek_v32", "glm_moe_dsa")
DSA_FAMILIES = ("deepseek_v32", "glm_moe_dsa")  # MLA with DeepSeek Sparse Attention (experts/dsa_indexer.py)


@dataclass(frozen=True)
class YarnScaling:
    """RoPE `rope_type: yarn` parameters, as transformers reads them (modeling_rope_utils._compute_yarn_parameters)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None  # scales cos/sin; None = derived from factor and the mscales
    truncate: bool = True


def rope_settings(raw: dict, source: str) -> tuple[float, float, YarnScaling | None]:
    """-> (rope_theta, partial_rotary_factor, yarn or None). Accepts transformers 5's `rope_parameters` and the
    older `rope_theta` + `rope_scaling` (DeepSeek's published config.json uses `rope_scaling: {type: yarn, ...}`)."""
    params = dict(raw.get("rope_scaling") or {}) | dict(raw.get("rope_parameters") or {})
    rope_type = params.get("rope_type") or params.get("type") or "default"
    theta = float(params.get("rope_theta") or raw.get("rope_theta") or 10000.0)
    partial = float(params.get("partial_rotary_factor") or raw.get("partial_rotary_factor") or 1.0)
    if rope_type == "default":
        return theta, partial, None
    if rope_type != "yarn":
        raise CheckpointError(f"{source}: key 'rope_parameters.rope_type'={rope_type!r} is not supported "
                              "(supported: 'default', 'yarn')")
    orig = params.get("original_max_position_embeddings") or raw.get("max_position_embeddings")
    factor = params.get("factor")
    if factor is None:
        factor = int(raw.get("max_position_embeddings", 0)) / int(orig)
    return theta, partial, YarnScaling(
        factor=float(factor), original_max_position_embeddings=int(orig),
        beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
        mscale=params.get("mscale"), mscale_all_dim=params.get("mscale_all_dim"),
        attention_factor=params.get("attention_factor"), truncate=bool(params.get("truncate", True)),
    )


def dsa_fields(family: str, raw: dict, layers: int, rope_dim: int, need, source: str) -> dict:
    """The DSA lightning indexer's MoEModelConfig fields (DeepSeek-V3.2, GLM-5). GLM-5's "shared" layers run no
    indexer and reuse the top-k of the layer before; the layout reads `indexer_types`, else `index_topk_pattern`
    ("FSS..." or a list), else transformers' schedule from `index_topk_freq` / `index_skip_topk_offset`."""
    index_dim = need("index_head_dim")
    if index_dim < rope_dim:
        raise CheckpointError(f"{source}: index_head_dim={index_dim} must be at least qk_rope_head_dim={rope_dim}")
    shared: tuple[int, ...] = ()
    if family == "glm_moe_dsa":
        kinds = raw.get("indexer_types")
        pattern = raw.get("index_topk_pattern")
        if kinds is None and pattern is not None:
            letters = {"F": "full", "S": "shared"}
            if isinstance(pattern, str) and set(pattern) - set(letters):
                raise CheckpointError(f"{source}: key 'index_topk_pattern' may hold only 'F' and 'S', got {pattern!r}")
            kinds = [letters[c] for c in pattern] if isinstance(pattern, str) else list(pattern)
        if kinds is None:
            freq = max(int(raw.get("index_topk_freq") or 1), 1)
            offset = int(raw.get("index_skip_topk_offset", 2))
            kinds = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(layers)]
        if len(kinds) < layers or set(kinds) - {"full", "shared"} or kinds[0] != "full":
            raise CheckpointError(f"{source}: key 'indexer_types' must give 'full' or 'shared' for each of the "
                                  f"{layers} layers, the first 'full', got {kinds!r}")
        shared = tuple(i for i in range(layers) if kinds[i] == "shared")
    return dict(index_n_heads=need("index_n_heads"), index_head_dim=index_dim, index_topk=need("index_topk"),
                index_shared_layers=shared,
                # DeepSeek-V3.2's indexer rotates the two halves; GLM-5's rotates interleaved pairs (its published
                # configs say so with `indexer_rope_interleave`, which transformers does not read: honoured here)
                index_rope_interleaved=family == "glm_moe_dsa" and bool(raw.get("indexer_rope_interleave", True)))


def deepseek_family_fields(family: str, raw: dict, common: dict, need, source: str) -> dict:
    """The MoEModelConfig keyword arguments of a DeepSeek-V2/V3 or GLM-4.5 config (beyond `common`)."""
    layers = common["num_layers"]
    heads = common["num_heads"]
    experts = need("n_routed_experts")
    first_dense = int(raw.get("first_k_dense_replace") or 0)
    freq = int(raw.get("moe_layer_freq") or 1)  # the original DeepSeek code's rule; transformers assumes 1
    moe_layers = tuple(i for i in range(layers) if i >= first_dense and i % freq == 0)
    if family in DSA_FAMILIES and raw.get("mlp_layer_types"):  # transformers' explicit per-layer kinds win
        moe_layers = tuple(i for i, kind in enumerate(raw["mlp_layer_types"][:layers]) if kind == "sparse")
    theta, partial, yarn = rope_settings(raw, source)
    shared = int(raw.get("n_shared_experts") or 0)
    moe_inter = need("moe_intermediate_size")
    if raw.get("mlp_bias"):
        raise CheckpointError(f"{source}: key 'mlp_bias'=true is not supported for {family}")
    fields = dict(
        num_experts=experts,
        expert_intermediate_size=moe_inter,
        rope_theta=theta,
        dense_intermediate_size=int(raw.get("intermediate_size") or 0),
        shared_expert_intermediate_size=moe_inter * shared,
        shared_expert_gated=False,
        moe_layers=moe_layers,
        routed_scaling_factor=float(raw.get("routed_scaling_factor") or 1.0),
        n_group=int(raw.get("n_group") or 1),
        topk_group=int(raw.get("topk_group") or 1),
        yarn=yarn,
    )
    if family == "deepseek_v2":
        method = raw.get("topk_method") or "greedy"
        if method not in ("greedy", "group_limited_greedy"):
            raise CheckpointError(f"{source}: key 'topk_method'={method!r} is not supported "
                                  "(supported: 'greedy', 'group_limited_greedy')")
        # transformers' DeepseekV2TopkRouter never renormalises: norm_topk_prob is read but unused there.
        fields |= dict(router_kind="deepseek_v2", topk_method=method, norm_topk_prob=False)
    else:
        fields |= dict(router_kind="sigmoid_grouped", topk_method="group_limited",
                       norm_topk_prob=bool(raw.get("norm_topk_prob", True)), router_correction_bias=True)
    if fields["router_kind"] != "deepseek_v2" or fields["topk_method"] != "greedy":
        if experts % fields["n_group"] or not 0 < fields["topk_group"] <= fields["n_group"]:
            raise CheckpointError(f"{source}: n_routed_experts={experts} must split into n_group={fields['n_group']} "
                                  f"equal groups, with 1 <= topk_group={fields['topk_group']} <= n_group")
        per_group = experts // fields["n_group"]
        if fields["topk_group"] * per_group < common["top_k"]:
            raise CheckpointError(f"{source}: topk_group={fields['topk_group']} groups of {per_group} experts hold "
                                  f"fewer than num_experts_per_tok={common['top_k']}")
    if family in MLA_FAMILIES:
        rope_dim = need("qk_rope_head_dim")
        q_lora = need("q_lora_rank") if family in DSA_FAMILIES else raw.get("q_lora_rank")
        fields |= dict(
            attention_kind="mla",
            num_kv_heads=heads,  # MLA expands the latent to one key/value per query head
            head_dim=need("qk_nope_head_dim") + rope_dim,
            q_lora_rank=int(q_lora) if q_lora else None,
            kv_lora_rank=need("kv_lora_rank"),
            qk_nope_head_dim=need("qk_nope_head_dim"),
            qk_rope_head_dim=rope_dim,
            v_head_dim=need("v_head_dim"),
            rotary_dim=rope_dim,
            # V2 rotates (x0,x1),(x2,x3).. pairs as complex numbers; V3 does with rope_interleave (its default);
            # V3.2 and GLM-5 always do (transformers has no rope_interleave for them).
            rope_pairs_interleaved=family != "deepseek_v3" or bool(raw.get("rope_interleave", True)),
            attention_bias=bool(raw.get("attention_bias", False)),
        )
        if family in DSA_FAMILIES:
            fields |= dsa_fields(family, raw, layers, rope_dim, need, source)
    else:  # glm4_moe: GQA
        head_dim = common["head_dim"]
        fields |= dict(
            attention_bias=bool(raw.get("attention_bias", False)),
            qk_norm_per_head=bool(raw.get("use_qk_norm", False)),
            rotary_dim=int(head_dim * partial),
        )
    if len(moe_layers) < layers and fields["dense_intermediate_size"] <= 0:
        raise CheckpointError(f"{source}: key 'intermediate_size' is needed for the dense (first_k_dense_replace) "
                              "layers")
    return fields
