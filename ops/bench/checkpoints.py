"""Synthetic checkpoints for the benchmarks and the tests: random weights in the formats expertmesh and
`transformers` both read, shaped like the MoE layers people serve, at sizes a CPU box runs.

  mixtral        the original benchmark model (MIXTRAL): 8 experts, top-2, hidden 1024, 4 layers
  qwen3-30b-a3b  Qwen3-30B-A3B's MoE: 128 experts, top-8, normalised top-k; hidden 256 with the model's ratio of
                 expert width to hidden size (768 / 2048)
  deepseek-v3    DeepSeek-V3's MoE: 256 experts, top-8; hidden 256, expert width ratio 2048 / 7168

mixtral is written directly with safetensors (`write_bench_checkpoint`); qwen3-30b-a3b in the OLMoE format
(per-expert names, softmax top-k, q/k norm; the same MoE arithmetic as Qwen3-MoE's); deepseek-v3 is a
DeepseekV3ForCausalLM checkpoint saved by `transformers` itself (grouped sigmoid routing, MLA, a shared expert). All
are families expertmesh and `transformers` read, so η compares like with like. A benchmark's parameters carry the
model dict, so a test passes a smaller one (`dict(MIXTRAL, hidden=64, ...)`) instead of patching a global.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

# `expertmesh bench dispatch`'s Mixtral-like model; chunked, context, offload and serve's "mid" use it too.
MIXTRAL: dict = dict(hidden=1024, inter=2816, experts=8, top_k=2, layers=4, heads=16, kv_heads=4, vocab=4096,
                     format="mixtral")

SHAPES: dict[str, dict] = {
    "mixtral": MIXTRAL,
    "qwen3-30b-a3b": dict(hidden=256, inter=96, experts=128, top_k=8, layers=4, heads=8, kv_heads=4, vocab=4096,
                          norm_topk_prob=True),
    # The DeepSeek-V3 family itself: MLA attention, sigmoid scores with e_score_correction_bias, n_group=8 /
    # topk_group=4 group-limited top-8, routed_scaling_factor 2.5, one shared expert, the first layer dense.
    "deepseek-v3": dict(hidden=256, inter=72, experts=256, top_k=8, layers=4, heads=8, kv_heads=8, vocab=4096,
                        norm_topk_prob=True, format="deepseek_v3", n_group=8, topk_group=4, first_dense=1,
                        kv_lora_rank=64, q_lora_rank=96, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32),
}


def write_olmoe_checkpoint(out: Path, m: dict, seed: int = 0) -> Path:
    """Random OLMoE-format weights of shape `m` (a SHAPES entry), one safetensors file + config.json."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    head_dim = m["hidden"] // m["heads"]

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.02

    h, q_dim, kv_dim = m["hidden"], m["heads"] * head_dim, m["kv_heads"] * head_dim
    tensors = {"model.embed_tokens.weight": rand(m["vocab"], h), "model.norm.weight": torch.ones(h),
               "lm_head.weight": rand(m["vocab"], h)}
    for i in range(m["layers"]):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": torch.ones(h), p + "post_attention_layernorm.weight": torch.ones(h),
            p + "self_attn.q_proj.weight": rand(q_dim, h), p + "self_attn.k_proj.weight": rand(kv_dim, h),
            p + "self_attn.v_proj.weight": rand(kv_dim, h), p + "self_attn.o_proj.weight": rand(h, q_dim),
            p + "self_attn.q_norm.weight": torch.ones(q_dim), p + "self_attn.k_norm.weight": torch.ones(kv_dim),
            p + "mlp.gate.weight": rand(m["experts"], h) * 5,  # visibly uneven routing
        }
        for e in range(m["experts"]):
            q = f"{p}mlp.experts.{e}."
            tensors |= {q + "gate_proj.weight": rand(m["inter"], h), q + "up_proj.weight": rand(m["inter"], h),
                        q + "down_proj.weight": rand(h, m["inter"])}
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"))
    config = {
        "architectures": ["OlmoeForCausalLM"], "model_type": "olmoe", "vocab_size": m["vocab"], "hidden_size": h,
        "intermediate_size": m["inter"], "num_hidden_layers": m["layers"], "num_attention_heads": m["heads"],
        "num_key_value_heads": m["kv_heads"], "num_experts": m["experts"], "num_experts_per_tok": m["top_k"],
        "norm_topk_prob": m["norm_topk_prob"], "rms_norm_eps": 1e-5, "rope_theta": 1e4,
        "max_position_embeddings": 1024, "hidden_act": "silu", "tie_word_embeddings": False, "clip_qkv": None,
        "attention_bias": False, "output_router_logits": False, "torch_dtype": "float32", "bos_token_id": 1,
        "eos_token_id": 2, "pad_token_id": 0,
    }
    (out / "config.json").write_text(json.dumps(config))
    return out


