"""DeepSeek-V2 (with and without q_lora_rank, greedy and group-limited routing), DeepSeek-V3 (YaRN, sigmoid
grouped routing, correction bias) and GLM-4.5 (GQA, partial RoPE, per-head q/k norm): the in-process reference model
against `transformers` on tiny checkpoints it saved itself; FP8 block-scaled checkpoints against transformers'
dequantisation; multi-token-prediction layers ignored.

Tolerance: max |Δlogits| ≤ 1e-4 in float32 (logits of order 1).
"""

from __future__ import annotations

import json

import pytest
import torch

from expertmesh.experts.checkpoint import CheckpointReader
from expertmesh.experts.config import config_from_dict, load_model_config
from expertmesh.experts.errors import CheckpointError
from expertmesh.experts.reference import all_shards, load_reference_model
from expertmesh.experts.weights import (
    check_checkpoint,
    dense_tensor_names,
    expert_shard_names,
    load_dense_weights,
)
from tests.tiny_checkpoints import chunked_logits, hf_logits, load_hf_model, max_diff
from tests.tiny_deepseek import KINDS, VOCAB, hf_with_transformers_dequantisation, write_deepseek_checkpoint

TOL = 1e-4
LAYOUTS = ("per_expert", "fused")  # fused: transformers' stacked experts (save_original_format=False)
WITH_MTP = ("deepseek_v3", "glm4_moe")  # published with multi-token-prediction layers


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def _greedy(model, ids: torch.Tensor, steps: int) -> list[int]:
    cache, out, nxt = model.new_cache(), ids.tolist(), ids
    for _ in range(steps):
        token = int(model.forward([nxt], [cache])[0][-1].argmax())
        out.append(token)
        nxt = torch.tensor([token])
    return out


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("deepseek_ckpt")
    return {(kind, layout): write_deepseek_checkpoint(kind, root / f"{kind}_{layout}", seed=i, mtp=kind in WITH_MTP,
                                                      fused=layout == "fused")
            for i, kind in enumerate(KINDS) for layout in LAYOUTS}


@pytest.fixture(scope="module")
def models(folders) -> dict:
    return {key: (load_reference_model(folder), load_hf_model(folder)) for key, folder in folders.items()}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", KINDS)
def test_batched_sequences_match_transformers(models, kind, layout):
    model, hf = models[(kind, layout)]
    ids0, ids1 = _ids(7, 1), _ids(13, 2)
    out = model.forward([ids0, ids1])
    for ids, ours in zip((ids0, ids1), out):
        theirs = hf_logits(hf, ids)
        assert max_diff(ours, theirs) <= TOL
        assert theirs.std().item() > 0.05


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", KINDS)
def test_incremental_and_batched_decode_equal_full_forward(models, kind, layout):
    model, _ = models[(kind, layout)]
    ids = _ids(15, 3)
    full = model.forward([ids])[0]
    assert max_diff(chunked_logits(model, ids, [4, 5, 10, 11]), full) <= 1e-5
    assert max_diff(chunked_logits(model, ids, list(range(1, 15))), full) <= 1e-5
    a, b = _ids(9, 4), _ids(5, 5)
    ca, cb = model.new_cache(), model.new_cache()
    model.forward([a[:6]], [ca])
    model.forward([b[:4]], [cb])
    step = model.forward([a[6:7], b[4:5]], [ca, cb])  # two decoding sequences with different histories
    assert max_diff(step[0], model.forward([a[:7]])[0][6:]) <= 1e-5
    assert max_diff(step[1], model.forward([b])[0][4:]) <= 1e-5


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", KINDS)
def test_greedy_decode_equals_transformers_generate(models, kind, layout):
    model, hf = models[(kind, layout)]
    ids = _ids(6, 6)
    with torch.no_grad():
        expected = hf.generate(ids[None], attention_mask=torch.ones(1, 6, dtype=torch.long), max_new_tokens=10,
                               do_sample=False)[0].tolist()
    assert _greedy(model, ids, 10) == expected


@pytest.mark.parametrize("kind,overrides", [
    ("glm4_moe", dict(use_qk_norm=False, attention_bias=False, partial_rotary_factor=1.0)),
    ("deepseek_v3", dict(rope_interleave=False, norm_topk_prob=False, rope_parameters=None, q_lora_rank=None)),
    ("deepseek_v2_lora", dict(attention_bias=True, first_k_dense_replace=0)),
])
def test_switch_variants_match_transformers(tmp_path, kind, overrides):
    folder = write_deepseek_checkpoint(kind, tmp_path / kind, seed=21, **overrides)
    model, hf = load_reference_model(folder), load_hf_model(folder)
    ids = _ids(14, 22)
    theirs = hf_logits(hf, ids)
    assert max_diff(model.forward([ids])[0], theirs) <= TOL and theirs.std().item() > 0.05
    assert max_diff(chunked_logits(model, ids, [5, 6, 9]), theirs) <= TOL


