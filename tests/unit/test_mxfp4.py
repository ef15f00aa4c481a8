"""MXFP4 expert weights (gpt-oss's published format): our dequantisation equals transformers' own, bit for bit, both
on raw blocks and on a whole checkpoint the test quantises in the published layout."""

from __future__ import annotations

import pytest
import torch

from expertmesh.experts.checkpoint import CheckpointReader
from expertmesh.experts.mxfp4 import FP4_VALUES, dequantize, quantize
from expertmesh.experts.weights import MXFP4, check_checkpoint, expert_layout, load_expert_shards
from tests.tiny_checkpoints import write_hf_checkpoint, write_mxfp4_gpt_oss


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_equals_transformers_convert_moe_packed_tensors(dtype):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 8, 4, 16), generator=gen, dtype=torch.uint8)  # every nibble code occurs
    scales = torch.randint(100, 150, (3, 8, 4), generator=gen, dtype=torch.uint8)  # 2**-27 .. 2**22
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # [E, cols, rows]: x @ W form
    ours = dequantize(blocks, scales, dtype)  # [E, rows, cols]: F.linear form
    assert ours.dtype == dtype and ours.shape == (3, 8, 128)
    assert torch.equal(ours.transpose(1, 2), theirs)
    assert torch.equal(dequantize(blocks[2], scales[2], dtype), ours[2])  # one expert's rows alone: the same


def test_quantize_round_trips_representable_values_and_bounds_the_error():
    gen = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (5, 2, 32), generator=gen)
    powers = 2.0 ** torch.randint(-4, 4, (5, 2, 1), generator=gen)  # one scale per block of 32
    exact = (torch.tensor(FP4_VALUES)[codes] * powers).reshape(5, 64)  # representable in MXFP4
    blocks, scales = quantize(exact)
    assert blocks.shape == (5, 2, 16) and scales.shape == (5, 2) and blocks.dtype == scales.dtype == torch.uint8
    assert torch.equal(dequantize(blocks, scales, torch.float32), exact)
    w = torch.randn(4, 96, generator=gen)
    approx = dequantize(*quantize(w), torch.float32)
    step = 2.0 ** (torch.ceil(torch.log2(w.reshape(4, 3, 32).abs().amax(-1) / 6)))  # [4, 3] scale per block
    assert bool(((approx - w).reshape(4, 3, 32).abs() <= step[..., None]).all())  # within one grid step (spacing 2)


def test_mxfp4_checkpoint_loads_as_transformers_dequantises_it(tmp_path):
    from transformers import AutoModelForCausalLM, Mxfp4Config

    source = write_hf_checkpoint("gpt_oss", tmp_path / "bf", seed=3, fused=True)
    folder = write_mxfp4_gpt_oss(source, tmp_path / "mxfp4")
    reader = CheckpointReader(folder)
    assert reader.config.quantization == "mxfp4" and expert_layout(reader.config, reader.has) == MXFP4
    assert not any(n.endswith(("experts.gate_up_proj", "experts.down_proj")) for n in reader.keys())
    check_checkpoint(reader)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                              quantization_config=Mxfp4Config(dequantize=True))
    cfg = reader.config
    shards = load_expert_shards(reader, [(layer, e) for layer in cfg.moe_layers for e in range(cfg.num_experts)])
    inter = cfg.expert_intermediate_size
    for (layer, e), w in shards.items():
        experts = hf.model.layers[layer].mlp.experts
        gate_up = experts.gate_up_proj[e]  # [H, 2I], columns alternate gate, up
        assert torch.equal(w.gate_up[:inter], gate_up[:, 0::2].t()) and torch.equal(w.gate_up[inter:],
                                                                                   gate_up[:, 1::2].t())
        assert torch.equal(w.down, experts.down_proj[e].t())
        assert torch.equal(w.down_bias, experts.down_proj_bias[e])
    # and the quantisation changed the weights (the test would not notice a loader that read the float originals)
    original = load_expert_shards(CheckpointReader(source), [(0, 0)])[(0, 0)]
    assert not torch.equal(original.gate_up, shards[(0, 0)].gate_up)


def test_bf16_serving_dtype(tmp_path):
    source = write_hf_checkpoint("gpt_oss", tmp_path / "bf", seed=3)
    folder = write_mxfp4_gpt_oss(source, tmp_path / "mxfp4")
    w32 = load_expert_shards(CheckpointReader(folder), [(1, 2)])[(1, 2)]
    w16 = load_expert_shards(CheckpointReader(folder), [(1, 2)], dtype=torch.bfloat16)[(1, 2)]
    assert w16.gate_up.dtype == torch.bfloat16 and w16.gate_up_bias.dtype == torch.bfloat16
    assert torch.equal(w16.gate_up.float(), w32.gate_up)  # FP4 times a power of two is exact in bf16


def test_mxfp4_sizes_must_be_whole_blocks():
    from expertmesh.experts.config import config_from_dict
    from expertmesh.experts.errors import CheckpointError
    from expertmesh.experts.weights import fused_tensor_names

    raw = {"architectures": ["GptOssForCausalLM"], "vocab_size": 96, "hidden_size": 48, "intermediate_size": 32,
           "num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 16, "num_local_experts": 4,
           "num_experts_per_tok": 2, "quantization_config": {"quant_method": "mxfp4"}}
    with pytest.raises(CheckpointError, match="'hidden_size'=48 must be a multiple of 32"):
        fused_tensor_names(config_from_dict(raw), 0, MXFP4)
