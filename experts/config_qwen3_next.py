"""config.json parsing for Qwen3-Next (`qwen3_next`, transformers' Qwen3NextForCausalLM) and Qwen3.5-MoE
(`qwen3_5_moe`: Qwen3_5MoeForCausalLM with `model_type` qwen3_5_moe_text, and the text part of the vision-language
Qwen3_5MoeForConditionalGeneration: its `text_config`, tensors under `model.language_model.`; the vision tower and the
`mtp.*` multi-token-prediction tensors are not read).

Both are hybrids: `layer_types` marks each layer `linear_attention` (a Gated DeltaNet: causal depthwise conv1d over
q/k/v with its own state, L2-normalised q/k, a per-value-head decay exp(-exp(A_log) * softplus(a + dt_bias)) and
write strength sigmoid(b), value heads grouped over key heads, a gated RMSNorm; experts/gated_delta.py) or
`full_attention` (every `full_attention_interval`-th layer by default: GQA whose q_proj packs a per-head sigmoid output
gate after each head's queries, per-head q/k RMSNorm, RoPE on the first `partial_rotary_factor` of each head, 0.25 by
default; experts/attention_qwen3_next.py). Every RMSNorm outside the DeltaNet computes x * (1 + w) (weights stored
as offsets from 1, `norm_unit_offset`). MoE: softmax top-k router (Qwen3.5 always renormalises), a shared expert with
a sigmoid gate. Qwen3-Next packs the DeltaNet projections per key head (`in_proj_qkvz`, `in_proj_ba`); Qwen3.5 keeps
them separate (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`). Qwen3-Next may have dense layers
(`mlp_only_layers`, `decoder_sparse_step`); Qwen3.5 has MoE on every layer.

Qwen3.5's RoPE is multimodal (`mrope_section`): for text every axis has the same position, which is plain RoPE.
Refused, naming the key: layer types other than these two, RoPE types other than default, a value-head count that is
not a multiple of the key heads.
"""

from __future__ import annotations

from dataclasses import dataclass

from .config_deepseek import rope_settings
from .errors import CheckpointError

ARCHITECTURES = {"Qwen3NextForCausalLM": "qwen3_next", "Qwen3_5MoeForCausalLM": "qwen3_5_moe",
                 "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe"}
MODEL_TYPES = {"qwen3_next": "qwen3_next", "qwen3_5_moe": "qwen3_5_moe", "qwen3_5_moe_text": "qwen3_5_moe"}
FAMILIES = ("qwen3_next", "qwen3_5_moe")
TEXT_PREFIX, WRAPPER_PREFIX = "model.", "model.language_model."  # where the text model's tensors sit


