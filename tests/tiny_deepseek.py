"""Tiny DeepSeek-V2/V3 and GLM-4.5 checkpoints for tests, saved by `transformers` itself.

Each has 3 layers (layer 0 dense: first_k_dense_replace=1), 8-16 routed experts in groups, shared experts; V3 uses
YaRN with mscale. Options add what published checkpoints carry: multi-token-prediction layers
(`model.layers.{num_hidden_layers}.*`, which transformers itself never writes) and block-scaled FP8 weights
(`weight_scale_inv`, quantised with the published recipe, `quantization_config.quant_method = "fp8"`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

VOCAB = 96
KINDS = ("deepseek_v2", "deepseek_v2_lora", "deepseek_v2_grouped", "deepseek_v3", "glm4_moe")
DSA_KINDS = ("deepseek_v32", "glm_moe_dsa")  # MLA + DSA indexer; index_topk 8, so prompts past 8 tokens select
# The indexer's shape in the tiny DSA checkpoints: 8 heads keep the score of a key exactly 0 (every head's ReLU
# zero, a tie topk could break either way) rare.
DSA = dict(index_topk=8, index_head_dim=16, index_n_heads=8)


def hf_config(kind: str, **overrides):
    from transformers import DeepseekV2Config, DeepseekV3Config, DeepseekV32Config, Glm4MoeConfig, GlmMoeDsaConfig

    common = dict(vocab_size=VOCAB, hidden_size=48, num_hidden_layers=3, num_attention_heads=4,
                  max_position_embeddings=256, initializer_range=0.15, eos_token_id=None, bos_token_id=None,
                  pad_token_id=None, tie_word_embeddings=False, intermediate_size=64, moe_intermediate_size=16,
                  first_k_dense_replace=1)
    mla = dict(kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12)
    if kind.startswith("deepseek_v2"):
        extra = dict(n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=2, routed_scaling_factor=1.5,
                     q_lora_rank=24 if kind == "deepseek_v2_lora" else None, **mla)
        if kind == "deepseek_v2_grouped":
            extra |= dict(n_routed_experts=16, num_experts_per_tok=3, topk_method="group_limited_greedy",
                          n_group=4, topk_group=2)
        return DeepseekV2Config(**(common | extra | overrides))
    if kind == "deepseek_v3":
        yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
                "mscale": 0.9, "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1}
        return DeepseekV3Config(**(common | mla | dict(
            n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=4, n_group=4, topk_group=2,
            q_lora_rank=24, routed_scaling_factor=2.5, norm_topk_prob=True, rope_parameters=yarn) | overrides))
    if kind == "deepseek_v32":
        yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
                "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}
        return DeepseekV32Config(**(common | mla | DSA | dict(
            n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=4, n_group=4, topk_group=2,
            q_lora_rank=24, routed_scaling_factor=2.5, norm_topk_prob=True, rope_parameters=yarn) | overrides))
    if kind == "glm_moe_dsa":  # layer 1 "shared": reuses layer 0's top-k
        return GlmMoeDsaConfig(**(common | mla | DSA | dict(
            num_hidden_layers=4, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=1,
            topk_group=1, q_lora_rank=24, routed_scaling_factor=1.5, rms_norm_eps=1e-5,
            indexer_types=["full", "shared", "full", "shared"]) | overrides))
    if kind == "glm4_moe":
        return Glm4MoeConfig(**(common | dict(
            n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
            num_key_value_heads=2, attention_bias=True, use_qk_norm=True, partial_rotary_factor=0.5,
            routed_scaling_factor=1.5, norm_topk_prob=True) | overrides))
    raise ValueError(kind)


def write_deepseek_checkpoint(kind: str, out: Path, seed: int = 0, mtp: bool = False,
                              fp8_block: tuple[int, int] | None = None, fused: bool = False, **overrides) -> Path:
    """save_pretrained a random `kind` model into `out`. Random correction biases and norm weights (transformers
    initialises them to 0 and 1, which would hide a missing bias or norm). mtp adds one MTP layer's tensors;
    fp8_block quantises every linear weight but the router gate, embeddings and lm_head. fused: transformers'
    stacked expert layout (`save_original_format=False`)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(kind, **overrides))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("k_norm.bias"):
                param.add_(torch.randn_like(param) * 0.2)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn_like(buf) * 0.3)
    model.save_pretrained(out, **({"save_original_format": False} if fused else {}))
    if mtp or fp8_block:
        _rewrite(out, model.config.num_hidden_layers, mtp, fp8_block)
    return out


