"""Tiny LongCat-Flash checkpoints for tests, saved by `transformers` itself.

2 logical layers (4 attention / dense-MLP sublayers) of hidden 32: MLA with a q LoRA rank 16, a KV latent of 8,
4 heads of 6 + 4 (nope + rope) query/key dims and 6 value dims; dense MLPs 48 wide; one shortcut MoE per layer of 4
real experts 16 wide plus 4 zero-compute (identity) experts, top-3, weights × 2.5, no renormalisation. RoPE base 100
so small positions differ. Correction biases and norm weights are drawn at random (transformers starts them at 0 and
1); the biases favour the identity experts enough that top-3 picks some of both kinds. fused: the stacked expert
layout (`save_original_format=False`).
"""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 96
EXPERTS = 4
ZERO_EXPERTS = 4


def hf_config(**overrides):
    from transformers import LongcatFlashConfig

    return LongcatFlashConfig(**(dict(
        vocab_size=VOCAB, hidden_size=32, num_layers=2, num_attention_heads=4, ffn_hidden_size=48,
        q_lora_rank=16, kv_lora_rank=8, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=6, head_dim=4,
        moe_topk=3, n_routed_experts=EXPERTS, zero_expert_num=ZERO_EXPERTS, expert_ffn_hidden_size=16,
        routed_scaling_factor=2.5, rope_parameters={"rope_type": "default", "rope_theta": 100.0},
        max_position_embeddings=256, bos_token_id=None, eos_token_id=None, pad_token_id=None, initializer_range=0.15,
        tie_word_embeddings=False) | overrides))


def write_longcat_checkpoint(out: Path, seed: int = 0, fused: bool = False, **overrides) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(**overrides))
    with torch.no_grad():
        for name, param in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith("norm.weight"):
                param.add_(torch.randn_like(param) * 0.2)
            elif name.endswith("e_score_correction_bias"):
                param.copy_(torch.randn_like(param) * 0.1)
    model.save_pretrained(out, **({"save_original_format": False} if fused else {}))
    return out
