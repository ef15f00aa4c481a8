"""MiniMax-M2 (sigmoid router + selection bias, q/k norm over all heads, partial RoPE, FP8 as published), ERNIE 4.5
MoE (softmax router + selection bias and norm_min, interleaved RoPE, dense and MoE layers, shared experts, tied
embeddings) and Hunyuan-A13B (per-head q/k norm after RoPE, NTK-alpha RoPE, shared MLP): the in-process reference
model against `transformers` on tiny checkpoints it saved itself, in both expert layouts, fp32 and bf16; the two new
router paths against transformers' router modules; chunked prefill == whole prompt; config refusals.

Tolerance: max |Δlogits| ≤ 1e-4 in float32 (logits of order 1); bf16 within a few bf16 ulps of the logit scale.
"""

from __future__ import annotations

import pytest
import torch

from expertmesh.experts.checkpoint import CheckpointReader
from expertmesh.experts.config import config_from_dict, load_model_config
from expertmesh.experts.errors import CheckpointError
from expertmesh.experts.gating import route_for_model, route_sigmoid_grouped, route_softmax_biased
from expertmesh.experts.reference import load_reference_model
from expertmesh.experts.weights import check_checkpoint, load_dense_weights
from tests.tiny_checkpoints import (
    assert_by_transformers_yardstick,
    chunked_logits,
    greedy_tokens,
    hf_logits,
    load_hf_model,
    max_diff,
)
from tests.tiny_fam1 import KINDS, VOCAB, hf_config, write_fam1_checkpoint

TOL = 1e-4
LAYOUTS = ("per_expert", "fused")


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("fam1_ckpt")
    return {(kind, layout): write_fam1_checkpoint(kind, root / f"{kind}_{layout}", seed=i, fused=layout == "fused")
            for i, kind in enumerate(KINDS) for layout in LAYOUTS}


@pytest.fixture(scope="module")
def models(folders) -> dict:
    return {key: (load_reference_model(folder), load_hf_model(folder)) for key, folder in folders.items()}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", KINDS)
def test_batched_sequences_match_transformers(models, kind, layout):
    model, hf = models[(kind, layout)]
    ids0, ids1 = _ids(9, 1), _ids(40, 2)
    out = model.forward([ids0, ids1])
    for ids, ours in zip((ids0, ids1), out):
        theirs = hf_logits(hf, ids)
        assert max_diff(ours, theirs) <= TOL
        assert theirs.std().item() > 0.05


@pytest.mark.parametrize("kind", KINDS)
def test_chunked_prefill_and_batched_decode_equal_whole_prompt(models, kind):
    model, _ = models[(kind, "per_expert")]
    ids = _ids(33, 3)
    full = model.forward([ids])[0]
    assert max_diff(chunked_logits(model, ids, [7, 8, 20, 32]), full) <= 1e-5
    assert max_diff(chunked_logits(model, ids, list(range(1, 33))), full) <= 1e-5
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
    ids = _ids(24, 6)
    with torch.no_grad():
        expected = hf.generate(ids[None], attention_mask=torch.ones(1, 24, dtype=torch.long), max_new_tokens=12,
                               do_sample=False)[0, 24:].tolist()
    assert greedy_tokens(model, ids.tolist(), 12) == expected


@pytest.mark.parametrize("kind", KINDS)
def test_bf16_reference_is_as_close_to_float32_as_transformers_bf16(folders, models, kind):
    folder = folders[(kind, "per_expert")]
    ours, theirs = load_reference_model(folder, dtype=torch.bfloat16), load_hf_model(folder, torch.bfloat16)
    prompt = torch.tensor([3, 17, 5, 42, 9, 11, 60, 2, 33, 70, 8, 1])
    assert_by_transformers_yardstick(ours, theirs, models[(kind, "per_expert")][1], prompt)
    # routers as transformers holds them in bf16: ERNIE's and Hunyuan's gates float32, MiniMax's in the model dtype
    router = ours.w.layers[1].router
    assert router.dtype == (torch.bfloat16 if kind == "minimax_m2" else torch.float32)


