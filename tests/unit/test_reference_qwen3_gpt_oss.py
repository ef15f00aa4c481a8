"""Qwen3-MoE and gpt-oss (and the stacked expert layout of every family) through the in-process reference model
against `transformers`: fp32 logits within 1e-4, greedy tokens equal, incremental decoding equal to the full forward.

Each gpt-oss feature is exercised, and shown to matter on these inputs by switching it off: attention sinks, the
sliding window (prompts longer than the window of 4), q/k/v/o, router and expert biases, YaRN; for Qwen3-MoE the
per-head q/k norm. MXFP4: a checkpoint the test quantises in the published format equals transformers' dequantised
model.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from expertmesh.experts.config import config_from_dict
from expertmesh.experts.errors import CheckpointError
from expertmesh.experts.reference import load_reference_model
from expertmesh.experts.rope import RotaryEmbedding
from tests.tiny_checkpoints import VOCAB, hf_logits, write_hf_checkpoint, write_mxfp4_gpt_oss

TOL = 1e-4
# name -> (family, write kwargs); "_fused" = transformers' stacked layout (save_original_format=False)
CASES = {
    "qwen3_moe": ("qwen3_moe", {}),
    "qwen3_moe_fused": ("qwen3_moe", {"fused": True}),
    "gpt_oss": ("gpt_oss", {}),
    "mixtral_fused": ("mixtral", {"fused": True}),
    "qwen2_moe_fused": ("qwen2_moe", {"fused": True}),
    "olmoe_fused": ("olmoe", {"fused": True}),
}
NAMES = (*CASES, "gpt_oss_mxfp4")


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("new_families")
    out = {name: write_hf_checkpoint(family, root / name, seed=11 + i, **kwargs)
           for i, (name, (family, kwargs)) in enumerate(CASES.items())}
    out["gpt_oss_mxfp4"] = write_mxfp4_gpt_oss(out["gpt_oss"], root / "gpt_oss_mxfp4")
    return out


@pytest.fixture(scope="module")
def models(folders):
    """name -> (reference model, transformers model)."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    out = {}
    for name, folder in folders.items():
        extra = {"quantization_config": Mxfp4Config(dequantize=True)} if name.endswith("mxfp4") else {}
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **extra).eval()
        out[name] = (load_reference_model(folder), hf)
    return out


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


def _incremental(model, ids: torch.Tensor, cuts: list[int]) -> torch.Tensor:
    cache, pieces, prev = model.new_cache(), [], 0
    for cut in [*cuts, ids.numel()]:
        pieces.append(model.forward([ids[prev:cut]], [cache])[0])
        prev = cut
    return torch.cat(pieces)


@pytest.mark.parametrize("name", NAMES)
def test_logits_match_transformers(models, name):
    model, hf = models[name]
    a, b = _ids(13, 1), _ids(6, 2)  # 13 > the gpt-oss window (4)
    for ids, ours in zip((a, b), model.forward([a, b])):
        theirs = hf_logits(hf, ids)
        assert _diff(ours, theirs) <= TOL
        assert theirs.std().item() > 0.05


@pytest.mark.parametrize("name", NAMES)
def test_incremental_and_batched_decode_match_transformers(models, name):
    model, hf = models[name]
    ids = _ids(12, 3)
    theirs = hf_logits(hf, ids)
    assert _diff(_incremental(model, ids, [3, 7, 8]), theirs) <= TOL
    assert _diff(_incremental(model, ids, list(range(1, 12))), theirs) <= TOL  # token by token, past the window
    other = _ids(9, 4)
    ca, cb = model.new_cache(), model.new_cache()
    model.forward([ids[:8], other[:2]], [ca, cb])
    step = model.forward([ids[8:9], other[2:3]], [ca, cb])  # a batched decode step over histories 9 and 3
    assert _diff(step[0], theirs[8:9]) <= TOL
    assert _diff(step[1], hf_logits(hf, other[:3])[2:3]) <= TOL


@pytest.mark.parametrize("name", NAMES)
def test_greedy_tokens_equal_transformers_generate(models, name):
    model, hf = models[name]
    ids = _ids(6, 5)
    with torch.no_grad():
        expected = hf.generate(ids[None], attention_mask=torch.ones(1, 6, dtype=torch.long), max_new_tokens=10,
                               do_sample=False)[0].tolist()
    cache, out, step = model.new_cache(), ids.tolist(), ids
    for _ in range(10):
        token = int(model.forward([step], [cache])[0][-1].argmax())
        out.append(token)
        step = torch.tensor([token])
    assert out == expected


