"""Checkpoint reading (`expertmesh.experts.checkpoint`, `.weights`): actionable errors and reading only what is asked.

Every corruption is done on a copy of the session fixture, never on the shared folders.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import expertmesh.experts.checkpoint as checkpoint_module
from expertmesh.experts.checkpoint import INDEX_FILE, CheckpointReader
from expertmesh.experts.errors import CheckpointError
from expertmesh.experts.reference import load_reference_model
from expertmesh.experts.weights import dense_tensor_names, expert_tensor_names, load_dense_weights, load_expert_shards

EXPERT_KEY = "model.layers.1.block_sparse_moe.experts.2.w3.weight"


def _copy(checkpoints: dict, name: str, tmp_path: Path) -> Path:
    dst = tmp_path / name
    shutil.copytree(checkpoints[name], dst)
    return dst


def _edit_config(folder: Path, **changes) -> None:
    path = folder / "config.json"
    raw = json.loads(path.read_text())
    for key, value in changes.items():
        if value is _DELETE:
            del raw[key]
        else:
            raw[key] = value
    path.write_text(json.dumps(raw))


_DELETE = object()


def test_checkpoint_error_is_a_value_error():
    assert issubclass(CheckpointError, ValueError)


def test_fixture_folders_load(checkpoints):
    for name in ("mixtral", "qwen2_moe", "olmoe", "mixtral_sharded", "direct"):
        reader = CheckpointReader(checkpoints[name])
        assert all(reader.has(k) for k in dense_tensor_names(reader.config))


# ---------------------------------------------------------------- config errors


def test_unsupported_architecture(checkpoints, tmp_path):
    folder = _copy(checkpoints, "mixtral", tmp_path)
    _edit_config(folder, architectures=["LlamaForCausalLM"], model_type="llama")
    with pytest.raises(CheckpointError) as err:
        CheckpointReader(folder)
    msg = str(err.value)
    assert str(folder / "config.json") in msg
    assert "'architectures'" in msg
    assert "LlamaForCausalLM" in msg
    assert "MixtralForCausalLM" in msg  # lists what is supported


def test_model_type_alone_is_enough(checkpoints, tmp_path):
    folder = _copy(checkpoints, "olmoe", tmp_path)
    _edit_config(folder, architectures=_DELETE)
    assert CheckpointReader(folder).config.family == "olmoe"


def test_missing_config_key(checkpoints, tmp_path):
    folder = _copy(checkpoints, "mixtral", tmp_path)
    _edit_config(folder, num_local_experts=_DELETE)
    with pytest.raises(CheckpointError, match="num_local_experts") as err:
        CheckpointReader(folder)
    assert str(folder / "config.json") in str(err.value)


def test_non_positive_config_key(checkpoints, tmp_path):
    folder = _copy(checkpoints, "qwen2_moe", tmp_path)
    _edit_config(folder, moe_intermediate_size=0)
    with pytest.raises(CheckpointError, match="'moe_intermediate_size' must be a positive integer"):
        CheckpointReader(folder)


def test_missing_folder_and_config(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        CheckpointReader(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="config.json"):
        CheckpointReader(tmp_path / "empty")


def test_invalid_json_config(checkpoints, tmp_path):
    folder = _copy(checkpoints, "direct", tmp_path)
    (folder / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON") as err:
        CheckpointReader(folder)
    assert "config.json" in str(err.value)


# ---------------------------------------------------------------- tensor errors


def test_missing_expert_tensor(checkpoints, tmp_path):
    folder = _copy(checkpoints, "mixtral", tmp_path)
    tensors = load_file(str(folder / "model.safetensors"))
    assert EXPERT_KEY in tensors
    del tensors[EXPERT_KEY]
    save_file(tensors, str(folder / "model.safetensors"))

    reader = CheckpointReader(folder)  # the index is fine; the error comes when the tensor is needed
    assert not reader.has(EXPERT_KEY)
    with pytest.raises(CheckpointError) as err:
        load_expert_shards(reader, [(1, 2)])
    msg = str(err.value)
    assert f"'{EXPERT_KEY}'" in msg and "is missing" in msg
    assert "model.safetensors" in msg and str(folder) in msg
    # other shards still load
    assert set(load_expert_shards(reader, [(1, 1), (0, 2)])) == {(1, 1), (0, 2)}
    with pytest.raises(CheckpointError, match="experts.2.w3"):
        load_reference_model(folder)


def test_missing_dense_tensor(checkpoints, tmp_path):
    folder = _copy(checkpoints, "direct", tmp_path)
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["model.norm.weight"]
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match="'model.norm.weight' is missing"):
        load_dense_weights(CheckpointReader(folder))


def test_missing_tensor_in_sharded_index_names_all_files(checkpoints, tmp_path):
    folder = _copy(checkpoints, "mixtral_sharded", tmp_path)
    index = json.loads((folder / INDEX_FILE).read_text())
    del index["weight_map"][EXPERT_KEY]
    (folder / INDEX_FILE).write_text(json.dumps(index))
    reader = CheckpointReader(folder)
    with pytest.raises(CheckpointError) as err:
        reader.read(EXPERT_KEY)
    msg = str(err.value)
    assert EXPERT_KEY in msg
    for i in range(1, 8):
        assert f"model-0000{i}-of-00007.safetensors" in msg


def test_shape_mismatch_names_file_key_and_both_shapes(checkpoints, tmp_path):
    folder = _copy(checkpoints, "mixtral", tmp_path)
    _edit_config(folder, intermediate_size=40)  # the tensors are [48, 32] / [32, 48]
    reader = CheckpointReader(folder)
    assert reader.config.expert_intermediate_size == 40
    with pytest.raises(CheckpointError) as err:
        load_expert_shards(reader, [(0, 0)])
    msg = str(err.value)
    assert str(folder / "model.safetensors") in msg
    key = "model.layers.0.block_sparse_moe.experts.0."
    assert key in msg
    assert ("(48, 32)" in msg and "(40, 32)" in msg) or ("(32, 48)" in msg and "(32, 40)" in msg)
    assert "config.json" in msg
    with pytest.raises(CheckpointError, match="has shape"):
        load_reference_model(folder)


def test_read_with_shape(checkpoints):
    reader = CheckpointReader(checkpoints["direct"])
    assert reader.read("model.norm.weight", (32,)).shape == (32,)
    with pytest.raises(CheckpointError, match=r"has shape \(32,\), expected \(33,\)"):
        reader.read("model.norm.weight", (33,))


def test_sharded_index_points_to_missing_shard(checkpoints, tmp_path):
    folder = _copy(checkpoints, "mixtral_sharded", tmp_path)
    (folder / "model-00003-of-00007.safetensors").unlink()
    with pytest.raises(CheckpointError) as err:
        CheckpointReader(folder)
    msg = str(err.value)
    assert "model-00003-of-00007.safetensors" in msg
    assert INDEX_FILE in msg and "'weight_map'" in msg


def test_sharded_index_invalid(checkpoints, tmp_path):
    folder = _copy(checkpoints, "mixtral_sharded", tmp_path)
    (folder / INDEX_FILE).write_text(json.dumps({"metadata": {}}))
    with pytest.raises(CheckpointError, match="weight_map"):
        CheckpointReader(folder)
    (folder / INDEX_FILE).write_text("{")
    with pytest.raises(CheckpointError, match="not a valid safetensors index"):
        CheckpointReader(folder)


def test_no_safetensors_at_all(checkpoints, tmp_path):
    folder = _copy(checkpoints, "mixtral", tmp_path)
    for path in folder.glob("*.safetensors"):
        path.unlink()
    (folder / "pytorch_model.bin").write_bytes(b"not supported")
    with pytest.raises(CheckpointError) as err:
        CheckpointReader(folder)
    assert "no *.safetensors" in str(err.value) and str(folder) in str(err.value)


# ---------------------------------------------------------------- reading exactly the shard's tensors


class _SpySafeOpen:
    """Wraps safetensors.safe_open, recording the files opened and the tensors read."""

    def __init__(self, real):
        self.real = real
        self.files: list[str] = []
        self.tensors: list[str] = []

    def __call__(self, path, *args, **kwargs):
        spy = self
        self.files.append(Path(path).name)
        handle = self.real(path, *args, **kwargs)

        class Handle:
            def __enter__(self):
                self.inner = handle.__enter__()
                return self

            def __exit__(self, *exc):
                return handle.__exit__(*exc)

            def get_tensor(self, key):
                spy.tensors.append(key)
                return self.inner.get_tensor(key)

            def keys(self):
                return self.inner.keys()

        return Handle()


@pytest.mark.parametrize("name", ["mixtral", "mixtral_sharded", "qwen2_moe"])
def test_load_expert_shards_reads_only_that_shard(checkpoints, monkeypatch, name):
    reader = CheckpointReader(checkpoints[name])
    expected = {n for n, _ in expert_tensor_names(reader.config, 0, 1).values()}
    assert len(expected) == 3

    spy = _SpySafeOpen(checkpoint_module.safe_open)
    monkeypatch.setattr(checkpoint_module, "safe_open", spy)
    requested: list[list[str]] = []
    real_read_many = CheckpointReader.read_many

    def read_many(self, wanted, progress=None, **options):
        requested.append(list(wanted))
        return real_read_many(self, wanted, progress=progress, **options)

    monkeypatch.setattr(CheckpointReader, "read_many", read_many)
    shards = load_expert_shards(reader, [(0, 1)])

    assert [set(r) for r in requested] == [expected]
    assert sorted(spy.tensors) == sorted(expected)
    files = {reader.file_of(k).name for k in expected}
    assert sorted(spy.files) == sorted(files)  # each holding file opened once, no other file
    assert list(shards) == [(0, 1)]
    w = shards[(0, 1)]
    inter, hidden = reader.config.expert_intermediate_size, reader.config.hidden_size
    assert w.gate_up.shape == (2 * inter, hidden) and w.down.shape == (hidden, inter)


def test_expert_shard_fuses_gate_and_up(checkpoints):
    folder = checkpoints["direct"]
    raw = load_file(str(folder / "model.safetensors"))
    w = load_expert_shards(CheckpointReader(folder), [(1, 3)])[(1, 3)]
    p = "model.layers.1.block_sparse_moe.experts.3."
    assert torch.equal(w.gate_up, torch.cat([raw[p + "w1.weight"], raw[p + "w3.weight"]]))
    assert torch.equal(w.down, raw[p + "w2.weight"])


def test_expert_shards_of_other_families_use_their_names(checkpoints):
    folder = checkpoints["olmoe"]
    raw = load_file(str(folder / "model.safetensors"))
    w = load_expert_shards(CheckpointReader(folder), [(1, 7)])[(1, 7)]
    p = "model.layers.1.mlp.experts.7."
    assert torch.equal(w.gate_up, torch.cat([raw[p + "gate_proj.weight"], raw[p + "up_proj.weight"]]))
    assert torch.equal(w.down, raw[p + "down_proj.weight"])


def test_load_expert_shards_dtype(checkpoints):
    w = load_expert_shards(CheckpointReader(checkpoints["direct"]), [(0, 0)], dtype=torch.bfloat16)[(0, 0)]
    assert w.gate_up.dtype == torch.bfloat16 and w.down.dtype == torch.bfloat16


@pytest.mark.parametrize("shard", [(0, 4), (0, -1), (2, 0), (-1, 0)])
def test_load_expert_shards_rejects_nonexistent_shard(checkpoints, shard):
    with pytest.raises(ValueError, match="does not exist"):
        load_expert_shards(CheckpointReader(checkpoints["mixtral"]), [shard])


def test_load_expert_shards_rejects_dense_layer(checkpoints):
    reader = CheckpointReader(checkpoints["qwen2_moe"])
    assert reader.config.moe_layers == (0, 2)
    with pytest.raises(ValueError, match=r"layer=1, expert=0"):
        load_expert_shards(reader, [(1, 0)])


# ---------------------------------------------------------------- sharded == unsharded


def test_sharded_checkpoint_loads_the_same_tensors_as_merged(checkpoints, tmp_path):
    sharded = checkpoints["mixtral_sharded"]
    merged = tmp_path / "merged"
    merged.mkdir()
    tensors: dict[str, torch.Tensor] = {}
    files = sorted(sharded.glob("*.safetensors"))
    assert len(files) == 7
    for path in files:
        tensors |= load_file(str(path))
    save_file(tensors, str(merged / "model.safetensors"))
    shutil.copy(sharded / "config.json", merged / "config.json")

    a, b = CheckpointReader(sharded), CheckpointReader(merged)
    assert set(a.keys()) == set(b.keys()) == set(tensors)
    da, db = load_dense_weights(a), load_dense_weights(b)
    assert torch.equal(da.embed, db.embed) and torch.equal(da.lm_head, db.lm_head)
    for la, lb in zip(da.layers, db.layers):
        assert torch.equal(la.router, lb.router) and torch.equal(la.attention.q, lb.attention.q)
    shards = [(layer, e) for layer in range(2) for e in range(4)]
    ea, eb = load_expert_shards(a, shards), load_expert_shards(b, shards)
    for shard in shards:
        assert torch.equal(ea[shard].gate_up, eb[shard].gate_up) and torch.equal(ea[shard].down, eb[shard].down)

    ids = torch.tensor([3, 17, 42, 5, 88, 0, 61])
    la_ = load_reference_model(sharded).forward([ids])[0]
    lb_ = load_reference_model(merged).forward([ids])[0]
    assert torch.equal(la_, lb_)


def test_sharded_checkpoint_matches_transformers(checkpoints):
    from transformers import AutoModelForCausalLM

    folder = checkpoints["mixtral_sharded"]
    ids = torch.tensor([3, 17, 42, 5, 88, 0, 61, 9, 9, 12])
    ours = load_reference_model(folder).forward([ids])[0]
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(ids[None]).logits[0]
    assert (ours - theirs).abs().max().item() <= 1e-4
    assert theirs.abs().max().item() > 0.1


# ---------------------------------------------------------------- known gaps (source bugs)


def test_index_pointing_to_wrong_shard_raises_checkpoint_error(checkpoints, tmp_path):
    folder = _copy(checkpoints, "mixtral_sharded", tmp_path)
    index = json.loads((folder / INDEX_FILE).read_text())
    index["weight_map"][EXPERT_KEY] = "model-00001-of-00007.safetensors"
    (folder / INDEX_FILE).write_text(json.dumps(index))
    reader = CheckpointReader(folder)
    with pytest.raises(CheckpointError, match="model-00001-of-00007.safetensors"):
        reader.read(EXPERT_KEY)


def test_truncated_safetensors_raises_checkpoint_error(checkpoints, tmp_path):
    folder = _copy(checkpoints, "mixtral", tmp_path)
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        CheckpointReader(folder)