def test_fixture_configs_and_what_they_exercise(models):
    minimax, ernie, hunyuan = (models[(k, "per_expert")][0] for k in KINDS)
    assert minimax.cfg.qk_norm and minimax.cfg.rotary_dim == 8 and minimax.cfg.head_dim == 16
    assert minimax.w.layers[0].attention.q_norm.shape == (4 * 16,)  # one norm over all heads
    assert minimax.cfg.router_kind == "sigmoid_grouped" and minimax.w.layers[0].router_correction_bias.abs().sum() > 0
    assert ernie.cfg.moe_layers == (1, 2) and ernie.w.layers[0].dense_mlp is not None
    assert ernie.cfg.tie_word_embeddings and ernie.w.lm_head is ernie.w.embed
    assert ernie.w.layers[1].shared_expert is not None and ernie.w.layers[1].shared_expert_gate is None
    assert ernie.cfg.rope_pairs_interleaved and ernie.cfg.router_kind == "softmax_biased"
    assert hunyuan.cfg.qk_norm_after_rope and hunyuan.w.layers[0].attention.q_norm.shape == (8,)
    assert hunyuan.cfg.rope_theta == pytest.approx(10000.0 * 1000.0 ** (8 / 6))  # NTK-alpha base
    assert hunyuan.w.layers[0].shared_expert.down.shape == (32, 24)


@pytest.mark.parametrize("kind", ["minimax_m2", "ernie4_5_moe"])
def test_the_selection_bias_changes_some_experts(models, kind):
    """On the fixtures the correction bias picks other experts for some tokens (else exactness would not cover it)."""
    model, _ = models[(kind, "per_expert")]
    layer = model.cfg.moe_layers[0]
    seen = {}
    run = model.experts.run

    def recording(i, h, routing):
        seen.setdefault(i, h)
        return run(i, h, routing)

    model.experts.run = recording
    try:
        model.forward([_ids(40, 8)])
    finally:
        del model.experts.run
    w = model.w.layers[layer]
    logits = torch.nn.functional.linear(seen[layer].to(w.router.dtype), w.router)
    with_bias = route_for_model(model.cfg, logits, w.router_correction_bias)
    without = route_for_model(model.cfg, logits, torch.zeros_like(w.router_correction_bias))
    assert not torch.equal(with_bias.experts.sort(-1).values, without.experts.sort(-1).values)


# ---------------------------------------------------------------- routers against transformers' modules


def test_ernie_router_matches_transformers():
    from transformers.models.ernie4_5_moe.modeling_ernie4_5_moe import Ernie4_5_MoeTopKRouter

    torch.manual_seed(0)
    cfg = hf_config("ernie4_5_moe", moe_norm_min=0.9)
    router = Ernie4_5_MoeTopKRouter(cfg)
    with torch.no_grad():
        router.weight.normal_(0, 0.5)
        router.moe_statics.e_score_correction_bias.normal_(0, 0.1)
    h = torch.randn(64, cfg.hidden_size)
    _, weights, experts = router(h)
    ours = route_softmax_biased(torch.nn.functional.linear(h, router.weight), cfg.moe_k,
                                router.moe_statics.e_score_correction_bias.reshape(-1), 0.9)
    order = experts.sort(-1)
    assert torch.equal(ours.experts.sort(-1).values, order.values)
    theirs = torch.gather(weights, 1, order.indices)
    mine = torch.gather(ours.weights, 1, ours.experts.sort(-1).indices)
    assert max_diff(mine, theirs) <= 1e-6
    assert bool((ours.weights.sum(-1) < 0.999).any())  # norm_min 0.9 bit: some rows sum below 1


def test_minimax_router_matches_transformers():
    from transformers.models.minimax_m2.modeling_minimax_m2 import MiniMaxM2TopKRouter

    torch.manual_seed(1)
    cfg = hf_config("minimax_m2")
    router = MiniMaxM2TopKRouter(cfg)
    with torch.no_grad():
        router.weight.normal_(0, 0.5)
    bias = torch.randn(cfg.num_local_experts) * 0.3
    h = torch.randn(64, cfg.hidden_size)
    _, weights, experts = router(h, bias)
    ours = route_sigmoid_grouped(torch.nn.functional.linear(h, router.weight), cfg.num_experts_per_tok, bias)
    theirs_sorted = experts.sort(-1)
    assert torch.equal(ours.experts.sort(-1).values, theirs_sorted.values)
    mine = torch.gather(ours.weights, 1, ours.experts.sort(-1).indices)
    assert max_diff(mine, torch.gather(weights, 1, theirs_sorted.indices)) <= 1e-6


