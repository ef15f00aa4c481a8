"""config.json parsing for LongCat-Flash (`longcat_flash`, transformers' LongcatFlashForCausalLM).

Shortcut-connected MoE: each of the `num_layers` logical layers holds **two** attention + dense-MLP sublayers and one
MoE that runs beside them. We number the sublayers as decoder layers (`num_layers` here = 2 x the file's
`num_layers`, transformers' `num_hidden_layers`): sublayer 2L reads `model.layers.L.*.0`, sublayer 2L+1 reads
`*.1`. The MoE takes sublayer 2L's post-attention-normed hidden state and its output is added to the residual at the
end of sublayer 2L+1, after that sublayer's dense MLP (`shortcut_moe`); so `moe_layers` are the even sublayers and a
shard (layer, expert) of sublayer 2L lives on disk under `model.layers.L.mlp.experts.E`.

Router (`router_kind` "softmax_scaled"): float32 logits over the `n_routed_experts` real experts *and* the
`zero_expert_num` zero-compute experts, softmax over all of them, top-`moe_topk` ranked by probs + a selection-only
`e_score_correction_bias`, weights = the chosen probs x `routed_scaling_factor`, never renormalised. An identity
expert (id >= n_routed_experts) returns its input: the decoder computes it (weight x hidden) and no actor sees it.

Attention: DeepSeek-V3's MLA with a q LoRA, interleaved RoPE over `qk_rope_head_dim` dims, and LongCat's LoRA scaling
(q x sqrt(hidden / q_lora_rank), the normed KV latent x sqrt(hidden / kv_lora_rank)). The MTP layers (`model.mtp.*`)
are not read. Refused, naming the key: RoPE types other than default / yarn, `head_dim` != `qk_rope_head_dim` (the
RoPE tables are `head_dim` wide), a `qk_head_dim` other than nope + rope, no q LoRA, zero routed experts, the
original config's `mla_scale_q_lora` / `mla_scale_kv_lora` false or a `zero_expert_type` other than identity.
"""

from __future__ import annotations

from .config_deepseek import rope_settings
from .errors import CheckpointError

ARCHITECTURES = {"LongcatFlashForCausalLM": "longcat_flash"}
MODEL_TYPES = {"longcat_flash": "longcat_flash"}


def normalise(raw: dict, source: str) -> dict:
    """The common key names config_from_dict reads: sublayers as decoder layers, the attribute_map's aliases."""
    raw = dict(raw)
    logical = raw.get("num_layers")
    if not isinstance(logical, int) or isinstance(logical, bool) or logical <= 0:
        raise CheckpointError(f"{source}: key 'num_layers' must be a positive integer, got {logical!r}")
    raw["num_hidden_layers"] = 2 * logical  # two attention sublayers per layer
    for ours, theirs in (("num_experts_per_tok", "moe_topk"), ("num_experts", "n_routed_experts"),
                         ("intermediate_size", "ffn_hidden_size"), ("moe_intermediate_size", "expert_ffn_hidden_size")):
        if raw.get(theirs) is not None:
            raw[ours] = raw[theirs]
    raw["num_key_value_heads"] = None  # MLA: one expanded key/value per query head
    return raw


def longcat_flash_fields(raw: dict, common: dict, need, source: str) -> dict:
    """The MoEModelConfig keyword arguments of a LongCat-Flash config (beyond `common`)."""
    layers, heads = common["num_layers"], common["num_heads"]
    theta, _, yarn = rope_settings(raw, source)
    nope, rope = need("qk_nope_head_dim"), need("qk_rope_head_dim")
    if raw.get("head_dim") not in (None, rope):
        raise CheckpointError(f"{source}: key 'head_dim'={raw['head_dim']!r} must equal qk_rope_head_dim={rope} "
                              "(transformers builds the RoPE tables head_dim wide and applies them to the rope part)")
    if raw.get("qk_head_dim") not in (None, nope + rope):
        raise CheckpointError(f"{source}: key 'qk_head_dim'={raw['qk_head_dim']!r} must equal qk_nope_head_dim + "
                              f"qk_rope_head_dim = {nope + rope}")
    if not raw.get("q_lora_rank"):
        raise CheckpointError(f"{source}: key 'q_lora_rank' is required for longcat_flash (its MLA always has a "
                              "q LoRA)")
    zero = raw.get("zero_expert_num") or 0
    if not isinstance(zero, int) or isinstance(zero, bool) or zero < 0:
        raise CheckpointError(f"{source}: key 'zero_expert_num' must be a non-negative integer, got {zero!r}")
    experts = need("num_experts")
    for key in ("mla_scale_q_lora", "mla_scale_kv_lora"):  # the original config's switches; transformers always scales
        if raw.get(key) is False:
            raise CheckpointError(f"{source}: key '{key}'=false is not supported for longcat_flash (transformers "
                                  "always applies the LoRA scaling)")
    if raw.get("zero_expert_type") not in (None, "identity"):
        raise CheckpointError(f"{source}: key 'zero_expert_type'={raw['zero_expert_type']!r} is not supported "
                              "(supported: 'identity')")
    if raw.get("router_bias"):
        raise CheckpointError(f"{source}: key 'router_bias'=true is not supported for longcat_flash")
    if common["top_k"] > experts + zero:
        raise CheckpointError(f"{source}: key 'moe_topk'={common['top_k']} exceeds n_routed_experts + "
                              f"zero_expert_num = {experts + zero}")
    return dict(
        num_experts=experts,
        zero_experts=zero,
        expert_intermediate_size=need("moe_intermediate_size"),
        dense_intermediate_size=need("intermediate_size"),
        norm_topk_prob=False,
        rope_theta=theta,
        yarn=yarn,
        attention_kind="mla",
        num_kv_heads=heads,
        head_dim=nope + rope,
        q_lora_rank=int(raw["q_lora_rank"]),
        kv_lora_rank=need("kv_lora_rank"),
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope,
        v_head_dim=need("v_head_dim"),
        rotary_dim=rope,
        rope_pairs_interleaved=True,
        mla_lora_scale=True,
        attention_bias=bool(raw.get("attention_bias", False)),
        router_kind="softmax_scaled",
        routed_scaling_factor=float(raw.get("routed_scaling_factor") or 1.0),
        router_correction_bias=True,
        moe_layers=tuple(range(0, layers, 2)),
        shortcut_moe=True,
    )
