"""Tiny Llama 4 text checkpoints for tests, saved by `transformers` itself (Llama4ForCausalLM, or the multimodal
Llama4ForConditionalGeneration whose text tensors sit under `language_model.`).

Default ("scout"-like): 4 layers of hidden 32, 4 experts top-1, MoE on layers 0, 2, 3 (layer 1 a dense MLP), RoPE
on layers 0 and 2 with chunked attention (chunk 8) and q/k L2 norm, NoPE layers 1 and 3 with attention temperature
tuning that changes the query scale from position 3 on (floor_scale 4), llama3 RoPE scaling whose bands all matter
at head_dim 8. "maverick"-like: MoE on every other layer (interleave_moe_layer_step 2), no q/k norm, q/k/v/o biases,
tied embeddings, default RoPE. Norm weights and biases are drawn at random (transformers starts them at 1 and 0).
"""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 96
CHUNK = 8
VARIANTS = ("scout", "maverick")


def text_config_kwargs(variant: str = "scout", **overrides) -> dict:
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=16, intermediate_size_mlp=24,
                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  num_local_experts=4, num_experts_per_tok=1, attention_chunk_size=CHUNK, no_rope_layer_interval=2,
                  floor_scale=4, attn_scale=0.5, max_position_embeddings=256, initializer_range=0.15,
                  bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if variant == "scout":
        extra = dict(moe_layers=[0, 2, 3], use_qk_norm=True, tie_word_embeddings=False,
                     rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 16})
    elif variant == "maverick":
        extra = dict(interleave_moe_layer_step=2, use_qk_norm=False, attention_bias=True, tie_word_embeddings=True,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    else:
        raise ValueError(variant)
    return common | extra | overrides


def hf_text_config(variant: str = "scout", **overrides):
    from transformers import Llama4TextConfig

    return Llama4TextConfig(**text_config_kwargs(variant, **overrides))


def _perturb(model) -> None:
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(torch.randn_like(param) * 0.2)
            elif name.endswith("proj.bias"):
                param.normal_(0.0, 0.3)


def write_llama4_checkpoint(out: Path, variant: str = "scout", seed: int = 0, wrapper: bool = False,
                            **overrides) -> Path:
    """save_pretrained a random Llama 4 text model into `out`; wrapper: as Llama4ForConditionalGeneration with a
    one-layer vision tower (only its text part is read)."""
    from transformers import Llama4Config, Llama4ForCausalLM, Llama4ForConditionalGeneration

    torch.manual_seed(seed)
    if wrapper:
        vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                      patch_size=14, vision_output_dim=16, projector_input_dim=16, projector_output_dim=16)
        model = Llama4ForConditionalGeneration(Llama4Config(text_config=text_config_kwargs(variant, **overrides),
                                                            vision_config=vision))
    else:
        model = Llama4ForCausalLM(hf_text_config(variant, **overrides))
    _perturb(model)
    model.save_pretrained(out)
    return out


def load_hf(folder: Path, dtype: torch.dtype = torch.float32):
    """The transformers model of a tiny checkpoint (text or wrapper), eval mode."""
    import json

    from transformers import Llama4ForCausalLM, Llama4ForConditionalGeneration

    arch = json.loads((Path(folder) / "config.json").read_text())["architectures"][0]
    cls = Llama4ForConditionalGeneration if arch == "Llama4ForConditionalGeneration" else Llama4ForCausalLM
    return cls.from_pretrained(folder, dtype=dtype).eval()
