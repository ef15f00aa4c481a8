"""plan-cluster memory figures for Llama 4 text: bytes from the name map equal the tiny checkpoints' tensors (the
multimodal wrapper's text part only), the CLI runs on both, and the published Scout and Maverick text configs give
the parameter count transformers' own Llama4ForCausalLM has (built on the meta device: no memory)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors import safe_open

from expertmesh.cluster.memory_plan import model_memory
from expertmesh.experts.checkpoint import CheckpointReader
from expertmesh.experts.config import config_from_dict
from expertmesh.ops.cli import main
from tests.tiny_llama4 import write_llama4_checkpoint

KINDS = ("scout", "maverick", "wrapper")


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("llama4_mem")
    return {kind: write_llama4_checkpoint(root / kind, "scout" if kind == "wrapper" else kind, seed=3,
                                          wrapper=kind == "wrapper") for kind in KINDS}


@pytest.mark.parametrize("kind", KINDS)
def test_model_bytes_equal_the_checkpoint_tensors(folders, kind):
    folder = folders[kind]
    cfg = CheckpointReader(folder).config
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        # the wrapper's vision tower and projector are not served: only its language_model. tensors count
        stored = sum(math.prod(f.get_slice(key).get_shape()) for key in f.keys() if key.startswith(cfg.weight_prefix))
    mem = model_memory(cfg, "float32")
    assert mem.total_bytes == 4 * stored  # every stored text tensor counted once (Maverick's tied lm_head is not)
    assert mem.moe_layers == len(cfg.moe_layers) and mem.experts == cfg.num_experts
    assert mem.kv_bytes_per_token == cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4


@pytest.mark.parametrize("kind", KINDS)
def test_plan_cluster_cli_on_each_variant(folders, kind, capsys):
    assert main(["plan-cluster", "--model", str(folders[kind]), "--gpu-type", "L4", "--gpus-per-node", "4",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["family"] == "llama4" and out["fits"][0]["expert_gpus"] >= 1


SCOUT = {  # the published text_config values that size the model (Llama-4-Scout-17B-16E)
    "vocab_size": 202048, "hidden_size": 5120, "intermediate_size": 8192, "intermediate_size_mlp": 16384,
    "num_hidden_layers": 48, "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128,
    "num_local_experts": 16, "num_experts_per_tok": 1, "interleave_moe_layer_step": 1, "attention_chunk_size": 8192,
    "use_qk_norm": True, "tie_word_embeddings": False, "max_position_embeddings": 10485760,
    "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 16.0, "low_freq_factor": 1.0,
                        "high_freq_factor": 1.0, "original_max_position_embeddings": 8192},
}
MAVERICK = SCOUT | {"num_local_experts": 128, "interleave_moe_layer_step": 2, "use_qk_norm": False,
                    "max_position_embeddings": 1048576}  # Llama-4-Maverick-17B-128E


@pytest.mark.parametrize("name,raw,billions", [("Scout", SCOUT, 107.77), ("Maverick", MAVERICK, 400.71)])
def test_published_configs_give_transformers_parameter_count(name, raw, billions):
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    wrapped = {"architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4", "text_config": raw}
    mem = model_memory(config_from_dict(wrapped), "bfloat16")
    with torch.device("meta"):
        hf = Llama4ForCausalLM(Llama4TextConfig(**raw))
    assert mem.total_bytes == 2 * sum(p.numel() for p in hf.parameters())
    assert mem.total_bytes / 2 / 1e9 == pytest.approx(billions, abs=0.01)  # the text part (vision tower not served)
