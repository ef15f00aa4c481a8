"""config.json parsing for ERNIE 4.5 MoE (`ernie4_5_moe`, transformers' Ernie4_5_MoeForCausalLM).

GQA attention without biases; RoPE rotates interleaved pairs (x0, x1), (x2, x3), .. of each head, in float32.
MoE only on layers i with (i + 1) % `moe_layer_interval` == 0 and `moe_layer_start_index` <= i <=
`moe_layer_end_index` (-1: the last layer); the others are a dense MLP of `intermediate_size`. The router (float32)
takes a softmax over all experts, chooses the top-k of softmax + `moe_statics.e_score_correction_bias` (selection
only) and weights the chosen softmax values divided by max(their sum, `moe_norm_min`) (experts/gating.py
`route_softmax_biased`). `moe_num_shared_experts` ungated shared experts of `moe_intermediate_size` each.
Embeddings are tied unless `tie_word_embeddings` is false (ERNIE's default is tied).
"""

from __future__ import annotations

from .config_deepseek import rope_settings
from .errors import CheckpointError

ARCHITECTURES = {"Ernie4_5_MoeForCausalLM": "ernie4_5_moe"}
MODEL_TYPES = {"ernie4_5_moe": "ernie4_5_moe"}


def normalise(raw: dict, source: str) -> dict:
    """ERNIE's own key names -> the common ones config_from_dict reads."""
    raw = dict(raw)
    for key in ("moe_k", "moe_num_experts"):
        if isinstance(raw.get(key), list):
            raise CheckpointError(f"{source}: key '{key}' is a list (the vision-language model's text and vision "
                                  "experts); only the text model ernie4_5_moe is supported")
    if "num_experts_per_tok" not in raw and raw.get("moe_k") is not None:
        raw["num_experts_per_tok"] = raw["moe_k"]
    raw.setdefault("tie_word_embeddings", True)  # transformers' Ernie4_5_MoeConfig default
    return raw


def ernie4_5_moe_fields(raw: dict, common: dict, need, source: str) -> dict:
    """The MoEModelConfig keyword arguments of an ERNIE 4.5 MoE config (beyond `common`)."""
    layers = common["num_layers"]
    if raw.get("use_bias"):
        raise CheckpointError(f"{source}: key 'use_bias'=true is not supported for ernie4_5_moe")
    theta, partial, yarn = rope_settings(raw, source)
    if yarn is not None or partial != 1.0:
        raise CheckpointError(f"{source}: key 'rope_parameters' must be the default RoPE over the whole head for "
                              "ernie4_5_moe (yarn and partial_rotary_factor are not supported)")
    experts = raw.get("moe_num_experts") or need("num_experts")
    start = raw.get("moe_layer_start_index")
    start = 1 if start is None else int(start)
    end = raw.get("moe_layer_end_index", -1)
    end = layers - 1 if end is None or int(end) == -1 else int(end)
    interval = raw.get("moe_layer_interval", 1)
    if not isinstance(interval, int) or interval <= 0:
        raise CheckpointError(f"{source}: key 'moe_layer_interval' must be a positive integer, got {interval!r}")
    moe_layers = tuple(i for i in range(layers) if (i + 1) % interval == 0 and start <= i <= end)
    moe_inter = need("moe_intermediate_size")
    shared = int(raw.get("moe_num_shared_experts") or 0)
    norm_min = float(raw.get("moe_norm_min", 1e-12))
    dense = int(raw.get("intermediate_size") or 0)
    if len(moe_layers) < layers and dense <= 0:
        raise CheckpointError(f"{source}: key 'intermediate_size' is needed for the dense (non-MoE) layers")
    return dict(
        num_experts=experts,
        expert_intermediate_size=moe_inter,
        norm_topk_prob=True,
        rope_theta=theta,
        rope_pairs_interleaved=True,
        router_kind="softmax_biased",
        router_norm_min=norm_min,
        router_correction_bias=True,
        dense_intermediate_size=dense,
        shared_expert_intermediate_size=moe_inter * shared,
        shared_expert_gated=False,
        moe_layers=moe_layers,
    )
