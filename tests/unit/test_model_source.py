"""Model sources: a folder, or a Hub repo id resolved from an offline cache (whole files pre-populated in it). What a
process downloads from an online Hub is tested against a stand-in Hub in test_hub_download.py."""

from __future__ import annotations

import json

import pytest
import torch

from expertmesh.experts.checkpoint import CheckpointReader
from expertmesh.experts.errors import CheckpointError, ConfigError
from expertmesh.experts.model_source import (
    dense_tensors,
    fetch_checkpoint,
    is_repo_id,
    open_checkpoint,
    shard_tensors,
)
from expertmesh.experts.weights import check_checkpoint, dense_tensor_names, expert_shard_names, load_expert_shards
from expertmesh.router_service.config import MeshConfig
from tests.hub_cache import populate_hub_cache


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    """An empty Hub cache, offline; yields (cache folder, list of filenames hf_hub_download was asked for)."""
    import huggingface_hub
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    asked: list[str] = []
    real = huggingface_hub.hf_hub_download

    def counting(repo_id, filename, **kwargs):
        asked.append(filename)
        return real(repo_id, filename, **kwargs)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", counting)
    return cache, asked


def _weight_map(folder) -> dict[str, str]:
    return json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]


def test_repo_ids_and_folders(tmp_path):
    assert is_repo_id("mistralai/Mixtral-8x7B-v0.1") and is_repo_id("Qwen/Qwen3-30B-A3B")
    assert not is_repo_id("/models/mixtral") and not is_repo_id("mixtral") and not is_repo_id("./a/b")
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert not is_repo_id(str(tmp_path / "org" / "name"))
    assert fetch_checkpoint(str(tmp_path)) == tmp_path


def test_whole_files_in_an_offline_cache_are_read_in_place(checkpoints, offline_hub):
    """A pre-populated cache (whole files in the snapshot): nothing is downloaded, the files are read as a folder's.
    What each process downloads online is tested against a stand-in Hub (test_hub_download.py)."""
    cache, asked = offline_hub
    folder = checkpoints["mixtral_sharded"]
    populate_hub_cache(cache, "acme/tiny-mixtral", folder)
    shards = [(1, 2), (1, 3)]
    reader = open_checkpoint("acme/tiny-mixtral", None, shard_tensors(shards))
    assert not [name for name in asked if name.endswith(".safetensors")]
    assert "config.json" in asked and "model.safetensors.index.json" in asked
    assert all(reader.remote_file(name) is None for name in expert_shard_names(reader.config, shards))
    got = load_expert_shards(reader, shards)
    want = load_expert_shards(CheckpointReader(folder), shards)
    for shard in shards:
        assert torch.equal(got[shard].gate_up, want[shard].gate_up) and torch.equal(got[shard].down, want[shard].down)


def test_an_offline_cache_needs_only_the_files_a_process_reads(checkpoints, offline_hub):
    """A node pre-populated per role: an actor's cache holds its shards' files, the router's the dense files."""
    cache, _ = offline_hub
    folder = checkpoints["mixtral_sharded"]
    weight_map = _weight_map(folder)
    shards = [(1, 2), (1, 3)]
    cfg = CheckpointReader(folder).config
    actor_files = {weight_map[name] for name in expert_shard_names(cfg, shards)}
    dense_files = {weight_map[name] for name in dense_tensor_names(cfg)}
    populate_hub_cache(cache, "acme/tiny-mixtral", folder,
                       only={"config.json", "model.safetensors.index.json"} | actor_files)
    assert load_expert_shards(open_checkpoint("acme/tiny-mixtral", None, shard_tensors(shards)), shards)
    if dense_files - actor_files:
        with pytest.raises(CheckpointError, match="acme/tiny-mixtral: model-.* is not in this node's Hugging Face"):
            open_checkpoint("acme/tiny-mixtral", None, dense_tensors)
    populate_hub_cache(cache, "acme/tiny-mixtral", folder, only=dense_files)
    router = open_checkpoint("acme/tiny-mixtral", None, dense_tensors)
    check_checkpoint(router)  # files neither whole nor with a cached header are skipped offline (their readers check)
    assert router.has("model.layers.0.block_sparse_moe.gate.weight")


