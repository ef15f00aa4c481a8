"""plan-cluster memory figures for DeepSeek-V3.2 and GLM-5: bytes from the name map equal the tiny checkpoints'
tensors (the indexers included, GLM-5's shared layers without one, MTP layers not served), the KV bytes per token
equal what the decoder's paged pool stores per token (MLA latent + rope key + the indexer's key), the CLI plans
them, and transformers' default configs (the published DeepSeek-V3.2 and GLM-5 sizes) give the parameter count of
transformers' own models (built on the meta device: no memory)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors import safe_open

from expertmesh.cluster.memory_plan import model_memory
from expertmesh.experts.checkpoint import CheckpointReader
from expertmesh.experts.config import config_from_dict
from expertmesh.experts.kv_cache import PagedKVPool
from expertmesh.experts.reference import load_reference_model
from expertmesh.ops.cli import main
from tests.tiny_deepseek import DSA_KINDS, write_deepseek_checkpoint


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("dsa_mem")
    return {kind: write_deepseek_checkpoint(kind, root / kind, seed=4) for kind in DSA_KINDS}


@pytest.mark.parametrize("kind", DSA_KINDS)
def test_model_bytes_and_kv_per_token_equal_the_checkpoint_and_the_pool(folders, kind):
    folder = folders[kind]
    cfg = CheckpointReader(folder).config
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        stored = sum(math.prod(f.get_slice(key).get_shape()) for key in f.keys())
    mem = model_memory(cfg, "float32")
    assert mem.total_bytes == 4 * stored
    model = load_reference_model(folder)
    assert mem.kv_bytes_per_token == PagedKVPool.bytes_per_token(model.cache_specs(), torch.float32)
    indexers = {"deepseek_v32": 3, "glm_moe_dsa": 2}[kind]
    assert mem.kv_bytes_per_token == (cfg.num_layers * (16 + 8) + indexers * 16) * 4


def test_plan_cluster_cli_plans_glm5(folders, capsys):
    assert main(["plan-cluster", "--model", str(folders["glm_moe_dsa"]), "--gpu-type", "L4", "--gpus-per-node", "4",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["family"] == "glm_moe_dsa" and out["fits"][0]["expert_gpus"] >= 1


@pytest.mark.parametrize("family", ["deepseek_v32", "glm_moe_dsa"])
def test_published_sizes_give_transformers_parameter_count(family):
    from transformers import DeepseekV32Config, DeepseekV32ForCausalLM, GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    config_cls, model_cls, arch = {
        "deepseek_v32": (DeepseekV32Config, DeepseekV32ForCausalLM, "DeepseekV32ForCausalLM"),
        "glm_moe_dsa": (GlmMoeDsaConfig, GlmMoeDsaForCausalLM, "GlmMoeDsaForCausalLM")}[family]
    hf_cfg = config_cls()
    cfg = config_from_dict(hf_cfg.to_dict() | {"architectures": [arch]})
    mem = model_memory(cfg, "bfloat16")
    with torch.device("meta"):
        hf = model_cls(hf_cfg)
    assert mem.total_bytes == 2 * sum(t.numel() for t in hf.state_dict().values())
    billions = mem.total_bytes / 2 / 1e9  # without the MTP layer, which is not served
    assert billions == pytest.approx({"deepseek_v32": 671.88, "glm_moe_dsa": 743.91}[family], abs=0.01)
    # per token and layer: 512 latent + 64 rope key + 128 index key (every layer full by default), bf16
    assert mem.kv_bytes_per_token == cfg.num_layers * (512 + 64 + 128) * 2
