"""Llama 4 text (top-1 sigmoid router scaling the expert input, shared expert, MoE on some layers, chunked attention
on RoPE layers, NoPE layers with attention temperature, q/k L2 norm, llama3 RoPE, the multimodal wrapper's
`language_model.` names): the in-process reference against `transformers` on tiny checkpoints it saved itself, fp32
and bf16, prompts five chunks long; chunked prefill and paged decode == the whole prompt; each quirk shown to matter;
the router and MoE block against transformers' modules; config refusals.

Tolerance: max |Δlogits| ≤ 1e-4 in float32 (logits of order 1); bf16 within a few bf16 ulps of the logit scale.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from expertmesh.experts.attention_core import prefill_mask
from expertmesh.experts.config import config_from_dict
from expertmesh.experts.errors import CheckpointError
from expertmesh.experts.ffn import GatedMLPWeights, activation, gated_mlp
from expertmesh.experts.gating import route_sigmoid_input
from expertmesh.experts.modeling import MoEDecoder
from expertmesh.experts.reference import load_reference_model
from tests.tiny_checkpoints import (
    assert_by_transformers_yardstick,
    chunked_logits,
    greedy_tokens,
    hf_logits,
    max_diff,
)
from tests.tiny_llama4 import CHUNK, VOCAB, hf_text_config, load_hf, text_config_kwargs, write_llama4_checkpoint

TOL = 1e-4
KINDS = ("scout", "maverick", "wrapper")  # wrapper: scout saved as Llama4ForConditionalGeneration


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def _text_model(hf):
    return getattr(hf, "language_model", hf)  # the wrapper's text part (its own forward needs an image path)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("llama4_ckpt")
    return {"scout": write_llama4_checkpoint(root / "scout", "scout", seed=0),
            "maverick": write_llama4_checkpoint(root / "maverick", "maverick", seed=1),
            "wrapper": write_llama4_checkpoint(root / "wrapper", "scout", seed=2, wrapper=True)}


@pytest.fixture(scope="module")
def models(folders) -> dict:
    return {kind: (load_reference_model(folder), _text_model(load_hf(folder))) for kind, folder in folders.items()}


@pytest.mark.parametrize("kind", KINDS)
def test_batched_sequences_match_transformers(models, kind):
    model, hf = models[kind]
    ids0, ids1 = _ids(9, 1), _ids(5 * CHUNK + 3, 2)  # the second spans six chunks
    out = model.forward([ids0, ids1])
    with torch.no_grad():
        for ids, ours in zip((ids0, ids1), out):
            theirs = hf_logits(hf, ids)
            assert max_diff(ours, theirs) <= TOL
            assert theirs.std().item() > 0.05


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_decode_equals_transformers_generate(models, kind):
    model, hf = models[kind]
    ids = _ids(2 * CHUNK + 5, 6)  # decoding crosses the chunk boundary at 24
    with torch.no_grad():
        expected = hf.generate(ids[None], attention_mask=torch.ones(1, ids.numel(), dtype=torch.long),
                               max_new_tokens=12, do_sample=False)[0, ids.numel():].tolist()
    assert greedy_tokens(model, ids.tolist(), 12) == expected


@pytest.mark.parametrize("kind", ["scout", "maverick"])
def test_chunked_prefill_and_batched_decode_equal_whole_prompt(models, kind):
    model, _ = models[kind]
    ids = _ids(4 * CHUNK + 1, 3)
    full = model.forward([ids])[0]
    assert max_diff(chunked_logits(model, ids, [5, 8, 13, 20, 31]), full) <= 1e-5  # pieces inside and across chunks
    # paged decode, token by token
    assert max_diff(chunked_logits(model, ids, list(range(1, ids.numel()))), full) <= 1e-5
    a, b = _ids(19, 4), _ids(7, 5)
    ca, cb = model.new_cache(), model.new_cache()
    model.forward([a[:16]], [ca])  # the next token opens chunk 2
    model.forward([b[:6]], [cb])
    step = model.forward([a[16:17], b[6:7]], [ca, cb])  # two decoding sequences in different chunks
    assert max_diff(step[0], model.forward([a[:17]])[0][16:]) <= 1e-5
    assert max_diff(step[1], model.forward([b])[0][6:]) <= 1e-5
    two = model.forward([a, b], [model.new_cache(), model.new_cache()])  # batched prefill with the paged pool
    assert max_diff(two[0], model.forward([a])[0]) <= 1e-5 and max_diff(two[1], model.forward([b])[0]) <= 1e-5


def test_overlap_schedule_equals_the_plain_one(folders, models):
    """Two micro-batches taking turns (the shared expert sees the unscaled state, the experts the scaled one)."""
    model, _ = models["scout"]
    overlapped = load_reference_model(folders["scout"], overlap=True)
    seqs = [_ids(13, 10), _ids(11, 11)]
    for got, want in zip(overlapped.forward(seqs), model.forward(seqs)):
        assert max_diff(got, want) <= 1e-6


@pytest.mark.parametrize("kind", ["scout", "wrapper"])
def test_bf16_reference_is_as_close_to_float32_as_transformers_bf16(folders, models, kind):
    folder = folders[kind]
    ours, theirs = load_reference_model(folder, dtype=torch.bfloat16), _text_model(load_hf(folder, torch.bfloat16))
    assert_by_transformers_yardstick(ours, theirs, models[kind][1], _ids(2 * CHUNK + 4, 7))
    assert ours.w.layers[0].router.dtype == torch.bfloat16  # a plain Linear in the model dtype, as transformers'


def test_fixture_configs_and_what_they_exercise(models):
    scout, maverick, wrapper = (models[k][0] for k in KINDS)
    assert scout.cfg.moe_layers == (0, 2, 3) and scout.w.layers[1].dense_mlp.down.shape == (32, 24)
    assert scout.cfg.nope_layers == (1, 3) and scout.cfg.chunked_layers == (0, 2)
    assert scout.cfg.attention_chunk_size == CHUNK and scout.cfg.qk_l2_norm and scout.cfg.llama3_rope is not None
    assert scout.cfg.attn_temperature == (4.0, 0.5) and scout.w.layers[0].shared_expert.down.shape == (32, 16)
    assert maverick.cfg.moe_layers == (1, 3) and not maverick.cfg.qk_l2_norm and maverick.cfg.tie_word_embeddings
    assert maverick.w.lm_head is maverick.w.embed and maverick.w.layers[0].attention.o_bias.abs().sum() > 0
    assert wrapper.cfg.weight_prefix == "language_model." and wrapper.cfg.moe_layers == (0, 2, 3)
    assert [a.chunk for a in scout.attention] == [CHUNK, None, CHUNK, None]


@pytest.mark.parametrize("change", ["no_chunk", "no_temperature", "no_l2_norm", "rope_everywhere", "plain_rope"])
def test_each_quirk_changes_the_logits(models, change):
    """Serving without one quirk moves the logits far beyond the tolerance: the exactness above covers each."""
    model, hf = models["scout"]
    cfg = model.cfg
    cfg = {"no_chunk": dataclasses.replace(cfg, chunked_layers=(), attention_chunk_size=None),
           "no_temperature": dataclasses.replace(cfg, attn_temperature=None),
           "no_l2_norm": dataclasses.replace(cfg, qk_l2_norm=False),
           "rope_everywhere": dataclasses.replace(cfg, nope_layers=()),
           "plain_rope": dataclasses.replace(cfg, llama3_rope=None)}[change]
    other = MoEDecoder(cfg, model.w, model.experts)
    ids = _ids(5 * CHUNK, 9)
    with torch.no_grad():
        assert max_diff(other.forward([ids])[0], hf_logits(hf, ids)) > 100 * TOL


# ---------------------------------------------------------------- router and MoE block against transformers


def test_router_and_moe_block_match_transformers():
    from transformers.models.llama4.modeling_llama4 import Llama4TextMoe

    torch.manual_seed(3)
    cfg = hf_text_config()
    moe = Llama4TextMoe(cfg)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.3)
    h = torch.randn(50, cfg.hidden_size)
    with torch.no_grad():
        want, logits = moe(h)
        scores, _ = moe.router(h)
    routing = route_sigmoid_input(F.linear(h, moe.router.weight), 1)
    assert torch.equal(routing.experts[:, 0], logits.argmax(-1))
    assert torch.equal(routing.input_scales[:, 0], scores.max(-1).values)  # the sigmoid score, bit for bit
    assert torch.equal(routing.weights, torch.ones(50, 1))  # the output is added unscaled
    assert torch.allclose(routing.probs.sum(-1), torch.ones(50))
    experts = moe.experts
    act = activation(cfg.hidden_act)
    got = torch.zeros_like(h)
    for e in range(cfg.num_local_experts):  # [E, H, 2I] / [E, I, H] as the fused_in_out layout reads them
        w = GatedMLPWeights(gate_up=experts.gate_up_proj[e].t().contiguous(),
                            down=experts.down_proj[e].t().contiguous())
        rows = routing.experts[:, 0] == e
        got[rows] = gated_mlp(h[rows] * routing.input_scales[rows], w, act)
    shared = moe.shared_expert
    got += gated_mlp(h, GatedMLPWeights.from_parts(shared.gate_proj.weight, shared.up_proj.weight,
                                                   shared.down_proj.weight), act)
    assert max_diff(got, want) <= 1e-5


def test_sigmoid_input_router_capacity_and_dropped_slots():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]] * 6)
    capped = route_sigmoid_input(logits, 1, capacity_factor=4 / 3)  # ceil(4/3 * 6 / 4) = 2 slots per expert
    assert capped.rerouted == 4 and int(capped.tokens_per_expert(4).max()) <= 2
    assert capped.experts[:, 0].tolist() == [0, 0, 1, 1, 2, 2]
    assert torch.equal(capped.input_scales[:, 0], torch.sigmoid(torch.tensor([2.0, 2, 1, 1, 0, 0])))
    full = route_sigmoid_input(logits[:1].expand(12, 4), 1, capacity_factor=1 / 3)  # 1 slot per expert: 8 dropped
    assert full.dropped == 8 and float(full.weights.sum()) == 4 and float(full.input_scales[4:].abs().sum()) == 0


@pytest.mark.parametrize("params", [
    {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
    {"factor": 16.0, "low_freq_factor": 1.0, "high_freq_factor": 1.0, "original_max_position_embeddings": 8192},
])  # the fixture's; Llama 4 Scout's as published (high == low: no band between kept and divided)
def test_llama3_inv_freq_matches_transformers(params):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from expertmesh.experts.config_llama4 import Llama3Scaling
    from expertmesh.experts.rope import llama3_inv_freq

    for head_dim, theta in ((8, 10000.0), (128, 500000.0)):
        cfg = hf_text_config(head_dim=head_dim, rope_parameters={"rope_type": "llama3", "rope_theta": theta} | params)
        want, scaling = ROPE_INIT_FUNCTIONS["llama3"](cfg)
        got = llama3_inv_freq(head_dim, theta, Llama3Scaling(**params))
        assert scaling == 1.0 and torch.equal(got, want) and bool(got.isfinite().all())


def test_sigmoid_input_routing_degrades_with_weight_one():
    """A slot moved off a lost expert keeps combine weight 1 (its input was scaled by the routed score already)."""
    from expertmesh.experts.gating import degrade

    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 3.0, 1.0, 2.0]])
    routing = route_sigmoid_input(logits, 1)
    moved = degrade(routing, torch.tensor([False, True, True, True]))
    assert moved.experts[:, 0].tolist() == [1, 1] and moved.degraded == 1
    assert torch.equal(moved.weights, torch.ones(2, 1)) and torch.equal(moved.input_scales, routing.input_scales)


def test_chunk_mask_is_the_chunked_causal_mask():
    mask = prefill_mask(5, 6, None, chunk=4)  # queries at 6..10 over keys 0..10
    want = torch.tensor([[k <= q and k // 4 == q // 4 for k in range(11)] for q in range(6, 11)])
    assert torch.equal(mask, want)


# ---------------------------------------------------------------- config parsing and refusals


def _raw(**overrides) -> dict:
    raw = hf_text_config().to_dict()
    raw["architectures"] = ["Llama4ForCausalLM"]
    return raw | overrides


def test_published_config_spellings_parse():
    # transformers' defaults when the lists are absent: NoPE every 4th layer, MoE every step-th layer
    raw = _raw(num_hidden_layers=8, no_rope_layers=None, layer_types=None, moe_layers=None,
               interleave_moe_layer_step=2, no_rope_layer_interval=4)
    cfg = config_from_dict(raw)
    assert cfg.nope_layers == (3, 7) and cfg.moe_layers == (1, 3, 5, 7)
    assert cfg.chunked_layers == (0, 1, 2, 4, 5, 6)
    cfg = config_from_dict(_raw(attention_chunk_size=None, layer_types=None, attn_temperature_tuning=False))
    assert cfg.chunked_layers == () and cfg.attention_chunk_size is None and cfg.attn_temperature is None
    # the multimodal wrapper: its text_config, names under language_model.
    wrapped = {"architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4",
               "text_config": text_config_kwargs(), "vision_config": {"hidden_size": 16}}
    cfg = config_from_dict(wrapped)
    assert cfg.family == "llama4" and cfg.weight_prefix == "language_model." and cfg.num_experts == 4


@pytest.mark.parametrize("overrides,key", [
    (dict(num_experts_per_tok=2), "num_experts_per_tok"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 2.0}), "rope_type"),
    (dict(rope_parameters={"rope_type": "llama3", "factor": 8.0}), "low_freq_factor"),
    (dict(layer_types=["sliding_attention"] * 4), "layer_types"),
    (dict(no_rope_layers=[1, 0]), "no_rope_layers"),
    (dict(moe_layers=[0, 7]), "moe_layers"),
    (dict(interleave_moe_layer_step=0, moe_layers=None), "interleave_moe_layer_step"),
    (dict(attention_chunk_size=0), "attention_chunk_size"),
    (dict(intermediate_size_mlp=None), "intermediate_size_mlp"),
    (dict(quantization_config={"quant_method": "fp8"}), "quant_method"),
])
def test_config_refusals_name_the_key(overrides, key):
    with pytest.raises(CheckpointError, match=key):
        config_from_dict(_raw(**overrides))