def write_shape_checkpoint(out: Path, m: dict, seed: int = 0) -> Path:
    """The checkpoint of a SHAPES entry (or any model dict of that form), in its format."""
    if m.get("format") == "mixtral":
        return write_bench_checkpoint(out, m, seed)
    if m.get("format") == "deepseek_v3":
        return write_deepseek_v3_checkpoint(out, m, seed)
    return write_olmoe_checkpoint(out, m, seed)


def write_deepseek_v3_checkpoint(out: Path, m: dict, seed: int = 0) -> Path:
    """A random DeepseekV3ForCausalLM of shape `m`, saved by transformers (per-expert names, as published)."""
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    config = DeepseekV3Config(
        vocab_size=m["vocab"], hidden_size=m["hidden"], intermediate_size=4 * m["hidden"],
        moe_intermediate_size=m["inter"], num_hidden_layers=m["layers"], num_attention_heads=m["heads"],
        num_key_value_heads=m["kv_heads"], n_shared_experts=1, n_routed_experts=m["experts"],
        num_experts_per_tok=m["top_k"], n_group=m["n_group"], topk_group=m["topk_group"],
        first_k_dense_replace=m["first_dense"], routed_scaling_factor=2.5, norm_topk_prob=m["norm_topk_prob"],
        kv_lora_rank=m["kv_lora_rank"], q_lora_rank=m["q_lora_rank"], qk_nope_head_dim=m["qk_nope_head_dim"],
        qk_rope_head_dim=m["qk_rope_head_dim"], v_head_dim=m["v_head_dim"], max_position_embeddings=1024,
        rms_norm_eps=1e-5, rope_theta=1e4, tie_word_embeddings=False, initializer_range=0.02, bos_token_id=1,
        eos_token_id=2, pad_token_id=0,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers[m["first_dense"]:]:
            layer.mlp.gate.weight.mul_(5.0)  # visibly uneven routing, as the other shapes
            layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.01)
    model.save_pretrained(out)
    return out


def write_bench_checkpoint(out: Path, model: dict = MIXTRAL, seed: int = 0, max_positions: int = 1024,
                           layers: int | None = None) -> Path:
    """Random Mixtral weights of shape `model` (default: the benchmark's, ~1.1 GB), written shard-free with
    safetensors (fast). max_positions: config.json's max_position_embeddings (long-context benchmarks raise it);
    layers: fewer (or more) layers than the model's."""
    from safetensors.torch import save_file

    m = model if layers is None else dict(model, layers=layers)
    gen = torch.Generator().manual_seed(seed)
    head_dim = m["hidden"] // m["heads"]

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.02

    tensors = {"model.embed_tokens.weight": rand(m["vocab"], m["hidden"]),
               "model.norm.weight": torch.ones(m["hidden"]), "lm_head.weight": rand(m["vocab"], m["hidden"])}
    for i in range(m["layers"]):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": torch.ones(m["hidden"]),
            p + "post_attention_layernorm.weight": torch.ones(m["hidden"]),
            p + "self_attn.q_proj.weight": rand(m["heads"] * head_dim, m["hidden"]),
            p + "self_attn.k_proj.weight": rand(m["kv_heads"] * head_dim, m["hidden"]),
            p + "self_attn.v_proj.weight": rand(m["kv_heads"] * head_dim, m["hidden"]),
            p + "self_attn.o_proj.weight": rand(m["hidden"], m["heads"] * head_dim),
            p + "block_sparse_moe.gate.weight": rand(m["experts"], m["hidden"]) * 5,  # visibly uneven routing
        }
        for e in range(m["experts"]):
            q = f"{p}block_sparse_moe.experts.{e}."
            tensors |= {q + "w1.weight": rand(m["inter"], m["hidden"]), q + "w3.weight": rand(m["inter"], m["hidden"]),
                        q + "w2.weight": rand(m["hidden"], m["inter"])}
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"))
    config = {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": m["vocab"],
        "hidden_size": m["hidden"], "intermediate_size": m["inter"], "num_hidden_layers": m["layers"],
        "num_attention_heads": m["heads"], "num_key_value_heads": m["kv_heads"], "num_local_experts": m["experts"],
        "num_experts_per_tok": m["top_k"], "rms_norm_eps": 1e-5, "rope_theta": 1e6,
        "max_position_embeddings": max_positions,
        "hidden_act": "silu", "tie_word_embeddings": False, "sliding_window": None, "torch_dtype": "float32",
    }
    (out / "config.json").write_text(json.dumps(config))
    return out
