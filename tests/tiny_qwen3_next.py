"""Tiny Qwen3-Next (`qwen3_next`) and Qwen3.5-MoE (`qwen3_5_moe`) checkpoints for tests, saved by `transformers`
itself (Qwen3NextForCausalLM; Qwen3_5MoeForCausalLM; or the vision-language Qwen3_5MoeForConditionalGeneration whose
text tensors sit under `model.language_model.`).

4 layers of hidden 32: layers 0, 1, 2 Gated DeltaNet (2 key heads of 8, 4 value heads of 6: value heads grouped over
key heads; conv kernel 4), layer 3 gated full attention (4 heads of 8, 2 KV heads, partial RoPE 0.5 = 4 dims);
4 experts top-2 and a gated shared expert; Qwen3-Next with layer 1 a dense MLP (`mlp_only_layers`). Norm weights,
A_log and dt_bias are drawn at random (transformers starts the zero-centred norms at 0 and dt_bias at 1).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

VOCAB = 96
KINDS = ("next", "next_fused", "qwen3_5", "qwen3_5_vl")


def text_config_kwargs(family: str = "qwen3_next", **overrides) -> dict:
    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, linear_conv_kernel_dim=4, linear_key_head_dim=8,
                  linear_value_head_dim=6, linear_num_key_heads=2, linear_num_value_heads=4,
                  moe_intermediate_size=16, shared_expert_intermediate_size=24, num_experts=4, num_experts_per_tok=2,
                  max_position_embeddings=256, initializer_range=0.15, rms_norm_eps=1e-6,
                  layer_types=["linear_attention"] * 3 + ["full_attention"], tie_word_embeddings=False,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
                  bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if family == "qwen3_next":
        extra = dict(intermediate_size=40, mlp_only_layers=[1], norm_topk_prob=True)
    elif family == "qwen3_5_moe":
        extra = dict(rope_parameters=common["rope_parameters"] | {"mrope_section": [1, 1, 0],
                                                                   "mrope_interleaved": True})
    else:
        raise ValueError(family)
    return common | extra | overrides


def _perturb(model) -> None:
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                param.add_(torch.randn_like(param) * 0.2)
            elif name.endswith("dt_bias"):
                param.normal_(0.0, 1.0)
            elif name.endswith("A_log"):
                param.uniform_(-1.0, 1.5)


def write_qwen3_next_checkpoint(out: Path, kind: str = "next", seed: int = 0, **overrides) -> Path:
    """save_pretrained a random model of `kind` (KINDS) into `out`: next (per-expert names), next_fused (stacked
    experts), qwen3_5 (Qwen3_5MoeForCausalLM), qwen3_5_vl (Qwen3_5MoeForConditionalGeneration with a one-layer
    vision tower; only its text part is read)."""
    from transformers import (
        Qwen3_5MoeConfig,
        Qwen3_5MoeForCausalLM,
        Qwen3_5MoeForConditionalGeneration,
        Qwen3_5MoeTextConfig,
        Qwen3NextConfig,
        Qwen3NextForCausalLM,
    )

    torch.manual_seed(seed)
    kwargs = {}
    if kind in ("next", "next_fused"):
        model = Qwen3NextForCausalLM(Qwen3NextConfig(**text_config_kwargs("qwen3_next", **overrides)))
        if kind == "next_fused":
            kwargs["save_original_format"] = False
    elif kind == "qwen3_5":
        model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**text_config_kwargs("qwen3_5_moe", **overrides)))
    elif kind == "qwen3_5_vl":
        vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=2,
                      spatial_merge_size=1, temporal_patch_size=1, num_position_embeddings=16)
        model = Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeConfig(
            text_config=text_config_kwargs("qwen3_5_moe", **overrides), vision_config=vision))
    else:
        raise ValueError(kind)
    _perturb(model)
    model.save_pretrained(out, **kwargs)
    return out


def load_hf(folder: Path, dtype: torch.dtype = torch.float32):
    """The transformers causal LM of a tiny checkpoint (the VL wrapper: the whole model; see text_model)."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeForConditionalGeneration, Qwen3NextForCausalLM

    arch = json.loads((Path(folder) / "config.json").read_text())["architectures"][0]
    cls = {"Qwen3NextForCausalLM": Qwen3NextForCausalLM, "Qwen3_5MoeForCausalLM": Qwen3_5MoeForCausalLM,
           "Qwen3_5MoeForConditionalGeneration": Qwen3_5MoeForConditionalGeneration}[arch]
    return cls.from_pretrained(folder, dtype=dtype).eval()
