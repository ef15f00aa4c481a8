"""Both on-disk expert layouts (per-expert names and transformers 5's stacked tensors) for every family, gpt-oss's
interleaved stacked layout, and the promise that an actor reads only its experts' rows of a stacked tensor."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from expertmesh.experts import checkpoint as checkpoint_module
from expertmesh.experts.checkpoint import CheckpointReader
from expertmesh.experts.errors import CheckpointError
from expertmesh.experts.ffn import activation, gated_mlp
from expertmesh.experts.weights import (
    FUSED,
    FUSED_INTERLEAVED,
    PER_EXPERT,
    check_checkpoint,
    expert_layout,
    fused_tensor_names,
    load_dense_weights,
    load_expert_shards,
)
from tests.tiny_checkpoints import write_hf_checkpoint, write_mxfp4_gpt_oss
from tests.tiny_deepseek import KINDS as DEEPSEEK_KINDS
from tests.tiny_deepseek import write_deepseek_checkpoint

FAMILIES = ("mixtral", "qwen2_moe", "olmoe", "qwen3_moe")


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """family -> (per-expert folder, stacked folder) of the same model (same seed) saved both ways."""
    root = tmp_path_factory.mktemp("layouts")
    return {f: (write_hf_checkpoint(f, root / f"{f}_per_expert", seed=5),
                write_hf_checkpoint(f, root / f"{f}_fused", seed=5, fused=True)) for f in FAMILIES}


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory) -> Path:
    return write_hf_checkpoint("gpt_oss", tmp_path_factory.mktemp("gpt_oss") / "ckpt", seed=6)


def _names(folder: Path) -> set[str]:
    return set(CheckpointReader(folder).keys())


@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_writes_both_layouts_and_we_detect_them(pairs, family):
    per_expert, fused = pairs[family]
    a, b = CheckpointReader(per_expert), CheckpointReader(fused)
    assert expert_layout(a.config, a.has) == PER_EXPERT and expert_layout(b.config, b.has) == FUSED
    layer = a.config.moe_layers[0]
    assert f"model.layers.{layer}.mlp.experts.gate_up_proj" in _names(fused)
    assert not any(".experts.0." in n for n in _names(fused))
    assert any(".experts.0." in n for n in _names(per_expert))
    check_checkpoint(a)
    check_checkpoint(b)


@pytest.mark.parametrize("family", FAMILIES)
def test_both_layouts_load_the_same_weights(pairs, family):
    per_expert, fused = (CheckpointReader(p) for p in pairs[family])
    cfg = per_expert.config
    shards = [(layer, e) for layer in cfg.moe_layers for e in range(cfg.num_experts)]
    ea, eb = load_expert_shards(per_expert, shards), load_expert_shards(fused, shards)
    for shard in shards:
        assert torch.equal(ea[shard].gate_up, eb[shard].gate_up) and torch.equal(ea[shard].down, eb[shard].down)
    da, db = load_dense_weights(per_expert), load_dense_weights(fused)
    for la, lb in zip(da.layers, db.layers):
        assert (la.router is None) == (lb.router is None)
        assert la.router is None or torch.equal(la.router, lb.router)  # Mixtral's router is renamed when fused


class _SpySlice:
    def __init__(self, inner, name: str, log: list):
        self.inner, self.name, self.log = inner, name, log

    def get_shape(self):
        return self.inner.get_shape()

    def __getitem__(self, index):
        self.log.append((self.name, index))
        return self.inner[index]


class _SpyHandle:
    """A safe_open handle that refuses to read a stacked expert tensor whole and records the rows read."""

    def __init__(self, inner, log: list):
        self.inner, self.log = inner, log

    def keys(self):
        return self.inner.keys()

    def get_tensor(self, name: str):
        if ".mlp.experts." in name and not name.endswith(".weight"):  # stacked: gate_up_proj, *_blocks, *_bias...
            raise AssertionError(f"read the whole stacked tensor {name}")
        return self.inner.get_tensor(name)

    def get_slice(self, name: str):
        return _SpySlice(self.inner.get_slice(name), name, self.log)


@pytest.fixture
def spy(monkeypatch) -> list:
    log: list = []
    real = checkpoint_module.safe_open

    class _Opened:
        def __init__(self, path, framework, **options):
            self.cm = real(path, framework=framework, **options)

        def __enter__(self):
            return _SpyHandle(self.cm.__enter__(), log)

        def __exit__(self, *exc):
            return self.cm.__exit__(*exc)

    monkeypatch.setattr(checkpoint_module, "safe_open", _Opened)
    return log


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss", "gpt_oss_mxfp4"])
def test_an_actor_reads_only_its_experts_rows(pairs, gpt_oss, tmp_path, spy, family):
    if family == "gpt_oss_mxfp4":
        folder = write_mxfp4_gpt_oss(gpt_oss, tmp_path / "mxfp4")
    else:
        folder = gpt_oss if family == "gpt_oss" else pairs[family][1]
    reader = CheckpointReader(folder)
    layer = reader.config.moe_layers[-1]
    loaded = load_expert_shards(reader, [(layer, 1), (layer, 3)])
    assert set(loaded) == {(layer, 1), (layer, 3)}
    layout = expert_layout(reader.config, reader.has)
    stacked = {name for name, _ in fused_tensor_names(reader.config, layer, layout).values()}
    assert {name for name, _ in spy} == stacked  # nothing of the other layers, nothing whole
    assert sorted(index for name, index in spy if name.endswith(("gate_up_proj", "gate_up_proj_blocks"))) == [1, 3]
    assert all(isinstance(index, int) for _, index in spy)


def test_check_checkpoint_reads_stacked_headers_and_names_a_wrong_shape(pairs, tmp_path):
    fused = pairs["qwen3_moe"][1]
    folder = tmp_path / "wrong"
    folder.mkdir()
    (folder / "model.safetensors").symlink_to(fused / "model.safetensors")
    raw = json.loads((fused / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(raw | {"moe_intermediate_size": 20}))
    with pytest.raises(CheckpointError, match=r"mlp\.experts\.gate_up_proj' has shape \(4, 48, 32\), expected "
                                              r"\(4, 40, 32\)"):
        check_checkpoint(CheckpointReader(folder))


def test_gpt_oss_interleaved_experts_compute_what_transformers_computes(gpt_oss):
    """Our de-interleaved [2I, H] weights + clamped SwiGLU == transformers' GptOssExperts on the same rows."""
    from transformers import AutoModelForCausalLM

    reader = CheckpointReader(gpt_oss)
    assert expert_layout(reader.config, reader.has) == FUSED_INTERLEAVED
    hf = AutoModelForCausalLM.from_pretrained(gpt_oss, dtype=torch.float32).eval()
    experts = hf.model.layers[1].mlp.experts
    x = torch.randn(9, reader.config.hidden_size, generator=torch.Generator().manual_seed(0)) * 3
    shards = load_expert_shards(reader, [(1, e) for e in range(4)])
    for e in range(4):
        w = shards[(1, e)]
        assert w.kind == "clamped_swiglu" and w.gate_up_bias.shape == (64,) and w.down_bias.shape == (64,)
        with torch.no_grad():
            theirs = experts(x, torch.full((9, 1), e), torch.ones(9, 1))  # every token to expert e, weight 1
        ours = gated_mlp(x, w, activation("silu"))
        assert (ours - theirs).abs().max().item() <= 1e-5
        gate = torch.nn.functional.linear(x, w.gate_up[:32], w.gate_up_bias[:32])
        assert bool((gate > w.limit).any())  # the clamp is exercised on this input