def _rewrite(out: Path, num_layers: int, mtp: bool, fp8_block: tuple[int, int] | None) -> None:
    from safetensors.torch import load_file, save_file

    from expertmesh.experts.fp8 import quantize

    path = out / "model.safetensors"
    tensors = load_file(str(path))
    if mtp:  # DeepSeek-V3's MTP module: a full decoder layer plus its own norms and projection
        last = f"model.layers.{num_layers - 1}."
        extra = {k.replace(last, f"model.layers.{num_layers}."): torch.randn_like(v)
                 for k, v in tensors.items() if k.startswith(last)}
        hidden = tensors["model.norm.weight"].shape[0]
        p = f"model.layers.{num_layers}."
        extra |= {p + "enorm.weight": torch.ones(hidden), p + "hnorm.weight": torch.ones(hidden),
                  p + "eh_proj.weight": torch.randn(hidden, 2 * hidden),
                  p + "shared_head.norm.weight": torch.ones(hidden)}
        tensors |= extra
    if fp8_block:
        for name in list(tensors):
            t = tensors[name]
            # DeepSeek-V3.2 publishes its indexer's weights_proj in bf16 (wq_b and wk in FP8)
            if (t.dim() == 2 and name.endswith(".weight") and "norm" not in name and not name.endswith("gate.weight")
                    and "weights_proj" not in name and name not in ("model.embed_tokens.weight", "lm_head.weight")):
                tensors[name], tensors[name + "_scale_inv"] = quantize(t, fp8_block)
        config = json.loads((out / "config.json").read_text())
        config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                         "weight_block_size": list(fp8_block)}
        (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, str(path), metadata={"format": "pt"})


def hf_with_transformers_dequantisation(plain: Path, fp8: Path):
    """transformers' model of the unquantised checkpoint with every FP8 weight replaced by what transformers'
    Fp8Dequantize makes of the FP8 checkpoint (its CPU loading path needs `accelerate`, which is not installed
    here, so the dequantisation op is called directly)."""
    from safetensors.torch import load_file
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    from tests.tiny_checkpoints import load_hf_model

    hf = load_hf_model(plain)
    tensors = load_file(str(fp8 / "model.safetensors"))
    dequantised = {name[: -len("_scale_inv")]: Fp8Dequantize(None)._dequantize_one(
        tensors[name[: -len("_scale_inv")]], scale, torch.float32) for name, scale in tensors.items()
        if name.endswith("_scale_inv")}
    assert dequantised
    params = dict(hf.named_parameters())
    with torch.no_grad():
        for name, value in dequantised.items():
            if int(name.split(".")[2]) >= hf.config.num_hidden_layers if name.startswith("model.layers.") else False:
                continue  # the MTP layer: transformers has no module for it either
            if name in params:
                params[name].copy_(value)
            else:  # routed experts: transformers holds them fused, [E, 2I, H] and [E, H, I]
                layer, expert, proj = name.split(".")[2], int(name.split(".")[5]), name.split(".")[6]
                experts = hf.model.layers[int(layer)].mlp.experts
                inter = experts.down_proj.shape[-1]
                if proj == "gate_proj":
                    experts.gate_up_proj[expert, :inter].copy_(value)
                elif proj == "up_proj":
                    experts.gate_up_proj[expert, inter:].copy_(value)
                else:
                    experts.down_proj[expert].copy_(value)
    return hf, dequantised