def test_a_stacked_checkpoint_from_the_hub_reads_by_its_own_names(tmp_path, offline_hub):
    """transformers' stacked layout: the selectors name `mlp.experts.gate_up_proj` and Mixtral's `mlp.gate`."""
    from expertmesh.experts.weights import FUSED, expert_layout
    from tests.tiny_checkpoints import write_hf_checkpoint

    cache, _ = offline_hub
    folder = write_hf_checkpoint("mixtral", tmp_path / "fused", seed=4, max_shard_size="40KB", fused=True)
    populate_hub_cache(cache, "acme/stacked", folder)
    shards = [(1, 0), (1, 3)]
    reader = open_checkpoint("acme/stacked", None, shard_tensors(shards))
    assert expert_layout(reader.config, reader.has) == FUSED
    got, want = load_expert_shards(reader, shards), load_expert_shards(CheckpointReader(folder), shards)
    assert all(torch.equal(got[s].gate_up, want[s].gate_up) for s in shards)
    router = open_checkpoint("acme/stacked", None, dense_tensors)
    assert router.has("model.layers.0.mlp.gate.weight")


def test_a_file_missing_from_the_offline_cache_is_one_line(checkpoints, offline_hub):
    cache, _ = offline_hub
    folder = checkpoints["mixtral_sharded"]
    weight_map = _weight_map(folder)
    keep = {"config.json", "model.safetensors.index.json"} | {weight_map["model.embed_tokens.weight"]}
    populate_hub_cache(cache, "acme/partial", folder, only=keep)
    with pytest.raises(CheckpointError, match=r"acme/partial: model-\d+-of-\d+\.safetensors is not in this node's "
                                              r"Hugging Face cache"):
        open_checkpoint("acme/partial", None, shard_tensors([(0, 0), (1, 3)]))
    with pytest.raises(CheckpointError, match="acme/absent: config.json is not in this node's Hugging Face cache"):
        fetch_checkpoint("acme/absent")


def test_revisions_resolve_through_the_cache_refs(checkpoints, offline_hub):
    cache, _ = offline_hub
    populate_hub_cache(cache, "acme/two", checkpoints["mixtral"], revision="main")
    populate_hub_cache(cache, "acme/two", checkpoints["olmoe"], revision="v2")
    assert open_checkpoint("acme/two", None, dense_tensors).config.family == "mixtral"
    assert open_checkpoint("acme/two", "v2", dense_tensors).config.family == "olmoe"
    with pytest.raises(CheckpointError, match="acme/two@v9"):
        fetch_checkpoint("acme/two", "v9")


def test_the_config_tree_takes_a_repo_id_and_a_revision(tmp_path):
    cfg = MeshConfig().replace(**{"model.path": "acme/tiny-mixtral", "model.revision": "v2"}).validate()
    assert cfg.model.source == "acme/tiny-mixtral" and cfg.model.served_name == "acme/tiny-mixtral"
    with pytest.raises(ConfigError, match="model.path: ./not/here is neither a folder nor a Hugging Face repo id"):
        MeshConfig().replace(**{"model.path": "./not/here"}).validate()
    with pytest.raises(ConfigError, match="model.revision: applies to a Hugging Face repo id"):
        MeshConfig().replace(**{"model.path": str(tmp_path), "model.revision": "v2"}).validate()


def test_companions_cover_fp8_scales_biases_and_fused_layouts():
    from expertmesh.experts.model_source import companions

    keys = {
        "model.layers.0.mlp.experts.1.gate_proj.weight", "model.layers.0.mlp.experts.1.gate_proj.weight_scale_inv",
        "model.layers.0.mlp.experts.11.gate_proj.weight", "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.q_proj.bias", "model.layers.1.mlp.experts.gate_up_proj_blocks",
        "model.layers.1.mlp.experts.gate_up_proj_scales", "model.layers.1.mlp.experts.down_proj",
        "model.layers.2.mlp.experts.gate_up_proj",
    }
    wanted = {"model.layers.0.mlp.experts.1.gate_proj.weight", "model.layers.0.self_attn.q_proj.weight",
              "model.layers.1.mlp.experts.3.up_proj.weight"}
    assert companions(wanted, keys) == {
        "model.layers.0.mlp.experts.1.gate_proj.weight", "model.layers.0.mlp.experts.1.gate_proj.weight_scale_inv",
        "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.q_proj.bias",
        "model.layers.1.mlp.experts.gate_up_proj_blocks", "model.layers.1.mlp.experts.gate_up_proj_scales",
        "model.layers.1.mlp.experts.down_proj",
    }
