"""plan-cluster memory figures for Qwen3-Next and Qwen3.5-MoE: bytes from the name map equal the tiny checkpoints'
tensors (the VL wrapper's text part only), the KV bytes per token count only the full-attention layers, the state
per sequence equals what the decoder's state cache allocates, the CLI reports it, and transformers' default
configs (the published Qwen3-Next-80B-A3B and Qwen3.5-35B-A3B sizes) give the parameter count its own models have
(built on the meta device: no memory)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors import safe_open

from expertmesh.cluster.memory_plan import model_memory
from expertmesh.experts.checkpoint import CheckpointReader
from expertmesh.experts.config import config_from_dict
from expertmesh.experts.reference import load_reference_model
from expertmesh.ops.cli import main
from tests.tiny_qwen3_next import KINDS, write_qwen3_next_checkpoint


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("qwen3_next_mem")
    return {kind: write_qwen3_next_checkpoint(root / kind, kind, seed=4) for kind in KINDS}


@pytest.mark.parametrize("kind", KINDS)
def test_model_bytes_equal_the_checkpoint_tensors(folders, kind):
    folder = folders[kind]
    cfg = CheckpointReader(folder).config
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        # the VL wrapper's vision tower is not served: only the text model's tensors and lm_head count
        stored = sum(math.prod(f.get_slice(key).get_shape()) for key in f.keys()
                     if key.startswith(cfg.weight_prefix) or key == "lm_head.weight")
    mem = model_memory(cfg, "float32")
    assert mem.total_bytes == 4 * stored
    assert mem.kv_bytes_per_token == 1 * 2 * cfg.num_kv_heads * cfg.head_dim * 4  # one full-attention layer
    model = load_reference_model(folder)
    assert mem.state_bytes_per_sequence == model.kv_pool.states.nbytes() // model.kv_pool.states.slots
    assert model_memory(cfg, "bfloat16").state_bytes_per_sequence == 3 * (56 * 3 * 2 + 4 * 8 * 6 * 4)


def test_plan_cluster_cli_reports_the_state(folders, capsys):
    assert main(["plan-cluster", "--model", str(folders["qwen3_5_vl"]), "--gpu-type", "L4", "--gpus-per-node", "4",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["family"] == "qwen3_5_moe" and out["fits"][0]["expert_gpus"] >= 1
    state = model_memory(CheckpointReader(folders["qwen3_5_vl"]).config, "bfloat16").state_bytes_per_sequence
    assert out["state_bytes_per_sequence"] == state and out["state_sequences_in_kv_budget"] == 4 * (1 << 30) // state
    assert main(["plan-cluster", "--model", str(folders["next"]), "--gpu-type", "L4", "--gpus-per-node", "4"]) == 0
    assert "linear-attention state" in capsys.readouterr().out


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_moe"])
def test_published_sizes_give_transformers_parameter_count(family):
    """transformers' default configs are the published models' sizes (Qwen3-Next-80B-A3B, Qwen3.5-35B-A3B)."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig, Qwen3NextConfig, Qwen3NextForCausalLM

    config_cls, model_cls, arch = {
        "qwen3_next": (Qwen3NextConfig, Qwen3NextForCausalLM, "Qwen3NextForCausalLM"),
        "qwen3_5_moe": (Qwen3_5MoeTextConfig, Qwen3_5MoeForCausalLM, "Qwen3_5MoeForCausalLM")}[family]
    hf_cfg = config_cls()
    mem = model_memory(config_from_dict(hf_cfg.to_dict() | {"architectures": [arch]}), "bfloat16")
    with torch.device("meta"):
        hf = model_cls(hf_cfg)
    assert mem.total_bytes == 2 * sum(t.numel() for t in hf.state_dict().values())
    billions = mem.total_bytes / 2 / 1e9
    assert billions == pytest.approx({"qwen3_next": 79.67, "qwen3_5_moe": 34.66}[family], abs=0.01)
    # the state per sequence: 36 / 30 DeltaNet layers of 32 value heads x 128 x 128 float32, plus the conv inputs
    layers = {"qwen3_next": 36, "qwen3_5_moe": 30}[family]
    assert mem.state_bytes_per_sequence == layers * ((2 * 2048 + 4096) * 3 * 2 + 32 * 128 * 128 * 4)