def test_gpt_oss_without_its_stacked_tensors_names_the_missing_one(gpt_oss, tmp_path):
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(gpt_oss / "model.safetensors"))
    del tensors["model.layers.1.mlp.experts.down_proj_bias"]
    (tmp_path / "config.json").write_text((gpt_oss / "config.json").read_text())
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"'model\.layers\.1\.mlp\.experts\.down_proj_bias' is missing"):
        check_checkpoint(CheckpointReader(tmp_path))


@pytest.mark.parametrize("kind", DEEPSEEK_KINDS)
def test_deepseek_and_glm_stacked_files_load_the_same_experts(tmp_path, kind):
    """The mechanism is generic: DeepSeek-V2/V3 and GLM-4.5 saved stacked read as the per-expert files do."""
    a = CheckpointReader(write_deepseek_checkpoint(kind, tmp_path / "per_expert", seed=2))
    b = CheckpointReader(write_deepseek_checkpoint(kind, tmp_path / "fused", seed=2, fused=True))
    assert (expert_layout(a.config, a.has), expert_layout(b.config, b.has)) == (PER_EXPERT, FUSED)
    check_checkpoint(b)
    shards = [(layer, e) for layer in a.config.moe_layers for e in range(a.config.num_experts)]
    ea, eb = load_expert_shards(a, shards), load_expert_shards(b, shards)
    assert all(torch.equal(ea[s].gate_up, eb[s].gate_up) and torch.equal(ea[s].down, eb[s].down) for s in shards)
