"""The in-process reference model (`expertmesh.experts.reference`) against `transformers`, and config parsing.

Tolerance: max |Δlogits| ≤ 1e-4 in float32; the tiny checkpoints have logits of order 1, so a wrong rotary
convention, norm, gate or mask shows up far above it.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from expertmesh.experts.config import config_from_dict, load_model_config
from expertmesh.experts.errors import CheckpointError
from expertmesh.experts.modeling import MoEDecoder
from expertmesh.experts.reference import load_reference_model
from tests.tiny_checkpoints import VOCAB, hf_logits, max_diff, write_hf_checkpoint

NAMES = ("mixtral", "qwen2_moe", "olmoe", "mixtral_sharded", "direct")
TOL = 1e-4


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def _hf(folder: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def models(checkpoints):
    """name -> (reference model, HF model), built once per module."""
    return {name: (load_reference_model(checkpoints[name]), _hf(checkpoints[name])) for name in NAMES}


@pytest.fixture(scope="module")
def extra_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("extra_ckpt")


def _greedy(model, ids: torch.Tensor, steps: int) -> list[int]:
    cache = model.new_cache()
    out = ids.tolist()
    nxt = ids
    for _ in range(steps):
        logits = model.forward([nxt], [cache])[0]
        token = int(logits[-1].argmax())
        out.append(token)
        nxt = torch.tensor([token])
    return out


def _incremental(model, ids: torch.Tensor, cuts: list[int]) -> torch.Tensor:
    cache = model.new_cache()
    pieces, prev = [], 0
    for cut in [*cuts, ids.numel()]:
        pieces.append(model.forward([ids[prev:cut]], [cache])[0])
        prev = cut
    assert cache.length == ids.numel()
    return torch.cat(pieces)


# ---------------------------------------------------------------- the fixture checkpoints


@pytest.mark.parametrize("name", NAMES)
def test_batched_sequences_of_different_lengths_match_hf(models, name):
    model, hf = models[name]
    ids0, ids1 = _ids(7, 1), _ids(12, 2)
    out = model.forward([ids0, ids1])
    assert [o.shape for o in out] == [(7, VOCAB), (12, VOCAB)]
    assert all(o.dtype == torch.float32 for o in out)
    for ids, ours in zip((ids0, ids1), out):
        theirs = hf_logits(hf, ids)
        assert max_diff(ours, theirs) <= TOL
        assert theirs.std().item() > 0.05  # logits carry signal well above the tolerance


@pytest.mark.parametrize("name", NAMES)
def test_incremental_decoding_equals_full_forward(models, name):
    model, _ = models[name]
    ids = _ids(15, 3)
    full = model.forward([ids])[0]
    assert max_diff(_incremental(model, ids, [4, 5, 10, 11]), full) <= 1e-5
    assert max_diff(_incremental(model, ids, list(range(1, 15))), full) <= 1e-5  # token by token


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "olmoe"])
def test_batched_decode_with_caches_of_different_lengths(models, name):
    model, _ = models[name]
    a, b = _ids(9, 4), _ids(5, 5)
    ca, cb = model.new_cache(), model.new_cache()
    model.forward([a[:6]], [ca])
    model.forward([b[:2]], [cb])
    step = model.forward([a[6:], b[2:]], [ca, cb])  # 3 new tokens each, at positions 6.. and 2..
    assert (ca.length, cb.length) == (9, 5)
    assert max_diff(step[0], model.forward([a])[0][6:]) <= 1e-5
    assert max_diff(step[1], model.forward([b])[0][2:]) <= 1e-5


@pytest.mark.parametrize("name", NAMES)
def test_greedy_decode_equals_hf_generate(models, name):
    model, hf = models[name]
    ids = _ids(6, 6)
    with torch.no_grad():
        expected = hf.generate(ids[None], attention_mask=torch.ones(1, 6, dtype=torch.long), max_new_tokens=10,
                               do_sample=False)[0].tolist()
    assert len(expected) == 16
    assert _greedy(model, ids, 10) == expected


def test_reference_routes_with_the_configured_top_k(models):
    model, _ = models["olmoe"]
    model.forward([_ids(5, 7)])
    trace = model.last_trace
    assert sorted(trace.routings) == [0, 1]
    assert all(r.experts.shape == (5, 3) for r in trace.routings.values())
    # OLMoE does not renormalise: the top-3 of 8 probabilities sum to less than 1
    assert all(bool((r.weights.sum(-1) < 1 - 1e-3).all()) for r in trace.routings.values())


def test_fixture_configs(models):
    mixtral, qwen, olmoe = (models[n][0].cfg for n in ("mixtral", "qwen2_moe", "olmoe"))
    assert mixtral.moe_layers == (0, 1) and mixtral.num_experts == 4 and mixtral.top_k == 2
    assert qwen.num_layers == 3
    assert qwen.moe_layers == (0, 2)  # layer 1 is in mlp_only_layers: a dense MLP
    assert qwen.has_shared_expert and qwen.shared_expert_intermediate_size == 40
    assert qwen.dense_intermediate_size == 64 and qwen.expert_intermediate_size == 24
    assert olmoe.moe_layers == (0, 1) and olmoe.qk_norm and olmoe.top_k == 3 and olmoe.num_experts == 8
    w = models["qwen2_moe"][0].w
    assert w.layers[1].dense_mlp is not None and w.layers[1].router is None
    assert w.layers[0].shared_expert is not None and w.layers[0].shared_expert_gate.shape == (1, 32)
    assert w.layers[2].router.shape == (4, 32)


# ---------------------------------------------------------------- variants built here


def test_sliding_window_mixtral_matches_hf(extra_dir):
    folder = write_hf_checkpoint("mixtral", extra_dir / "sw", sliding_window=8)
    model, hf = load_reference_model(folder), _hf(folder)
    assert model.cfg.sliding_window == 8 and model.cfg.sliding_layers == (0, 1)
    ids = _ids(20, 8)
    full = model.forward([ids])[0]
    theirs = hf_logits(hf, ids)
    assert max_diff(full, theirs) <= TOL
    # decoding past the window, in chunks and token by token
    assert max_diff(_incremental(model, ids, [3, 9, 10, 17]), theirs) <= TOL
    assert max_diff(_incremental(model, ids, list(range(1, 20))), theirs) <= TOL
    with torch.no_grad():
        expected = hf.generate(ids[None, :6], attention_mask=torch.ones(1, 6, dtype=torch.long), max_new_tokens=10,
                               do_sample=False)[0].tolist()
    assert _greedy(model, ids[:6], 10) == expected
    # the window matters: without it the positions past the window differ, those inside do not
    unwindowed = _with_config(model, sliding_window=None, sliding_layers=()).forward([ids])[0]
    assert max_diff(unwindowed[:8], full[:8]) <= 1e-6
    assert max_diff(unwindowed[8:], full[8:]) > 1e-2


def _with_config(model: MoEDecoder, **changes) -> MoEDecoder:
    """The same weights and experts under a changed model config (the attention layers are built from it)."""
    return MoEDecoder(dataclasses.replace(model.cfg, **changes), model.w, model.experts)


def test_sliding_window_qwen2_moe_layer_types_match_hf(extra_dir):
    folder = write_hf_checkpoint("qwen2_moe", extra_dir / "qsw", use_sliding_window=True, sliding_window=4,
                                 max_window_layers=1)
    model, hf = load_reference_model(folder), _hf(folder)
    raw = json.loads((folder / "config.json").read_text())
    expected_layers = tuple(i for i, t in enumerate(raw["layer_types"]) if t == "sliding_attention")
    assert expected_layers  # this transformers marks at least one layer sliding
    assert model.cfg.sliding_layers == expected_layers and model.cfg.sliding_window == 4
    ids = _ids(14, 9)
    theirs = hf_logits(hf, ids)
    assert max_diff(model.forward([ids])[0], theirs) <= TOL
    assert max_diff(_incremental(model, ids, [5, 6, 11]), theirs) <= TOL


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_tied_embeddings_match_hf(extra_dir, family):
    folder = write_hf_checkpoint(family, extra_dir / f"tied_{family}", seed=4, tie_word_embeddings=True)
    model, hf = load_reference_model(folder), _hf(folder)
    assert model.cfg.tie_word_embeddings
    assert model.w.lm_head is model.w.embed
    ids = _ids(11, 10)
    assert max_diff(model.forward([ids])[0], hf_logits(hf, ids)) <= TOL


def test_qwen2_moe_decoder_sparse_step_matches_hf(extra_dir):
    folder = write_hf_checkpoint("qwen2_moe", extra_dir / "step2", num_hidden_layers=4, decoder_sparse_step=2,
                                 mlp_only_layers=[], norm_topk_prob=False)
    model, hf = load_reference_model(folder), _hf(folder)
    assert model.cfg.moe_layers == (1, 3) and not model.cfg.norm_topk_prob
    ids = _ids(9, 11)
    assert max_diff(model.forward([ids])[0], hf_logits(hf, ids)) <= TOL


def test_olmoe_clip_qkv_matches_hf(extra_dir):
    folder = write_hf_checkpoint("olmoe", extra_dir / "clip", clip_qkv=0.3)
    model, hf = load_reference_model(folder), _hf(folder)
    assert model.cfg.clip_qkv == 0.3
    ids = _ids(10, 12)
    theirs = hf_logits(hf, ids)
    assert max_diff(model.forward([ids])[0], theirs) <= TOL
    unclipped = _with_config(model, clip_qkv=None)  # the clip is active on this input
    assert max_diff(unclipped.forward([ids])[0], theirs) > 1e-3


# ---------------------------------------------------------------- config parsing


def _mixtral_raw(**overrides) -> dict:
    raw = {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 96, "hidden_size": 32,
        "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_local_experts": 4, "num_experts_per_tok": 2,
        "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"},
    }
    return {k: v for k, v in (raw | overrides).items() if v is not _DROP}


def _qwen_raw(**overrides) -> dict:
    raw = {
        "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "vocab_size": 96, "hidden_size": 32,
        "intermediate_size": 64, "moe_intermediate_size": 24, "shared_expert_intermediate_size": 40,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 4,
        "num_experts_per_tok": 2, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
    }
    return {k: v for k, v in (raw | overrides).items() if v is not _DROP}


def _olmoe_raw(**overrides) -> dict:
    raw = {
        "architectures": ["OlmoeForCausalLM"], "model_type": "olmoe", "vocab_size": 96, "hidden_size": 32,
        "intermediate_size": 24, "num_hidden_layers": 2, "num_attention_heads": 4, "num_experts": 8,
        "num_experts_per_tok": 3, "rope_theta": 10000.0,
    }
    return {k: v for k, v in (raw | overrides).items() if v is not _DROP}


_DROP = object()


def test_load_model_config_of_fixtures(checkpoints):
    mixtral = load_model_config(checkpoints["mixtral"])
    assert (mixtral.family, mixtral.num_experts, mixtral.top_k, mixtral.norm_topk_prob) == ("mixtral", 4, 2, True)
    assert mixtral.rope_theta == 1e6  # HF's Mixtral default, from `rope_parameters`
    assert (mixtral.num_heads, mixtral.num_kv_heads, mixtral.head_dim) == (4, 2, 8)
    assert not mixtral.qk_norm and not mixtral.attention_bias and mixtral.sliding_window is None
    qwen = load_model_config(checkpoints["qwen2_moe"])
    assert (qwen.family, qwen.num_experts, qwen.top_k, qwen.norm_topk_prob) == ("qwen2_moe", 4, 2, True)
    assert qwen.attention_bias and not qwen.qk_norm and qwen.moe_layers == (0, 2)
    assert qwen.sliding_window is None and qwen.sliding_layers == ()
    olmoe = load_model_config(checkpoints["olmoe"])
    assert (olmoe.family, olmoe.num_experts, olmoe.top_k, olmoe.norm_topk_prob) == ("olmoe", 8, 3, False)
    assert olmoe.qk_norm and olmoe.clip_qkv is None and olmoe.moe_layers == (0, 1)
    direct = load_model_config(checkpoints["direct"])
    assert direct.family == "mixtral" and direct.rope_theta == 10000.0  # legacy top-level `rope_theta`


def test_config_from_dict_families():
    m = config_from_dict(_mixtral_raw(norm_topk_prob=False))
    assert m.family == "mixtral" and m.norm_topk_prob  # Mixtral always renormalises
    assert m.expert_intermediate_size == 48 and m.moe_layers == (0, 1)
    assert m.expert_param_count() == 3 * 32 * 48
    q = config_from_dict(_qwen_raw())
    assert q.family == "qwen2_moe" and q.moe_layers == (0, 1, 2, 3) and q.has_shared_expert
    o = config_from_dict(_olmoe_raw(norm_topk_prob=True, clip_qkv=8.0))
    assert o.family == "olmoe" and o.qk_norm and o.norm_topk_prob and o.clip_qkv == 8.0
    assert o.num_kv_heads == 4  # defaults to the number of heads
    assert o.head_dim == 8


def test_qwen2_moe_decoder_sparse_step_and_mlp_only():
    assert config_from_dict(_qwen_raw(decoder_sparse_step=2)).moe_layers == (1, 3)
    assert config_from_dict(_qwen_raw(decoder_sparse_step=2, mlp_only_layers=[3])).moe_layers == (1,)
    assert config_from_dict(_qwen_raw(mlp_only_layers=[0, 2])).moe_layers == (1, 3)
    assert config_from_dict(_qwen_raw(decoder_sparse_step=None)).moe_layers == (0, 1, 2, 3)
    assert config_from_dict(_qwen_raw(shared_expert_intermediate_size=0)).has_shared_expert is False


def test_qwen2_moe_dense_layers_need_intermediate_size():
    with pytest.raises(CheckpointError, match="'intermediate_size'"):
        config_from_dict(_qwen_raw(mlp_only_layers=[1], intermediate_size=_DROP))
    assert config_from_dict(_qwen_raw(intermediate_size=_DROP)).dense_intermediate_size == 0  # all sparse: fine


def test_rope_theta_sources():
    assert config_from_dict(_mixtral_raw()).rope_theta == 1e6
    legacy = _mixtral_raw(rope_parameters=_DROP, rope_theta=5e5)
    assert config_from_dict(legacy).rope_theta == 5e5
    assert config_from_dict(_mixtral_raw(rope_parameters=_DROP)).rope_theta == 10000.0
    assert config_from_dict(_mixtral_raw(rope_scaling={"rope_type": "default"}, rope_theta=3.0)).rope_theta == 1e6


@pytest.mark.parametrize(
    "overrides",
    [
        {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e6, "factor": 4.0}},  # (yarn is supported)
        {"rope_parameters": _DROP, "rope_scaling": {"type": "linear", "factor": 2.0}},
        {"rope_parameters": _DROP, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
    ],
)
def test_unsupported_rope_types_rejected(overrides):
    with pytest.raises(CheckpointError, match="rope_type") as err:
        config_from_dict(_mixtral_raw(**overrides), source="/m/config.json")
    assert "/m/config.json" in str(err.value)


def test_top_k_above_num_experts_rejected():
    with pytest.raises(CheckpointError, match="num_experts_per_tok=5") as err:
        config_from_dict(_mixtral_raw(num_experts_per_tok=5), source="x/config.json")
    assert "x/config.json" in str(err.value)
    with pytest.raises(CheckpointError, match="num_experts_per_tok"):
        config_from_dict(_olmoe_raw(num_experts_per_tok=9))


@pytest.mark.parametrize(
    "raw,key",
    [
        (_mixtral_raw(num_local_experts=_DROP), "num_local_experts"),
        (_mixtral_raw(num_local_experts=None), "num_local_experts"),
        (_mixtral_raw(hidden_size=_DROP), "hidden_size"),
        (_mixtral_raw(vocab_size=0), "vocab_size"),
        (_mixtral_raw(num_experts_per_tok=True), "num_experts_per_tok"),
        (_mixtral_raw(intermediate_size="48"), "intermediate_size"),
        (_qwen_raw(moe_intermediate_size=_DROP), "moe_intermediate_size"),
        (_qwen_raw(num_experts=_DROP), "num_experts"),
        (_olmoe_raw(num_hidden_layers=-1), "num_hidden_layers"),
        (_mixtral_raw(hidden_act="tanh"), "hidden_act"),
        (_mixtral_raw(num_key_value_heads=3), "num_key_value_heads"),
        (_mixtral_raw(architectures=["LlamaForCausalLM"], model_type="llama"), "architectures"),
        (_mixtral_raw(architectures=_DROP, model_type=_DROP), "architectures"),
    ],
)
def test_bad_config_names_the_key(raw, key):
    with pytest.raises(CheckpointError, match=f"'?{key}'?") as err:
        config_from_dict(raw, source="some/config.json")
    assert "some/config.json" in str(err.value)
    assert key in str(err.value)


def test_misc_fields():
    cfg = config_from_dict(_mixtral_raw(eos_token_id=[7, 8], bos_token_id=1, head_dim=16, sliding_window=64))
    assert cfg.eos_token_id == 7 and cfg.bos_token_id == 1 and cfg.head_dim == 16
    assert cfg.sliding_window == 64 and cfg.sliding_layers == (0, 1)
    assert config_from_dict(_mixtral_raw(eos_token_id=[])).eos_token_id is None
    assert config_from_dict(_mixtral_raw()).max_position_embeddings == 4096
    assert config_from_dict(_mixtral_raw(tie_word_embeddings=True)).tie_word_embeddings