def test_softmax_biased_capacity_and_dropped_slots():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]] * 6)
    capped = route_softmax_biased(logits, 2, torch.zeros(4), 1e-12, capacity_factor=0.5)
    assert capped.rerouted > 0
    assert int(capped.tokens_per_expert(4).max()) <= 2
    assert torch.allclose(capped.weights.sum(-1), torch.ones(6))


# ---------------------------------------------------------------- MiniMax-M2 FP8 as published


@pytest.mark.parametrize("block", [(8, 8), (128, 128)])
def test_minimax_fp8_checkpoint_equals_transformers_dequantised_model(tmp_path, block):
    from safetensors.torch import load_file
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    plain = write_fam1_checkpoint("minimax_m2", tmp_path / "plain", seed=11)
    fp8 = write_fam1_checkpoint("minimax_m2", tmp_path / "fp8", seed=11, fp8_block=block)
    cfg = load_model_config(fp8)
    assert cfg.fp8_block == block and cfg.quantization == "fp8"
    check_checkpoint(CheckpointReader(fp8))
    tensors = load_file(str(fp8 / "model.safetensors"))
    assert tensors["model.layers.0.block_sparse_moe.experts.0.w1.weight"].dtype == torch.float8_e4m3fn
    assert tensors["model.layers.0.block_sparse_moe.gate.weight"].dtype == torch.float32  # not converted
    hf = load_hf_model(plain)
    dequantised = {name[: -len("_scale_inv")]: Fp8Dequantize(None)._dequantize_one(
        tensors[name[: -len("_scale_inv")]], scale, torch.float32) for name, scale in tensors.items()
        if name.endswith("_scale_inv")}
    params = dict(hf.named_parameters())
    roles = {"w1": "gate", "w3": "up", "w2": "down"}
    with torch.no_grad():
        for name, value in dequantised.items():
            if name in params:
                params[name].copy_(value)
                continue
            # routed experts: block_sparse_moe.experts.E.wN on disk, fused [E, 2I, H] / [E, H, I] in transformers
            parts = name.split(".")
            layer, expert, role = int(parts[2]), int(parts[5]), roles[parts[6]]
            experts = hf.model.layers[layer].mlp.experts
            inter = experts.down_proj.shape[-1]
            target = {"gate": experts.gate_up_proj[expert, :inter], "up": experts.gate_up_proj[expert, inter:],
                      "down": experts.down_proj[expert]}[role]
            target.copy_(value)
    dense = load_dense_weights(CheckpointReader(fp8))
    assert torch.equal(dense.layers[1].attention.q, dequantised["model.layers.1.self_attn.q_proj.weight"])
    model = load_reference_model(fp8)
    ids = _ids(20, 12)
    assert max_diff(model.forward([ids])[0], hf_logits(hf, ids)) <= TOL
    with torch.no_grad():
        expected = hf.generate(ids[None], attention_mask=torch.ones(1, 20, dtype=torch.long), max_new_tokens=6,
                               do_sample=False)[0, 20:].tolist()
    assert greedy_tokens(model, ids.tolist(), 6) == expected


# ---------------------------------------------------------------- config parsing and refusals


def _raw(kind: str, **overrides) -> dict:
    raw = hf_config(kind).to_dict()
    raw["architectures"] = {"minimax_m2": ["MiniMaxM2ForCausalLM"], "ernie4_5_moe": ["Ernie4_5_MoeForCausalLM"],
                            "hunyuan_v1_moe": ["HunYuanMoEV1ForCausalLM"]}[kind]
    return raw | overrides