@dataclass(frozen=True)
class GatedDeltaDims:
    """The shape of a Gated DeltaNet layer (the linear-attention layers of Qwen3-Next / Qwen3.5)."""

    num_k_heads: int  # query/key heads
    num_v_heads: int  # value heads: a multiple of num_k_heads, each key head serves num_v_heads // num_k_heads
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int  # the causal conv1d's width; its state keeps the last conv_kernel - 1 inputs
    fused_projections: bool  # Qwen3-Next: in_proj_qkvz / in_proj_ba packed per key head; Qwen3.5: four projections

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.k_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.v_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the conv1d: q, k and v side by side."""
        return 2 * self.key_dim + self.value_dim

    def state_bytes(self, dtype_bytes: int) -> int:
        """Bytes of one sequence's state in one layer: the conv state at the model dtype, the recurrent state at
        float32 (or wider, for a float64 model)."""
        return (self.conv_dim * (self.conv_kernel - 1) * dtype_bytes
                + self.num_v_heads * self.k_head_dim * self.v_head_dim * max(4, dtype_bytes))

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        """What one sequence keeps per layer: the conv inputs (model dtype) and the recurrent matrix (float32)."""
        return {"conv": (self.conv_dim, self.conv_kernel - 1),
                "recurrent": (self.num_v_heads, self.k_head_dim, self.v_head_dim)}


def normalise(raw: dict, source: str) -> dict:
    """The VL wrapper's `text_config` as the config read (tensors under model.language_model.); a text config as
    it is."""
    if not isinstance(raw.get("text_config"), dict):
        return dict(raw) | {"_weight_prefix": TEXT_PREFIX}
    text = dict(raw["text_config"])
    for key in ("quantization_config", "tie_word_embeddings"):
        if key in raw and key not in text:
            text[key] = raw[key]
    return text | {"_weight_prefix": WRAPPER_PREFIX, "architectures": raw.get("architectures")}


def _positive(raw: dict, key: str, default: int, source: str) -> int:
    value = raw.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise CheckpointError(f"{source}: key '{key}' must be a positive integer, got {value!r}")
    return value


def qwen3_next_fields(raw: dict, common: dict, need, source: str, family: str) -> dict:
    """The MoEModelConfig keyword arguments of a Qwen3-Next / Qwen3.5-MoE text config (beyond `common`)."""
    layers, head_dim = common["num_layers"], common["head_dim"]
    types = raw.get("layer_types")
    if types is None:
        interval = _positive(raw, "full_attention_interval", 4, source)
        types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(layers)]
    if not isinstance(types, list) or len(types) < layers:
        raise CheckpointError(f"{source}: key 'layer_types' must list num_hidden_layers={layers} entries")
    types = types[:layers]
    if set(types) - {"linear_attention", "full_attention"}:
        raise CheckpointError(f"{source}: key 'layer_types'={sorted(set(types))} is not supported for {family} "
                              "(supported: 'linear_attention', 'full_attention')")
    dims = GatedDeltaDims(
        num_k_heads=_positive(raw, "linear_num_key_heads", 16, source),
        num_v_heads=_positive(raw, "linear_num_value_heads", 32, source),
        k_head_dim=_positive(raw, "linear_key_head_dim", 128, source),
        v_head_dim=_positive(raw, "linear_value_head_dim", 128, source),
        conv_kernel=_positive(raw, "linear_conv_kernel_dim", 4, source),
        fused_projections=family == "qwen3_next",
    )
    if dims.num_v_heads % dims.num_k_heads:
        raise CheckpointError(f"{source}: key 'linear_num_value_heads'={dims.num_v_heads} must be a multiple of "
                              f"'linear_num_key_heads'={dims.num_k_heads}")
    params = dict(raw.get("rope_parameters") or {})
    if "partial_rotary_factor" not in params and "partial_rotary_factor" not in raw:
        raw = raw | {"partial_rotary_factor": 0.25}  # transformers' default for both families
    theta, partial, yarn = rope_settings(raw, source)
    if yarn is not None:
        raise CheckpointError(f"{source}: key 'rope_parameters.rope_type'='yarn' is not supported for {family} "
                              "(supported: 'default')")
    rotary = int(head_dim * partial)
    if not 0 < rotary <= head_dim or rotary % 2:
        raise CheckpointError(f"{source}: key 'partial_rotary_factor'={partial} gives {rotary} rotary dims of "
                              f"head_dim={head_dim} (must be even and positive)")
    experts = need("num_experts")
    if family == "qwen3_next":
        step = raw.get("decoder_sparse_step", 1) or 1
        mlp_only = set(raw.get("mlp_only_layers") or [])
        moe_layers = tuple(i for i in range(layers) if i not in mlp_only and (i + 1) % step == 0)
        norm_topk = bool(raw.get("norm_topk_prob", True))
        dense = int(raw.get("intermediate_size") or 0)
        if len(moe_layers) < layers and dense <= 0:
            raise CheckpointError(f"{source}: key 'intermediate_size' is needed for the dense (mlp_only) layers")
    else:
        moe_layers, norm_topk, dense = tuple(range(layers)), True, 0
    return dict(
        num_experts=experts,
        expert_intermediate_size=need("moe_intermediate_size"),
        norm_topk_prob=norm_topk,
        rope_theta=theta,
        rotary_dim=rotary,
        attention_bias=bool(raw.get("attention_bias", False)),
        qk_norm_per_head=True,
        dense_intermediate_size=dense,
        shared_expert_intermediate_size=int(raw.get("shared_expert_intermediate_size") or 0),
        moe_layers=moe_layers,
        linear_layers=tuple(i for i, t in enumerate(types) if t == "linear_attention"),
        gated_delta=dims,
        norm_unit_offset=True,
        attn_output_gate=True,
        weight_prefix=raw.get("_weight_prefix", TEXT_PREFIX),
    )


def qwen3_next_family_fields(raw: dict, common: dict, need, source: str) -> dict:
    return qwen3_next_fields(raw, common, need, source, "qwen3_next")


def qwen3_5_moe_family_fields(raw: dict, common: dict, need, source: str) -> dict:
    return qwen3_next_fields(raw, common, need, source, "qwen3_5_moe")