# ---------------------------------------------------------------- each feature matters on these inputs


def _changes(model, ids: torch.Tensor, edit, undo) -> float:
    before = model.forward([ids])[0]
    edit()
    try:
        return _diff(model.forward([ids])[0], before)
    finally:
        undo()


def test_gpt_oss_features_are_exercised(models):
    model, _ = models["gpt_oss"]
    cfg = model.cfg
    assert cfg.family == "gpt_oss" and cfg.sliding_layers == (0,) and cfg.sliding_window == 4
    assert cfg.yarn is not None and model.rope.attention_scaling > 1
    ids = _ids(13, 6)
    sliding, full = model.attention
    assert sliding.window == 4 and full.window is None and sliding.sinks.shape == (cfg.num_heads,)

    def swap(obj, attr: str, value):
        old = getattr(obj, attr)
        return (lambda: setattr(obj, attr, value)), (lambda: setattr(obj, attr, old))

    layer = model.w.layers[0]
    checks = {
        "sinks": swap(full, "sinks", None),
        "window": swap(sliding, "window", None),
        "o bias": swap(full.w, "o_bias", None),
        "q bias": swap(full.w, "q_bias", None),
        "router bias": swap(layer, "router_bias", None),
        "yarn": swap(model, "rope", RotaryEmbedding(cfg.head_dim, cfg.rope_theta)),
    }
    for what, (edit, undo) in checks.items():
        assert _changes(model, ids, edit, undo) > 1e-3, what
    shard = model.experts.shards[(0, 0)]
    for bias in ("gate_up_bias", "down_bias"):
        assert _changes(model, ids, *swap(shard, bias, None)) > 1e-3, bias
    # the window only changes positions past it
    edit, undo = swap(sliding, "window", None)
    before = model.forward([ids])[0]
    edit()
    unwindowed = model.forward([ids])[0]
    undo()
    assert _diff(unwindowed[:4], before[:4]) <= 1e-6


def test_qwen3_moe_per_head_qk_norm_and_dense_layer(models):
    model, _ = models["qwen3_moe"]
    cfg = model.cfg
    assert cfg.family == "qwen3_moe" and cfg.qk_norm_per_head and not cfg.qk_norm
    assert cfg.head_dim == 16 and cfg.num_heads * cfg.head_dim != cfg.hidden_size  # explicit head_dim
    assert cfg.moe_layers == (0, 2) and model.w.layers[1].dense_mlp is not None and not cfg.has_shared_expert
    assert model.w.layers[0].attention.q_norm.shape == (16,)
    attn = model.attention[0]
    assert attn.qk_norm_per_head
    weights = attn.w
    saved = weights.q_norm, weights.k_norm

    def edit():
        weights.q_norm = torch.ones_like(saved[0]) * 3  # a different per-head norm weight: the norm is applied
        weights.k_norm = torch.ones_like(saved[1]) * 3

    def undo():
        weights.q_norm, weights.k_norm = saved

    assert _changes(model, _ids(9, 7), edit, undo) > 1e-3


@pytest.mark.parametrize("overrides", [
    {"use_sliding_window": True, "sliding_window": 4},  # every layer windowed
    {"decoder_sparse_step": 2, "mlp_only_layers": [], "num_hidden_layers": 4, "norm_topk_prob": False},
])
def test_qwen3_moe_variants_match_transformers(tmp_path, overrides):
    from transformers import AutoModelForCausalLM

    folder = write_hf_checkpoint("qwen3_moe", tmp_path / "variant", seed=30, fused=True, **overrides)
    model = load_reference_model(folder)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    if "sliding_window" in overrides:
        assert model.cfg.sliding_layers == (0, 1, 2) and all(a.window == 4 for a in model.attention)
    else:
        assert model.cfg.moe_layers == (1, 3) and not model.cfg.norm_topk_prob
    ids = _ids(11, 8)
    theirs = hf_logits(hf, ids)
    assert _diff(model.forward([ids])[0], theirs) <= TOL
    assert _diff(_incremental(model, ids, list(range(1, 11))), theirs) <= TOL


# ---------------------------------------------------------------- config parsing


