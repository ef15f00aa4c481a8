"""MiMo-V2-Flash (hybrid sliding-window / full attention, twice the KV heads and learned sinks on the sliding layers,
per-kind RoPE bases, partial RoPE, values narrower than q/k and scaled, DeepSeek-V3's grouped sigmoid router with
a selection bias and scaling, a dense first layer): the in-process reference against `transformers` on tiny
checkpoints it saved itself, both expert layouts, fp32 and bf16, prompts six windows long; chunked prefill and paged
decode == the whole prompt; each quirk shown to matter; the per-layer KV cache shapes; plan-cluster figures; config
refusals.

Tolerance: max |Δlogits| ≤ 1e-4 in float32 (logits of order 1); bf16 within a few bf16 ulps of the logit scale.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from safetensors import safe_open

from expertmesh.cluster.memory_plan import model_memory
from expertmesh.experts.config import config_from_dict
from expertmesh.experts.errors import CheckpointError
from expertmesh.experts.modeling import MoEDecoder
from expertmesh.experts.reference import load_reference_model
from tests.tiny_checkpoints import (
    assert_by_transformers_yardstick,
    chunked_logits,
    greedy_tokens,
    hf_logits,
    load_hf_model,
    max_diff,
)
from tests.tiny_mimo_v2_flash import VOCAB, WINDOW, hf_config, quantize_fp8, write_mimo_checkpoint

TOL = 1e-4
LAYOUTS = ("per_expert", "fused")


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("mimo_ckpt")
    return {layout: write_mimo_checkpoint(root / layout, seed=4, fused=layout == "fused") for layout in LAYOUTS}


@pytest.fixture(scope="module")
def models(folders) -> dict:
    return {layout: (load_reference_model(folder), load_hf_model(folder)) for layout, folder in folders.items()}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_batched_sequences_match_transformers(models, layout):
    model, hf = models[layout]
    ids0, ids1 = _ids(4, 1), _ids(6 * WINDOW + 2, 2)
    out = model.forward([ids0, ids1])
    with torch.no_grad():
        for ids, ours in zip((ids0, ids1), out):
            theirs = hf_logits(hf, ids)
            assert max_diff(ours, theirs) <= TOL
            assert theirs.std().item() > 0.05


@pytest.mark.parametrize("layout", LAYOUTS)
def test_greedy_decode_equals_transformers_generate(models, layout):
    model, hf = models[layout]
    ids = _ids(20, 6)
    with torch.no_grad():
        expected = hf.generate(ids[None], attention_mask=torch.ones(1, 20, dtype=torch.long), max_new_tokens=12,
                               do_sample=False)[0, 20:].tolist()
    assert greedy_tokens(model, ids.tolist(), 12) == expected


def test_chunked_prefill_and_batched_decode_equal_whole_prompt(models):
    model, _ = models["per_expert"]
    ids = _ids(23, 3)
    full = model.forward([ids])[0]
    assert max_diff(chunked_logits(model, ids, [3, 4, 11, 17]), full) <= 1e-5
    assert max_diff(chunked_logits(model, ids, list(range(1, 23))), full) <= 1e-5
    a, b = _ids(12, 4), _ids(4, 5)
    ca, cb = model.new_cache(), model.new_cache()
    model.forward([a[:11]], [ca])
    model.forward([b[:3]], [cb])
    step = model.forward([a[11:12], b[3:4]], [ca, cb])  # one past the window, one inside it
    assert max_diff(step[0], model.forward([a])[0][11:]) <= 1e-5
    assert max_diff(step[1], model.forward([b])[0][3:]) <= 1e-5


def test_bf16_reference_is_as_close_to_float32_as_transformers_bf16(folders, models):
    folder = folders["per_expert"]
    ours, theirs = load_reference_model(folder, dtype=torch.bfloat16), load_hf_model(folder, torch.bfloat16)
    assert_by_transformers_yardstick(ours, theirs, models["per_expert"][1], _ids(16, 7))
    assert ours.w.layers[1].router.dtype == torch.float32  # the gate stays float32, as transformers keeps it


def test_fixture_config_and_per_layer_cache_shapes(models):
    model, _ = models["per_expert"]
    cfg = model.cfg
    assert cfg.sliding_layers == (1, 2) and cfg.moe_layers == (1, 2, 3) and cfg.rotary_dim == 4
    assert cfg.sliding_window == WINDOW and cfg.sliding_rope_theta == 10000.0 and cfg.rope_theta == 100.0
    assert model.w.layers[0].dense_mlp is not None and model.w.layers[1].shared_expert is None
    specs = model.cache_specs()  # the full layers cache 1 KV head, the sliding ones 2; values 8 wide
    assert specs[0] == {"k": (1, 12), "v": (1, 8)} and specs[1] == {"k": (2, 12), "v": (2, 8)}
    assert [a.sinks is not None for a in model.attention] == [False, True, True, False]
    assert model.w.layers[1].router_correction_bias.abs().sum() > 0


@pytest.mark.parametrize("change", ["no_window", "no_sinks", "one_theta", "no_value_scale", "no_bias"])
def test_each_quirk_changes_the_logits(models, change):
    """Serving without one quirk moves the logits far beyond the tolerance: the exactness above covers each."""
    model, hf = models["per_expert"]
    cfg, weights = model.cfg, model.w
    if change == "no_sinks":
        weights = dataclasses.replace(weights, layers=[dataclasses.replace(
            layer, attention=dataclasses.replace(layer.attention, sinks=None)) for layer in weights.layers])
    elif change == "no_bias":
        weights = dataclasses.replace(weights, layers=[dataclasses.replace(
            layer, router_correction_bias=None if layer.router is None else torch.zeros(cfg.num_experts))
            for layer in weights.layers])
    else:
        cfg = {"no_window": dataclasses.replace(cfg, sliding_window=None),
               "one_theta": dataclasses.replace(cfg, sliding_rope_theta=None),
               "no_value_scale": dataclasses.replace(cfg, attention_value_scale=1.0)}[change]
    other = MoEDecoder(cfg, weights, model.experts)
    ids = _ids(6 * WINDOW, 9)
    with torch.no_grad():
        assert max_diff(other.forward([ids])[0], hf_logits(hf, ids)) > 100 * TOL


def test_fp8_checkpoint_equals_transformers_on_its_dequantised_weights(tmp_path):
    """Block-scaled FP8 files (block 4 x 4: the tiny dims are multiples): the reference equals `transformers` run on
    the same weights dequantised by `transformers`' own Fp8Dequantize, written back as a plain checkpoint."""
    import json

    from safetensors.torch import load_file, save_file
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    fp8 = quantize_fp8(write_mimo_checkpoint(tmp_path / "fp8", seed=12), (4, 4))
    tensors = load_file(str(fp8 / "model.safetensors"))
    assert tensors["model.layers.1.mlp.experts.0.gate_proj.weight"].dtype == torch.float8_e4m3fn
    assert tensors["model.layers.1.mlp.gate.weight"].dtype == torch.float32  # the router is not converted
    plain = tmp_path / "plain"
    plain.mkdir()
    dequantised = {name: Fp8Dequantize(None)._dequantize_one(t, tensors[name + "_scale_inv"], torch.float32)
                   if name + "_scale_inv" in tensors else t
                   for name, t in tensors.items() if not name.endswith("_scale_inv")}
    save_file(dequantised, str(plain / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((fp8 / "config.json").read_text())
    del config["quantization_config"]
    (plain / "config.json").write_text(json.dumps(config))
    model = load_reference_model(fp8)
    assert model.cfg.fp8_block == (4, 4) and model.cfg.quantization == "fp8"
    hf = load_hf_model(plain)
    ids = _ids(18, 13)
    with torch.no_grad():
        assert max_diff(model.forward([ids])[0], hf_logits(hf, ids)) <= TOL
        expected = hf.generate(ids[None], attention_mask=torch.ones(1, 18, dtype=torch.long), max_new_tokens=6,
                               do_sample=False)[0, 18:].tolist()
    assert greedy_tokens(model, ids.tolist(), 6) == expected


# ---------------------------------------------------------------- memory and config


def test_model_bytes_and_kv_per_token_equal_the_checkpoint(folders):
    folder = folders["per_expert"]
    cfg = load_reference_model(folder).cfg
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        stored = sum(math.prod(f.get_slice(key).get_shape()) for key in f.keys())
    mem = model_memory(cfg, "float32")
    assert mem.total_bytes == 4 * stored
    assert mem.kv_bytes_per_token == 4 * (2 * 1 * 20 + 2 * 2 * 20)  # full: 1 head x (12 + 8); sliding: 2 heads


def test_plan_cluster_cli(folders, capsys):
    import json

    from expertmesh.ops.cli import main

    assert main(["plan-cluster", "--model", str(folders["fused"]), "--gpu-type", "L4", "--gpus-per-node", "4",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["family"] == "mimo_v2_flash"


def test_published_config_gives_transformers_parameter_count():
    """MiMo-V2-Flash's published size-setting values (transformers' defaults are the published model's)."""
    from transformers import MiMoV2FlashConfig, MiMoV2FlashForCausalLM

    raw = MiMoV2FlashConfig().to_dict() | {"architectures": ["MiMoV2FlashForCausalLM"]}
    mem = model_memory(config_from_dict(raw), "bfloat16")
    with torch.device("meta"):
        hf = MiMoV2FlashForCausalLM(MiMoV2FlashConfig())
    # the state dict: parameters and the persistent buffers a checkpoint holds (the correction biases)
    assert mem.total_bytes == 2 * sum(t.numel() for t in hf.state_dict().values())
    assert mem.total_bytes / 2 / 1e9 == pytest.approx(308.78, abs=0.01)  # published: "309B total parameters"


def _raw(**overrides) -> dict:
    raw = hf_config().to_dict()
    raw["architectures"] = ["MiMoV2FlashForCausalLM"]
    return raw | overrides


def test_published_spellings_parse():
    cfg = config_from_dict(_raw(sliding_window=None, sliding_window_size=128, rope_parameters=None,
                                routed_scaling_factor=None, layer_types=None, mlp_layer_types=None,
                                num_hidden_layers=12))
    assert cfg.sliding_window == 129 and cfg.rope_theta == 5e6 and cfg.sliding_rope_theta == 1e4
    assert cfg.sliding_layers == (1, 2, 3, 4, 6, 7, 8, 9, 10) and cfg.moe_layers == tuple(range(1, 12))
    assert cfg.routed_scaling_factor == 1.0 and cfg.rotary_dim == 4  # int(12 * 0.334)


@pytest.mark.parametrize("overrides,key", [
    (dict(rope_parameters={"full_attention": {"rope_type": "yarn", "factor": 2.0},
                           "sliding_attention": {"rope_type": "default"}}), "rope_type"),
    (dict(rope_parameters={"full_attention": {"rope_theta": 1e4, "partial_rotary_factor": 0.5},
                           "sliding_attention": {"rope_theta": 1e4, "partial_rotary_factor": 0.25}}),
     "partial_rotary_factor"),
    (dict(layer_types=["full_attention", "chunked_attention", "full_attention", "full_attention"]), "layer_types"),
    (dict(mlp_layer_types=["dense", "moe", "sparse", "sparse"]), "mlp_layer_types"),
    (dict(n_group=3), "n_group"),
    (dict(sliding_window=0), "sliding_window"),
    (dict(quantization_config={"quant_method": "awq"}), "quant_method"),
])
def test_config_refusals_name_the_key(overrides, key):
    with pytest.raises(CheckpointError, match=key):
        config_from_dict(_raw(**overrides))