def test_fixture_configs_and_what_they_exercise(models):
    v2, v2_lora, v2_grouped, v3, glm = (models[(k, "per_expert")][0] for k in KINDS)
    for m in (v2, v2_lora, v2_grouped, v3, glm):
        assert m.cfg.moe_layers == (1, 2)  # first_k_dense_replace=1: layer 0 dense
        assert m.w.layers[0].dense_mlp is not None and m.w.layers[0].router is None
        assert m.w.layers[1].shared_expert is not None and m.w.layers[1].shared_expert_gate is None
    assert v2.cfg.q_lora_rank is None and v2_lora.cfg.q_lora_rank == 24
    assert v2_grouped.cfg.topk_method == "group_limited_greedy" and v2_grouped.cfg.n_group == 4
    assert v3.cfg.router_kind == "sigmoid_grouped" and v3.cfg.yarn is not None and v3.cfg.n_group == 4
    assert v3.w.layers[1].router_correction_bias.abs().sum() > 0
    assert glm.cfg.attention_kind == "gqa" and glm.cfg.rotary_dim == glm.cfg.head_dim // 2
    assert glm.cfg.qk_norm_per_head and glm.w.layers[0].attention.q_norm.shape == (glm.cfg.head_dim,)
    # the MLA cache holds one latent (r + d_rope values) per token and layer, not per-head keys and values
    cache = v3.new_cache()
    v3.forward([_ids(5, 7)], [cache])
    width = v3.cfg.kv_lora_rank + v3.cfg.qk_rope_head_dim
    assert set(cache.read(0)) == {"latent"} and cache.read(0)["latent"].shape == (5, width)
    assert v3.kv_pool.bytes_per_token(v3.cache_specs(), torch.float32) == 3 * width * 4  # per token, every layer
    assert cache.nbytes() == len(cache.blocks) * v3.kv_pool.block_size * 3 * width * 4  # whole blocks


def _record_expert_inputs(model, tokens: list[torch.Tensor]) -> dict[int, torch.Tensor]:
    """One forward; -> layer -> the hidden states [T, H] its routed experts got."""
    seen: dict[int, torch.Tensor] = {}
    run = model.experts.run

    def recording(layer: int, h: torch.Tensor, routing):
        seen[layer] = h
        return run(layer, h, routing)

    model.experts.run = recording
    try:
        model.forward(tokens)
    finally:
        del model.experts.run  # back to the class's method
    return seen


def test_group_limited_routing_is_exercised(models):
    """On the fixtures the group limit changes some tokens' experts (else the exactness tests would not cover it)."""
    import dataclasses

    from expertmesh.experts.gating import route_for_model

    for kind in ("deepseek_v2_grouped", "deepseek_v3", "glm4_moe"):
        model, _ = models[(kind, "per_expert")]
        seen = _record_expert_inputs(model, [_ids(40, 8)])
        routing = model.last_trace.routings[1]
        groups = routing.experts // (model.cfg.num_experts // model.cfg.n_group)  # [T, k]
        assert all(len(set(row)) <= model.cfg.topk_group for row in groups.tolist())
        logits = torch.nn.functional.linear(seen[1].float(), model.w.layers[1].router)
        ungrouped = route_for_model(dataclasses.replace(model.cfg, topk_method="greedy", n_group=1, topk_group=1),
                                    logits, model.w.layers[1].router_correction_bias)
        assert not torch.equal(ungrouped.experts.sort(-1).values, routing.experts.sort(-1).values)


@pytest.mark.parametrize("kind", ["deepseek_v2_grouped", "deepseek_v3"])
def test_overlap_and_capacity_work_with_the_deepseek_routers(folders, kind):
    import math

    path = folders[(kind, "per_expert")]
    plain, overlapped = load_reference_model(path), load_reference_model(path, overlap=True)
    seqs = [_ids(7, 1), _ids(5, 2)]
    for a, b in zip(plain.forward(seqs), overlapped.forward(seqs)):
        assert max_diff(a, b) <= 1e-5
    capped = load_reference_model(path, capacity_factor=0.5)
    capped.forward([_ids(24, 3)])
    cfg = capped.cfg
    routing = capped.last_trace.routings[1]
    assert routing.rerouted + routing.dropped > 0
    assert int(routing.tokens_per_expert(cfg.num_experts).max()) <= math.ceil(0.5 * 24 * cfg.top_k / cfg.num_experts)


# ---------------------------------------------------------------- MTP layers, FP8, errors


def test_mtp_layers_are_in_the_checkpoint_and_never_read(folders):
    for kind in WITH_MTP:
        reader = CheckpointReader(folders[(kind, "per_expert")])
        cfg = reader.config
        mtp = [k for k in reader.keys() if k.startswith(f"model.layers.{cfg.num_layers}.")]
        assert mtp  # the fixture carries an MTP layer ...
        wanted = set(dense_tensor_names(cfg)) | set(expert_shard_names(cfg, all_shards(reader)))
        assert not any(k.startswith(f"model.layers.{cfg.num_layers}.") for k in wanted)  # ... that nothing names
        check_checkpoint(reader)