def _qwen3_raw(**overrides) -> dict:
    raw = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 96, "hidden_size": 32,
           "intermediate_size": 64, "moe_intermediate_size": 24, "num_hidden_layers": 4, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2,
           "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []}
    return raw | overrides


def _gpt_oss_raw(**overrides) -> dict:
    raw = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": 96, "hidden_size": 64,
           "intermediate_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 128,
           "layer_types": ["sliding_attention", "full_attention"] * 2, "rope_theta": 150000,
           "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                            "truncate": False, "original_max_position_embeddings": 4096}}
    return raw | overrides


def test_qwen3_moe_config():
    cfg = config_from_dict(_qwen3_raw())
    assert (cfg.family, cfg.num_experts, cfg.head_dim, cfg.qk_norm_per_head, cfg.norm_topk_prob) == (
        "qwen3_moe", 8, 16, True, True)
    assert cfg.moe_layers == (0, 1, 2, 3) and not cfg.attention_bias and cfg.sliding_layers == ()
    assert config_from_dict(_qwen3_raw(decoder_sparse_step=2, mlp_only_layers=[3])).moe_layers == (1,)
    assert config_from_dict(_qwen3_raw(num_experts=None, num_local_experts=6)).num_experts == 6  # transformers 5
    windowed = config_from_dict(_qwen3_raw(use_sliding_window=True, sliding_window=16))
    assert windowed.sliding_window == 16 and windowed.sliding_layers == (0, 1, 2, 3)
    assert config_from_dict(_qwen3_raw(sliding_window=16)).sliding_layers == ()  # off unless use_sliding_window
    with pytest.raises(CheckpointError, match="'intermediate_size'"):
        config_from_dict({k: v for k, v in _qwen3_raw(mlp_only_layers=[1]).items() if k != "intermediate_size"})


def test_gpt_oss_config():
    cfg = config_from_dict(_gpt_oss_raw())
    assert cfg.family == "gpt_oss" and cfg.num_experts == 4 and cfg.sliding_layers == (0, 2)
    assert cfg.attention_sinks and cfg.attention_bias and cfg.attention_out_bias and cfg.router_bias
    assert cfg.router_kind == "topk_softmax" and cfg.expert_activation == "clamped_swiglu" and cfg.swiglu_limit == 7.0
    assert cfg.rope_theta == 150000 and cfg.yarn.factor == 32.0 and not cfg.yarn.truncate
    assert cfg.yarn.original_max_position_embeddings == 4096 and cfg.quantization is None
    assert cfg.expert_param_count() == 3 * 64 * 32 + 2 * 32 + 64
    default_types = config_from_dict({k: v for k, v in _gpt_oss_raw().items() if k != "layer_types"})
    assert default_types.sliding_layers == (0, 2)  # transformers' default alternation
    quantised = config_from_dict(_gpt_oss_raw(quantization_config={"quant_method": "mxfp4"}))
    assert quantised.quantization == "mxfp4"
    with pytest.raises(CheckpointError, match="quant_method.*'fp8'") as err:
        config_from_dict(_gpt_oss_raw(quantization_config={"quant_method": "fp8"}), source="m/config.json")
    assert "m/config.json" in str(err.value)
    with pytest.raises(CheckpointError, match="rope_type"):
        config_from_dict(_gpt_oss_raw(rope_scaling={"rope_type": "longrope", "factor": 4.0}))


def test_yarn_tables_equal_transformers():
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from expertmesh.experts.rope_yarn import yarn_inv_freq

    for truncate in (False, True):
        params = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                  "truncate": truncate, "original_max_position_embeddings": 4096}
        hf_cfg = GptOssConfig(head_dim=64, rope_parameters=params, max_position_embeddings=131072)
        inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg)
        ours = config_from_dict(_gpt_oss_raw(head_dim=64, rope_scaling=params))
        our_inv, our_factor = yarn_inv_freq(64, ours.rope_theta, ours.yarn)
        assert torch.equal(our_inv, inv_freq) and our_factor == factor


def test_fused_fixture_configs_are_the_families(folders):
    for name in ("mixtral_fused", "qwen2_moe_fused", "olmoe_fused", "qwen3_moe_fused"):
        raw = json.loads((folders[name] / "config.json").read_text())
        assert config_from_dict(raw).family == name.removesuffix("_fused")

