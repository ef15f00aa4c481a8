"""Tiny Kimi-Linear (`kimi_linear`) checkpoints for tests, saved by `transformers` itself (KimiLinearForCausalLM).

4 layers of hidden 32: layers 0, 1, 3 KDA (4 heads of 8, conv kernel 4), layer 2 MLA without RoPE (4 heads,
kv_lora_rank 16, nope 8 + rope 4 query/key dims, values of 8); layer 0 a dense MLP, 1-3 MoE with 4 experts in 2
groups (top-2 from the best group), a correction bias, one shared expert, routed_scaling_factor 2. Norm weights, A_log,
dt_bias and the correction bias are drawn at random (transformers starts the norms at 1 and the bias at 0).
Kinds: "original" (transformers' default save: block_sparse_moe, per-expert w1/w2/w3, q/k/v_conv1d) and "fused"
(save_original_format=False: mlp.experts.gate_up_proj, one conv1d, forget_gate.*).
"""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 96
KINDS = ("original", "fused")


def config_kwargs(**overrides) -> dict:
    return dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=40, moe_intermediate_size=16,
                num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
                routed_scaling_factor=2.0, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=4, v_head_dim=8,
                qk_nope_head_dim=8, n_group=2, topk_group=1, num_experts_per_tok=2, num_local_experts=4,
                linear_head_dim=8, linear_num_heads=4, linear_conv_kernel_dim=4, initializer_range=0.15,
                layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
                mlp_layer_types=["dense", "sparse", "sparse", "sparse"], max_position_embeddings=256,
                tie_word_embeddings=False, pad_token_id=None, bos_token_id=None, eos_token_id=None) | overrides


def _perturb(model) -> None:
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                param.add_(torch.randn_like(param) * 0.2)
            elif name.endswith("dt_bias"):
                param.normal_(0.0, 1.0)
            elif name.endswith("A_log"):
                param.uniform_(-1.0, 1.5)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_(0.0, 0.1)


def write_kimi_linear_checkpoint(out: Path, kind: str = "original", seed: int = 0, **overrides) -> Path:
    """save_pretrained a random model of `kind` (KINDS) into `out`."""
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    if kind not in KINDS:
        raise ValueError(kind)
    torch.manual_seed(seed)
    model = KimiLinearForCausalLM(KimiLinearConfig(**config_kwargs(**overrides)))
    _perturb(model)
    model.save_pretrained(out, **({"save_original_format": False} if kind == "fused" else {}))
    return out


def load_hf(folder: Path, dtype: torch.dtype = torch.float32):
    from transformers import KimiLinearForCausalLM

    return KimiLinearForCausalLM.from_pretrained(folder, dtype=dtype).eval()