@pytest.mark.parametrize("kind,block", [("deepseek_v3", (8, 8)), ("deepseek_v3", (128, 128)),
                                        ("glm4_moe", (8, 8)), ("deepseek_v2_lora", (8, 8))])
def test_fp8_checkpoint_equals_transformers_dequantised_model(tmp_path, kind, block):
    plain = write_deepseek_checkpoint(kind, tmp_path / "plain", seed=11)
    fp8 = write_deepseek_checkpoint(kind, tmp_path / "fp8", seed=11, fp8_block=block, mtp=True)
    cfg = load_model_config(fp8)
    assert cfg.fp8_block == block
    hf, dequantised = hf_with_transformers_dequantisation(plain, fp8)
    # the loaded dense weights are transformers' dequantised tensors, bit for bit
    dense = load_dense_weights(CheckpointReader(fp8))
    if cfg.attention_kind == "mla":
        ours = dense.layers[1].attention.kv_b
        name = "model.layers.1.self_attn.kv_b_proj.weight"
    else:
        ours = dense.layers[1].attention.q
        name = "model.layers.1.self_attn.q_proj.weight"
    assert torch.equal(ours, dequantised[name])
    assert not torch.equal(ours, load_hf_model(plain).state_dict()[name])  # FP8 did change the weights
    model = load_reference_model(fp8)
    ids = _ids(12, 12)
    assert max_diff(model.forward([ids])[0], hf_logits(hf, ids)) <= TOL
    with torch.no_grad():
        expected = hf.generate(ids[None, :5], attention_mask=torch.ones(1, 5, dtype=torch.long), max_new_tokens=6,
                               do_sample=False)[0].tolist()
    assert _greedy(model, ids[:5], 6) == expected


def test_fp8_scale_of_the_wrong_grid_fails_the_header_check(tmp_path):
    from safetensors.torch import load_file, save_file

    fp8 = write_deepseek_checkpoint("deepseek_v3", tmp_path / "fp8", seed=4, fp8_block=(8, 8))
    check_checkpoint(CheckpointReader(fp8))
    tensors = load_file(str(fp8 / "model.safetensors"))
    name = "model.layers.2.mlp.experts.3.down_proj.weight_scale_inv"
    tensors[name] = tensors[name][:, :1].contiguous()
    save_file(tensors, str(fp8 / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="experts.3.down_proj.weight_scale_inv"):
        check_checkpoint(CheckpointReader(fp8))


def test_fp8_bf16_serving_dtype(tmp_path):
    fp8 = write_deepseek_checkpoint("deepseek_v3", tmp_path / "fp8", seed=3, fp8_block=(8, 8))
    model = load_reference_model(fp8, dtype=torch.bfloat16)
    assert model.w.layers[1].attention.kv_b.dtype == torch.bfloat16
    assert model.w.layers[1].router.dtype == torch.float32  # the gate stays float32, as in transformers
    logits = model.forward([_ids(6, 1)])[0]
    assert logits.dtype == torch.float32 and bool(torch.isfinite(logits).all())


def test_config_errors_name_the_key():
    base = {"architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 32, "hidden_size": 16,
            "num_hidden_layers": 2, "num_attention_heads": 2, "num_experts_per_tok": 2, "n_routed_experts": 8,
            "moe_intermediate_size": 8, "intermediate_size": 16, "first_k_dense_replace": 1, "kv_lora_rank": 8,
            "qk_rope_head_dim": 4, "qk_nope_head_dim": 4, "v_head_dim": 4, "n_group": 4, "topk_group": 2}
    assert config_from_dict(base).moe_layers == (1,)
    assert config_from_dict(base | {"num_hidden_layers": 5, "moe_layer_freq": 2}).moe_layers == (2, 4)
    with pytest.raises(CheckpointError, match="n_group=3"):
        config_from_dict(base | {"n_group": 3})
    with pytest.raises(CheckpointError, match="quant_method"):
        config_from_dict(base | {"quantization_config": {"quant_method": "awq"}})
    with pytest.raises(CheckpointError, match="rope_type"):
        config_from_dict(base | {"rope_scaling": {"type": "longrope"}})
    with pytest.raises(CheckpointError, match="topk_method"):
        config_from_dict(base | {"architectures": ["DeepseekV2ForCausalLM"], "topk_method": "noaux_tc"})
    with pytest.raises(CheckpointError, match="DeepseekV3ForCausalLM") as err:
        config_from_dict(base | {"architectures": ["Nope"], "model_type": "nope"})
    assert "Glm4MoeForCausalLM" in str(err.value)
    # DeepSeek's published config.json spells YaRN the old way
    cfg = config_from_dict(base | {"rope_theta": 5e4, "rope_scaling": {
        "type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "mscale": 1.0,
        "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}})
    assert cfg.rope_theta == 5e4 and cfg.yarn.factor == 40 and cfg.yarn.mscale_all_dim == 1.0
    json.dumps(cfg.yarn.__dict__)
