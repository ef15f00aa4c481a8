"""plan-cluster memory figures for MiniMax-M2 (incl. its FP8 files), ERNIE 4.5 MoE (tied embeddings, dense layers,
shared experts) and Hunyuan-A13B (shared MLP): bytes from the name map equal the tiny checkpoints' tensors, the CLI
runs on each, and the published configs give the published parameter counts."""

from __future__ import annotations

import json
import math

import pytest
from safetensors import safe_open

from expertmesh.cluster.memory_plan import model_memory
from expertmesh.experts.checkpoint import CheckpointReader
from expertmesh.experts.config import config_from_dict
from expertmesh.ops.cli import main
from tests.tiny_fam1 import KINDS, write_fam1_checkpoint


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("fam1_mem")
    return {kind: write_fam1_checkpoint(kind, root / kind, seed=3) for kind in KINDS}


@pytest.mark.parametrize("kind", KINDS)
def test_model_bytes_equal_the_checkpoint_tensors(folders, kind):
    folder = folders[kind]
    cfg = CheckpointReader(folder).config
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        stored = sum(math.prod(f.get_slice(key).get_shape()) for key in f.keys())
    mem = model_memory(cfg, "float32")
    assert mem.total_bytes == 4 * stored  # every stored tensor counted once (ERNIE's tied lm_head is not stored)
    assert mem.moe_layers == len(cfg.moe_layers) and mem.experts == cfg.num_experts
    assert mem.kv_bytes_per_token == cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4


@pytest.mark.parametrize("kind", KINDS)
def test_plan_cluster_cli_on_each_family(folders, kind, capsys):
    assert main(["plan-cluster", "--model", str(folders[kind]), "--gpu-type", "L4", "--gpus-per-node", "4",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["family"] == kind and out["fits"][0]["expert_gpus"] >= 1


PUBLISHED = {  # the published config.json values that size the model
    "MiniMax-M2": ({"architectures": ["MiniMaxM2ForCausalLM"], "vocab_size": 200064, "hidden_size": 3072,
                    "intermediate_size": 1536, "num_hidden_layers": 62, "num_attention_heads": 48,
                    "num_key_value_heads": 8, "head_dim": 128, "num_local_experts": 256, "num_experts_per_tok": 8,
                    "rotary_dim": 64, "rope_theta": 5000000, "tie_word_embeddings": False,
                    "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}, 228.7),
    "ERNIE-4.5-21B-A3B": ({"architectures": ["Ernie4_5_MoeForCausalLM"], "vocab_size": 103424, "hidden_size": 2560,
                           "intermediate_size": 12288, "num_hidden_layers": 28, "num_attention_heads": 20,
                           "num_key_value_heads": 4, "head_dim": 128, "moe_intermediate_size": 1536, "moe_k": 6,
                           "moe_num_experts": 64, "moe_num_shared_experts": 2, "moe_layer_start_index": 1,
                           "moe_layer_end_index": 27, "moe_layer_interval": 1, "rope_theta": 500000,
                           "tie_word_embeddings": True}, 21.8),
    "Hunyuan-A13B": ({"architectures": ["HunYuanMoEV1ForCausalLM"], "vocab_size": 128167, "hidden_size": 4096,
                      "intermediate_size": 3072, "moe_intermediate_size": [3072] * 32, "num_hidden_layers": 32,
                      "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "num_experts": 64,
                      "moe_topk": [8] * 32, "num_shared_expert": [1] * 32, "rope_theta": 10000.0,
                      "rope_scaling": {"type": "dynamic", "alpha": 1000.0, "factor": 1.0},
                      "tie_word_embeddings": True}, 80.4),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_configs_give_the_published_sizes(name):
    raw, billions = PUBLISHED[name]
    mem = model_memory(config_from_dict(raw), "bfloat16")
    assert mem.total_bytes / 2 / 1e9 == pytest.approx(billions, abs=0.05)