def test_published_config_spellings_parse():
    # MiniMax-M2 publishes partial RoPE as `rotary_dim`, the FP8 block in quantization_config
    cfg = config_from_dict(_raw("minimax_m2", rotary_dim=4, rope_parameters=None, rope_theta=5e6,
                                quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]}))
    assert cfg.rotary_dim == 4 and cfg.rope_theta == 5e6 and cfg.fp8_block == (128, 128)
    # Hunyuan-A13B: rope_scaling {type: dynamic, alpha}, per-layer lists of one value
    cfg = config_from_dict(_raw("hunyuan_v1_moe", rope_parameters=None, rope_theta=10000.0,
                                rope_scaling={"type": "dynamic", "alpha": 1000.0, "factor": 1.0},
                                moe_topk=[2, 2], num_experts=[4, 4], moe_intermediate_size=[24, 24],
                                num_shared_expert=[1, 1]))
    assert cfg.top_k == 2 and cfg.num_experts == 4 and cfg.rope_theta == 10000.0 * 1000.0 ** (8 / 6)
    # ERNIE: moe_layer_end_index -1, interval 2, tie default
    raw = _raw("ernie4_5_moe", num_hidden_layers=6, moe_layer_end_index=-1, moe_layer_interval=2)
    del raw["tie_word_embeddings"]
    cfg = config_from_dict(raw)
    assert cfg.moe_layers == (1, 3, 5) and cfg.tie_word_embeddings and cfg.top_k == 3


@pytest.mark.parametrize("kind,overrides,key", [
    ("hunyuan_v1_moe", dict(moe_topk=[2, 1]), "moe_topk"),
    ("hunyuan_v1_moe", dict(num_experts=[4, 8]), "num_experts"),
    ("hunyuan_v1_moe", dict(moe_intermediate_size=16), "moe_intermediate_size"),
    ("hunyuan_v1_moe", dict(rope_parameters={"rope_type": "linear", "factor": 2.0}), "rope_type"),
    ("hunyuan_v1_moe", dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0}), "rope_type"),
    ("ernie4_5_moe", dict(use_bias=True), "use_bias"),
    ("ernie4_5_moe", dict(moe_k=[2, 2]), "moe_k"),
    ("ernie4_5_moe", dict(rope_parameters={"rope_type": "yarn", "factor": 2.0}), "rope_parameters"),
    ("ernie4_5_moe", dict(moe_layer_interval=0), "moe_layer_interval"),
    ("minimax_m2", dict(scoring_func="softmax"), "scoring_func"),
    ("minimax_m2", dict(attn_type_list=[0, 1]), "attn_type_list"),
    ("minimax_m2", dict(shared_intermediate_size=64), "shared_intermediate_size"),
    ("minimax_m2", dict(rotary_dim=5), "rotary_dim"),
    ("minimax_m2", dict(quantization_config={"quant_method": "awq"}), "quant_method"),
])
def test_config_refusals_name_the_key(kind, overrides, key):
    with pytest.raises(CheckpointError, match=key):
        config_from_dict(_raw(kind, **overrides))


@pytest.mark.parametrize("kind,overrides", [
    ("minimax_m2", dict(rope_parameters={"rope_type": "default", "rope_theta": 5e4, "partial_rotary_factor": 1.0})),
    ("ernie4_5_moe", dict(num_hidden_layers=4, moe_layer_interval=2, moe_layer_start_index=0, moe_num_shared_experts=0,
                          tie_word_embeddings=False)),
    ("hunyuan_v1_moe", dict(attention_bias=True, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
])
def test_switch_variants_match_transformers(tmp_path, kind, overrides):
    folder = write_fam1_checkpoint(kind, tmp_path / kind, seed=21, **overrides)
    model, hf = load_reference_model(folder), load_hf_model(folder)
    if kind == "ernie4_5_moe":  # MoE on layers 1 and 3 only, no shared experts, an lm_head of its own
        assert model.cfg.moe_layers == (1, 3) and model.w.layers[1].shared_expert is None
        assert model.w.lm_head is not model.w.embed
    if kind == "hunyuan_v1_moe":
        assert model.w.layers[0].attention.o_bias.abs().sum() > 0  # drawn at random by the writer
    ids = _ids(30, 22)
    theirs = hf_logits(hf, ids)
    assert max_diff(model.forward([ids])[0], theirs) <= TOL and theirs.std().item() > 0.05
    assert max_diff(chunked_logits(model, ids, [5, 6, 19]), theirs) <= TOL
