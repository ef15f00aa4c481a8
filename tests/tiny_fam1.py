"""Tiny MiniMax-M2, ERNIE 4.5 MoE and Hunyuan-A13B checkpoints for tests, saved by `transformers` itself.

Each is 2-3 layers of hidden 32-48 with 4-8 experts. The options add what the published checkpoints carry: MiniMax-M2's
block-scaled FP8 weights (`weight_scale_inv`, `quantization_config.quant_method = "fp8"`, the router gate and its
correction bias left unquantised as published), the stacked expert layout (`fused`), and overrides of the config.
Correction biases, projection biases and norm weights are drawn at random (transformers initialises them to 0 and 1,
which would hide a missing bias or norm); the correction biases are large enough to change which experts some tokens
pick.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

VOCAB = 96
KINDS = ("minimax_m2", "ernie4_5_moe", "hunyuan_v1_moe")


def hf_config(kind: str, **overrides):
    from transformers import Ernie4_5_MoeConfig, HunYuanMoEV1Config, MiniMaxM2Config

    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.15, eos_token_id=None,
                  bos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    if kind == "minimax_m2":  # head_dim 16 != hidden/heads, partial RoPE over half of each head
        return MiniMaxM2Config(**(common | dict(
            head_dim=16, intermediate_size=24, num_local_experts=8, num_experts_per_tok=2,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
            | overrides))
    if kind == "ernie4_5_moe":  # layer 0 dense, MoE on layers 1 and 2; tied embeddings (ERNIE's default)
        return Ernie4_5_MoeConfig(**(common | dict(
            num_hidden_layers=3, intermediate_size=48, moe_intermediate_size=16, moe_num_experts=8, moe_k=3,
            moe_num_shared_experts=2, moe_layer_start_index=1, moe_layer_interval=1, tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0}) | overrides))
    if kind == "hunyuan_v1_moe":  # NTK-alpha RoPE as the published config spells it
        return HunYuanMoEV1Config(**(common | dict(
            head_dim=8, intermediate_size=24, num_experts=4, moe_topk=2,
            rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "alpha": 1000.0, "factor": 1.0})
            | overrides))
    raise ValueError(kind)


def write_fam1_checkpoint(kind: str, out: Path, seed: int = 0, fused: bool = False,
                          fp8_block: tuple[int, int] | None = None, **overrides) -> Path:
    """save_pretrained a random `kind` model into `out` (fused: `save_original_format=False`, the stacked experts);
    fp8_block: quantise every linear weight but the router gate, embeddings and lm_head (MiniMax-M2's format)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(kind, **overrides))
    with torch.no_grad():
        for name, param in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith("norm.weight"):
                param.add_(torch.randn_like(param) * 0.2)
            elif name.endswith("e_score_correction_bias"):
                param.copy_(torch.randn_like(param) * 0.3)
            elif name.endswith("proj.bias"):  # Hunyuan's attention_bias: transformers starts them at 0
                param.normal_(0.0, 0.3)
    model.save_pretrained(out, **({"save_original_format": False} if fused else {}))
    if fp8_block:
        _quantize_fp8(out, fp8_block)
    return out


def _quantize_fp8(out: Path, block: tuple[int, int]) -> None:
    from safetensors.torch import load_file, save_file

    from expertmesh.experts.fp8 import quantize

    path = out / "model.safetensors"
    tensors = load_file(str(path))
    for name in list(tensors):
        t = tensors[name]
        if (t.dim() == 2 and name.endswith(".weight") and "norm" not in name and not name.endswith("gate.weight")
                and name not in ("model.embed_tokens.weight", "lm_head.weight")):
            tensors[name], tensors[name + "_scale_inv"] = quantize(t, block)
    save_file(tensors, str(path), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    # as MiniMax-M2 publishes it
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "float8_e4m3fn", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block),
                                     "modules_to_not_convert": ["gate", "e_score_correction_bias", "lm_head"]}
    (out / "config.json").write_text(json.dumps(config, indent=2))
