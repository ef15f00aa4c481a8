"""plan-cluster memory figures for Kimi-Linear: bytes from the name map equal the tiny checkpoints' tensors (both
layouts), the KV bytes per token count only the MLA layers (latent + rope key), the state per sequence equals what
the decoder's state cache allocates, and transformers' default config (Kimi-Linear-48B-A3B's size) gives the
parameter count its own model has (built on the meta device: no memory)."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors import safe_open

from expertmesh.cluster.memory_plan import model_memory
from expertmesh.experts.checkpoint import CheckpointReader
from expertmesh.experts.config import config_from_dict
from expertmesh.experts.reference import load_reference_model
from tests.tiny_kimi_linear import KINDS, write_kimi_linear_checkpoint


@pytest.mark.parametrize("kind", KINDS)
def test_model_bytes_equal_the_checkpoint_tensors(tmp_path, kind):
    folder = write_kimi_linear_checkpoint(tmp_path / kind, kind, seed=4)
    cfg = CheckpointReader(folder).config
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        stored = sum(math.prod(f.get_slice(key).get_shape()) for key in f.keys())
    mem = model_memory(cfg, "float32")
    assert mem.total_bytes == 4 * stored
    assert mem.kv_bytes_per_token == 1 * (16 + 4) * 4  # one MLA layer: latent 16 + rope key 4
    model = load_reference_model(folder)
    assert mem.state_bytes_per_sequence == model.kv_pool.states.nbytes() // model.kv_pool.states.slots
    assert model_memory(cfg, "bfloat16").state_bytes_per_sequence == 3 * (96 * 3 * 2 + 4 * 8 * 8 * 4)


def test_published_size_gives_transformers_parameter_count():
    """transformers' default KimiLinearConfig is Kimi-Linear-48B-A3B's size."""
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    hf_cfg = KimiLinearConfig()
    cfg = config_from_dict(hf_cfg.to_dict() | {"architectures": ["KimiLinearForCausalLM"]})
    mem = model_memory(cfg, "bfloat16")
    with torch.device("meta"):
        hf = KimiLinearForCausalLM(hf_cfg)
    assert mem.total_bytes == 2 * sum(t.numel() for t in hf.state_dict().values())
    assert mem.total_bytes / 2 / 1e9 == pytest.approx(49.13, abs=0.01)
    # transformers' default layout: 21 KDA layers of 32 heads x 128 x 128 float32 plus 3 x 4096 conv channels x 3
    # inputs; 6 MLA layers (4, 8, .., 24) of 512 + 64 per token
    assert len(cfg.linear_layers) == 21 and mem.state_bytes_per_sequence == 21 * (3 * 4096 * 3 * 2 + 32 * 128 * 128 * 4)
    assert mem.kv_bytes_per_token == 6 * (512 + 64) * 2
