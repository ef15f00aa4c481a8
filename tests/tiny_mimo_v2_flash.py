"""Tiny MiMo-V2-Flash checkpoints for tests, saved by `transformers` itself.

4 layers of hidden 32: layer 0 full attention + dense MLP, layers 1-2 sliding (window 5, 2 KV heads against the full
layers' 1, sinks) and layer 3 full, all three MoE (8 experts top-2 in 2 groups of which 1 is chosen, scaled ×2.5);
head_dim 12 with 4 rotary dims (partial 0.334, as published), values 8 wide scaled by 0.707, RoPE bases 100 (full)
and 10000 (sliding) so the two kinds differ at small positions. Correction biases, sinks and norm weights are drawn
at random (transformers starts them at 0, 0 and 1). fused: the stacked expert layout (`save_original_format=False`).
"""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 96
WINDOW = 5


def hf_config(**overrides):
    from transformers import MiMoV2FlashConfig

    return MiMoV2FlashConfig(**(dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=1, head_dim=12, v_head_dim=8, n_routed_experts=8,
        num_experts_per_tok=2, n_group=2, topk_group=1, routed_scaling_factor=2.5, sliding_window=WINDOW,
        layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 100.0, "partial_rotary_factor": 0.334},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.334}},
        max_position_embeddings=256, bos_token_id=None, eos_token_id=None, pad_token_id=None, initializer_range=0.15,
        tie_word_embeddings=False) | overrides))


def write_mimo_checkpoint(out: Path, seed: int = 0, fused: bool = False, **overrides) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(**overrides))
    with torch.no_grad():
        for name, param in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith("norm.weight"):
                param.add_(torch.randn_like(param) * 0.2)
            elif name.endswith("e_score_correction_bias"):
                param.copy_(torch.randn_like(param) * 0.3)
            elif name.endswith("sinks"):
                param.normal_(0.0, 1.0)
            elif name.endswith("proj.bias"):
                param.normal_(0.0, 0.3)
    model.save_pretrained(out, **({"save_original_format": False} if fused else {}))
    return out


def quantize_fp8(out: Path, block: tuple[int, int]) -> Path:
    """Rewrite a per-expert checkpoint in `out` as block-scaled FP8: every 2-D linear weight but the router gate,
    embeddings and lm_head becomes e4m3 + `weight_scale_inv` (the DeepSeek / MiniMax format), with its
    quantization_config."""
    import json

    from safetensors.torch import load_file, save_file

    from expertmesh.experts.fp8 import quantize

    path = out / "model.safetensors"
    tensors = load_file(str(path))
    for name in list(tensors):
        t = tensors[name]
        if (t.dim() == 2 and name.endswith("proj.weight") and name not in ("lm_head.weight",)):
            tensors[name], tensors[name + "_scale_inv"] = quantize(t, block)
    save_file(tensors, str(path), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block)}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out
