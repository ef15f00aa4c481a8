"""config.json parsing for Llama 4 text (`llama4_text`, transformers' Llama4ForCausalLM) and the text part of the
multimodal wrapper (`llama4`, Llama4ForConditionalGeneration: the text config under `text_config`, the text
tensors under `language_model.`; the vision tower is not read).

Quirks (Scout: 16 experts, every layer MoE; Maverick: 128 experts, MoE on every other layer):
- the router is a top-1 on the gate logits whose *sigmoid* score multiplies the expert's **input**, not its output
  (experts/gating.py `route_sigmoid_input`); a shared expert (ungated, `intermediate_size` wide as the experts) on
  every MoE layer; the other layers a dense MLP `intermediate_size_mlp` wide;
- MoE layers from `moe_layers`, else every `interleave_moe_layer_step`-th layer (step-1, 2*step-1, ..);
- RoPE only on the layers `no_rope_layers` marks 1, applied to (x0, x1), (x2, x3) pairs (complex form), in float32;
  those layers attend within chunks of `attention_chunk_size` tokens (a key is visible when it is in the query's
  chunk); the others ("NoPE") attend to everything with no position encoding but a query scaled by
  log1p(floor((pos + 1) / floor_scale)) * attn_scale + 1 (`attn_temperature_tuning`);
- `use_qk_norm`: a weightless RMS norm of q and k after RoPE, on RoPE layers only;
- RoPE `llama3` scaling (`rope_parameters.rope_type`), or none;
- routed experts stacked `feed_forward.experts.gate_up_proj` [E, H, 2I] (x @ W form: gate columns, then up) and
  `down_proj` [E, I, H] (experts/weights.py layout `fused_in_out`), the only layout transformers writes for it.

Refused, naming the key: more than one expert per token (the score scales each expert's input: the actors take one
input per token), RoPE types other than default / llama3, layer types other than chunked / full attention.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import CheckpointError

ARCHITECTURES = {"Llama4ForCausalLM": "llama4", "Llama4ForConditionalGeneration": "llama4"}
MODEL_TYPES = {"llama4_text": "llama4", "llama4": "llama4"}
WRAPPER_PREFIX = "language_model."  # where Llama4ForConditionalGeneration keeps its Llama4ForCausalLM


@dataclass(frozen=True)
class Llama3Scaling:
    """rope_type "llama3": inverse frequencies rescaled by wavelength band (experts/rope.py `llama3_inv_freq`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


def normalise(raw: dict, source: str) -> dict:
    """The multimodal wrapper's `text_config` as the config read (its tensors under `language_model.`); a text
    config as it is."""
    if not isinstance(raw.get("text_config"), dict):
        return dict(raw) | {"_weight_prefix": ""}
    text = dict(raw["text_config"])
    if raw.get("quantization_config") and not text.get("quantization_config"):
        text["quantization_config"] = raw["quantization_config"]  # refused below by the common check, by name
    return text | {"_weight_prefix": WRAPPER_PREFIX}


def _rope(raw: dict, source: str) -> tuple[float, Llama3Scaling | None]:
    params = dict(raw.get("rope_scaling") or {}) | dict(raw.get("rope_parameters") or {})
    theta = float(params.get("rope_theta") or raw.get("rope_theta") or 500000.0)
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise CheckpointError(f"{source}: key 'rope_parameters.rope_type'={rope_type!r} is not supported for llama4 "
                              "(supported: 'default', 'llama3')")
    try:
        scaling = Llama3Scaling(float(params["factor"]), float(params["low_freq_factor"]),
                                float(params["high_freq_factor"]), int(params["original_max_position_embeddings"]))
    except KeyError as exc:
        raise CheckpointError(f"{source}: key 'rope_parameters.{exc.args[0]}' is required for rope_type "
                              "'llama3'") from exc
    # high_freq_factor == low_freq_factor (Llama 4 Scout publishes 1.0 and 1.0) leaves no band to interpolate: every
    # wavelength is either kept or divided by factor, as in transformers (its 0/0 lands only where it is not used).
    return theta, scaling


def _layer_list(raw: dict, key: str, layers: int, source: str) -> list:
    value = raw.get(key)
    if not isinstance(value, list) or len(value) < layers:
        raise CheckpointError(f"{source}: key '{key}' must list at least num_hidden_layers={layers} entries")
    return value[:layers]


def llama4_fields(raw: dict, common: dict, need, source: str) -> dict:
    """The MoEModelConfig keyword arguments of a Llama 4 text config (beyond `common`)."""
    layers = common["num_layers"]
    if common["top_k"] != 1:
        raise CheckpointError(f"{source}: key 'num_experts_per_tok'={common['top_k']} is not supported for llama4 "
                              "(1 is: the router's score scales the expert's input, one input per token)")
    step = raw.get("interleave_moe_layer_step", 1)
    if not isinstance(step, int) or step < 1:
        raise CheckpointError(f"{source}: key 'interleave_moe_layer_step'={step!r} must be a positive integer")
    moe_layers = raw.get("moe_layers")
    if moe_layers is None:
        moe_layers = list(range(step - 1, layers, step))  # transformers' Llama4TextConfig default
    if any(not isinstance(i, int) or not 0 <= i < layers for i in moe_layers):
        raise CheckpointError(f"{source}: key 'moe_layers'={moe_layers!r} must hold layer indices in 0..{layers - 1}")
    if raw.get("no_rope_layers"):
        uses_rope = [bool(x) for x in _layer_list(raw, "no_rope_layers", layers, source)]
    else:  # transformers' default: a NoPE layer every no_rope_layer_interval layers
        interval = int(raw.get("no_rope_layer_interval") or 4)
        uses_rope = [(i + 1) % interval != 0 for i in range(layers)]
    chunk = raw.get("attention_chunk_size")
    if chunk is not None and (not isinstance(chunk, int) or chunk <= 0):
        raise CheckpointError(f"{source}: key 'attention_chunk_size'={chunk!r} must be a positive integer or null")
    if raw.get("layer_types"):
        types = _layer_list(raw, "layer_types", layers, source)
        if set(types) - {"chunked_attention", "full_attention"}:
            raise CheckpointError(f"{source}: key 'layer_types'={sorted(set(types))} is not supported for llama4 "
                                  "(supported: 'chunked_attention', 'full_attention')")
    else:
        types = ["chunked_attention" if rope and chunk is not None else "full_attention" for rope in uses_rope]
    chunked = tuple(i for i, t in enumerate(types) if t == "chunked_attention")
    if chunked and chunk is None:
        raise CheckpointError(f"{source}: key 'layer_types' has chunked_attention layers but "
                              "'attention_chunk_size' is null")
    experts = need("num_local_experts")
    inter = need("intermediate_size")
    dense = int(raw.get("intermediate_size_mlp") or 0)
    if len(moe_layers) < layers and dense <= 0:
        raise CheckpointError(f"{source}: key 'intermediate_size_mlp' is needed for the dense (non-MoE) layers")
    theta, llama3 = _rope(raw, source)
    temperature = None
    if raw.get("attn_temperature_tuning", True):
        floor_scale = float(raw.get("floor_scale", 8192))
        if floor_scale <= 0:
            raise CheckpointError(f"{source}: key 'floor_scale'={floor_scale} must be positive")
        temperature = (floor_scale, float(raw.get("attn_scale", 0.1)))
    bias = bool(raw.get("attention_bias", False))
    return dict(
        num_experts=experts,
        expert_intermediate_size=inter,
        norm_topk_prob=False,
        rope_theta=theta,
        llama3_rope=llama3,
        rope_pairs_interleaved=True,
        attention_bias=bias,
        attention_out_bias=bias,
        dense_intermediate_size=dense,
        shared_expert_intermediate_size=inter,
        shared_expert_gated=False,
        router_kind="sigmoid_input",
        moe_layers=tuple(sorted(set(moe_layers))),
        nope_layers=tuple(i for i, rope in enumerate(uses_rope) if not rope),
        chunked_layers=chunked,
        attention_chunk_size=chunk if chunked else None,
        qk_l2_norm=bool(raw.get("use_qk_norm", True)),
        attn_temperature=temperature,
        weight_prefix=raw.get("_weight_prefix", ""),
    )
