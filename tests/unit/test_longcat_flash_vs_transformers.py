"""LongCat-Flash (two MLA + dense-MLP sublayers per layer with a shortcut MoE beside them, LoRA-scaled MLA with
interleaved RoPE, a softmax router over real and zero-compute identity experts with a selection-only bias and
x scaling, no renormalisation): the in-process reference against `transformers` on tiny checkpoints it saved itself,
both expert layouts, fp32 and bf16; chunked prefill, paged decode and the overlapped schedule == the whole prompt;
identity experts never reach the expert backend; each quirk shown to matter; the router against transformers' own
module; config refusals.

Tolerance: max |Δlogits| ≤ 1e-4 in float32 (logits of order 1); bf16 within a few bf16 ulps of the logit scale.
"""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch
from safetensors import safe_open

from expertmesh.cluster.memory_plan import model_memory, stored_bytes
from expertmesh.experts.config import config_from_dict
from expertmesh.experts.errors import CheckpointError
from expertmesh.experts.gating import DROPPED, route_softmax_scaled, split_identity
from expertmesh.experts.modeling import MoEDecoder
from expertmesh.experts.reference import load_reference_model
from tests.tiny_checkpoints import chunked_logits, greedy_tokens, hf_logits, load_hf_model, max_diff
from tests.tiny_longcat_flash import EXPERTS, VOCAB, ZERO_EXPERTS, hf_config, write_longcat_checkpoint

TOL = 1e-4
LAYOUTS = ("per_expert", "fused")


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("longcat_ckpt")
    return {layout: write_longcat_checkpoint(root / layout, seed=4, fused=layout == "fused") for layout in LAYOUTS}


@pytest.fixture(scope="module")
def models(folders) -> dict:
    return {layout: (load_reference_model(folder), load_hf_model(folder)) for layout, folder in folders.items()}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_batched_sequences_match_transformers(models, layout):
    model, hf = models[layout]
    ids0, ids1 = _ids(5, 1), _ids(40, 2)
    out = model.forward([ids0, ids1])
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


def test_chunked_prefill_batched_decode_and_overlap_equal_whole_prompt(models, folders):
    model, _ = models["per_expert"]
    ids = _ids(23, 3)
    full = model.forward([ids])[0]
    assert max_diff(chunked_logits(model, ids, [3, 4, 11, 17]), full) <= 1e-5
    assert max_diff(chunked_logits(model, ids, list(range(1, 23))), full) <= 1e-5
    a, b = _ids(12, 4), _ids(4, 5)
    ca, cb = model.new_cache(), model.new_cache()
    model.forward([a[:11]], [ca])
    model.forward([b[:3]], [cb])
    step = model.forward([a[11:12], b[3:4]], [ca, cb])
    assert max_diff(step[0], model.forward([a])[0][11:]) <= 1e-5
    assert max_diff(step[1], model.forward([b])[0][3:]) <= 1e-5
    # The ping-pong schedule collects each MoE round before the next sublayer and adds it after that sublayer's MLP
    overlapped = load_reference_model(folders["per_expert"], overlap=True)
    both = overlapped.forward([a, b])
    assert max_diff(both[0], model.forward([a])[0]) <= 1e-5 and max_diff(both[1], model.forward([b])[0]) <= 1e-5


def test_bf16_reference_is_as_close_to_float32_as_transformers_bf16(folders, models):
    """bf16 by transformers' own yardstick (greedy tokens of a tiny random model flip on bf16 near-ties, and
    transformers 5.25 regrouped the identity experts' bf16 sums): over a prompt and 8 greedy steps, ours is no
    further from the float32 truth than transformers' bf16 (plus a margin), and no further from transformers' bf16
    than that is from the truth."""
    folder = folders["per_expert"]
    ours, theirs = load_reference_model(folder, dtype=torch.bfloat16), load_hf_model(folder, torch.bfloat16)
    truth_model = models["per_expert"][1]
    prompt = _ids(16, 7)
    with torch.no_grad():  # the float32 greedy continuation: every position is then scored by all three
        ids = truth_model.generate(prompt[None], attention_mask=torch.ones(1, 16, dtype=torch.long),
                                   max_new_tokens=8, do_sample=False)[0]
        truth, want = hf_logits(truth_model, ids), hf_logits(theirs, ids)
    got = ours.forward([ids])[0]
    their_error = max_diff(want, truth)
    assert their_error > 0  # transformers' own bf16 error: 0.05 (5.24), 0.23 (5.25) on logits up to 2.8
    assert max_diff(got, truth) <= 1.25 * their_error + 0.05
    assert max_diff(got, want) <= their_error + 0.05
    assert ours.w.layers[0].router.dtype == torch.float32  # the classifier stays float32, as transformers keeps it


class _Recording:
    """An expert backend that records the expert ids it is asked to serve."""

    def __init__(self, inner):
        self.inner, self.seen = inner, []

    def run(self, layer, hidden, routing):
        self.seen.append(routing.experts.clone())
        return self.inner.run(layer, hidden, routing)

    def effective_routing(self, layer, routing):
        return routing


def test_identity_experts_are_computed_by_the_decoder_never_the_backend(models):
    model, hf = models["per_expert"]
    cfg = model.cfg
    assert (cfg.num_experts, cfg.zero_experts, cfg.router_width) == (EXPERTS, ZERO_EXPERTS, EXPERTS + ZERO_EXPERTS)
    backend = _Recording(model.experts)
    decoder = MoEDecoder(cfg, model.w, backend)
    ids = _ids(40, 2)
    assert max_diff(decoder.forward([ids])[0], hf_logits(hf, ids)) <= TOL
    seen = torch.cat([s.reshape(-1) for s in backend.seen])
    assert seen.max() < EXPERTS and (seen >= 0).any()  # real experts only; identity slots come DROPPED
    for routing in decoder.last_trace.routings.values():
        # the fixture's biases make top-3 pick both kinds; each identity slot is counted, not dropped
        assert routing.identity > 0 and int((routing.experts >= 0).sum()) > 0
        assert routing.identity + int((routing.experts >= 0).sum()) == routing.num_tokens * cfg.top_k
        assert routing.dropped == 0 and routing.probs.shape[1] == EXPERTS
    # the prefetch prediction names real experts only
    assert model.predict_experts(0, torch.randn(6, cfg.hidden_size)).max() < EXPERTS


class _Logged:
    """A submit/wait expert backend that logs the order of its rounds."""

    def __init__(self, inner, log):
        self.inner, self.log = inner, log

    def submit(self, layer, hidden, routing):
        self.log.append(("submit", layer))
        return layer, self.inner.run(layer, hidden, routing)

    def wait(self, pending):
        self.log.append(("wait", pending[0]))
        return pending[1]

    def run(self, layer, hidden, routing):
        raise AssertionError("a shortcut round is submitted, not run")

    def effective_routing(self, layer, routing):
        return routing


def test_shortcut_round_is_waited_for_after_the_next_sublayer(models):
    """The expert round of sublayer 2L stays in flight through sublayer 2L+1's attention and dense MLP."""
    model, hf = models["per_expert"]
    log = []
    decoder = MoEDecoder(model.cfg, model.w, _Logged(model.experts, log))
    attention = decoder._attention
    decoder._attention = lambda i, h, g: log.append(("attention", i)) or attention(i, h, g)
    ids = _ids(9, 8)
    assert max_diff(decoder.forward([ids])[0], hf_logits(hf, ids)) <= TOL
    assert log == [("attention", 0), ("submit", 0), ("attention", 1), ("wait", 0),
                   ("attention", 2), ("submit", 2), ("attention", 3), ("wait", 2)]
    assert sorted(decoder.last_trace.routings) == [0, 2]


def test_router_matches_transformers_module():
    from transformers.models.longcat_flash.modeling_longcat_flash import LongcatFlashTopkRouter

    torch.manual_seed(0)
    module = LongcatFlashTopkRouter(hf_config())
    with torch.no_grad():
        module.classifier.weight.normal_(0, 0.5)
        module.e_score_correction_bias.copy_(torch.randn(EXPERTS + ZERO_EXPERTS) * 0.1)
        h = torch.randn(50, 32)
        logits, weights, indices = module(h)
    ours = route_softmax_scaled(logits, 3, module.e_score_correction_bias, 2.5)
    order = torch.argsort(indices, dim=-1)
    assert torch.equal(ours.experts.sort(dim=-1).values, indices.gather(1, order))
    assert torch.allclose(ours.weights.gather(1, ours.experts.argsort(dim=-1)), weights.gather(1, order), atol=1e-7)
    served, identity = split_identity(ours, EXPERTS)
    assert torch.equal(served.experts >= 0, ours.experts < EXPERTS)
    assert torch.equal(served.weights == 0, ours.experts >= EXPERTS) and served.probs.shape[1] == EXPERTS
    assert torch.allclose(identity, torch.where(ours.experts >= EXPERTS, ours.weights, 0.0).sum(-1))
    assert torch.equal(served.identity_per_token, (ours.experts >= EXPERTS).sum(-1))


@pytest.mark.parametrize("change", ["no_lora_scale", "no_shortcut", "identity_as_zero", "no_bias", "renormalise"])
def test_each_quirk_changes_the_logits(models, change):
    """Serving without one quirk moves the logits far beyond the tolerance: the exactness above covers each."""
    model, hf = models["per_expert"]
    cfg, weights = model.cfg, model.w
    if change == "no_lora_scale":
        cfg = dataclasses.replace(cfg, mla_lora_scale=False)
    elif change == "no_shortcut":  # the MoE output added at its own sublayer's end, its dense MLP as a shared one
        cfg = dataclasses.replace(cfg, shortcut_moe=False)
        weights = dataclasses.replace(weights, layers=[
            dataclasses.replace(layer, dense_mlp=None, shared_expert=layer.dense_mlp) if layer.router is not None
            else layer for layer in weights.layers])
    elif change == "identity_as_zero":  # identity slots add nothing
        cfg = dataclasses.replace(cfg, zero_experts=0)
    elif change == "no_bias":
        weights = dataclasses.replace(weights, layers=[dataclasses.replace(
            layer, router_correction_bias=None) for layer in weights.layers])
    elif change == "renormalise":
        cfg = dataclasses.replace(cfg, routed_scaling_factor=1.0)
    experts = _DropUnknown(model.experts, cfg.num_experts) if change == "identity_as_zero" else model.experts
    ids = _ids(40, 2)
    theirs = hf_logits(hf, ids)
    changed = MoEDecoder(cfg, weights, experts).forward([ids])[0]
    assert max_diff(changed, theirs) > 100 * TOL


class _DropUnknown:
    """Serves only the real experts of a routing whose identity slots were not split off (they add nothing)."""

    def __init__(self, inner, num_experts):
        self.inner, self.num_experts = inner, num_experts

    def run(self, layer, hidden, routing):
        keep = routing.experts < self.num_experts
        routing = dataclasses.replace(routing, experts=torch.where(keep, routing.experts, DROPPED),
                                      weights=torch.where(keep, routing.weights, 0.0))
        return self.inner.run(layer, hidden, routing)

    def effective_routing(self, layer, routing):
        return routing


def test_fixture_config_layout():
    cfg = config_from_dict(hf_config().to_dict())
    assert cfg.family == "longcat_flash" and cfg.num_layers == 4 and cfg.moe_layers == (0, 2)
    assert cfg.attention_kind == "mla" and cfg.rope_pairs_interleaved and cfg.mla_lora_scale
    assert (cfg.top_k, cfg.routed_scaling_factor, cfg.norm_topk_prob) == (3, 2.5, False)
    assert (cfg.dense_intermediate_size, cfg.expert_intermediate_size, cfg.rotary_dim) == (48, 16, 4)


def test_stacked_file_from_either_transformers_loads_the_same_experts(folders, models, tmp_path):
    """transformers <= 5.24 saved gate_up_proj [E + Z, 2I, H] (rows for the identity experts, never read), 5.25
    [E, 2I, H]: both load to the same logits and the same per-shard bytes; any other row count names the tensor."""
    import shutil

    from safetensors.torch import load_file, save_file

    from expertmesh.experts.checkpoint import CheckpointReader
    from expertmesh.experts.weights import FUSED, FUSED_IDENTITY_ROWS, _layout_of

    source = folders["fused"]
    tensors = load_file(str(source / "model.safetensors"))
    key = "model.layers.0.mlp.experts.gate_up_proj"
    real = tensors[key].shape[0]  # E (5.25) or E + Z (<= 5.24)
    assert real in (EXPERTS, EXPERTS + ZERO_EXPERTS)

    def variant(name: str, rows: int) -> CheckpointReader:
        out = tmp_path / name
        shutil.copytree(source, out)
        resized = {}
        for k, t in tensors.items():
            if k.endswith("mlp.experts.gate_up_proj"):  # [rows, 2I, H]: real rows first, then never-read filler
                t = torch.cat([t[:EXPERTS], torch.full((rows - EXPERTS, *t.shape[1:]), 7.0)])
            resized[k] = t.contiguous()
        save_file(resized, str(out / "model.safetensors"), metadata={"format": "pt"})
        return CheckpointReader(out)

    new, old = variant("rows_e", EXPERTS), variant("rows_e_plus_z", EXPERTS + ZERO_EXPERTS)
    assert (_layout_of(new), _layout_of(old)) == (FUSED, FUSED_IDENTITY_ROWS)
    assert stored_bytes(new).shard == stored_bytes(old).shard == 4 * 3 * 16 * 32
    ids = _ids(17, 9)
    want = models["fused"][0].forward([ids])[0]
    for reader in (new, old):
        assert torch.equal(load_reference_model(reader.model_dir).forward([ids])[0], want)
    with pytest.raises(CheckpointError, match="gate_up_proj"):
        load_reference_model(variant("rows_e_plus_1", EXPERTS + 1).model_dir)


@pytest.mark.parametrize(("key", "value", "match"), [
    ("num_layers", 0, "'num_layers'"),
    ("head_dim", 8, "'head_dim'"),
    ("qk_head_dim", 11, "'qk_head_dim'"),
    ("q_lora_rank", None, "'q_lora_rank'"),
    ("zero_expert_num", -1, "'zero_expert_num'"),
    ("moe_topk", 9, "'moe_topk'"),
    ("router_bias", True, "'router_bias'"),
    ("mla_scale_q_lora", False, "'mla_scale_q_lora'"),
    ("zero_expert_type", "zero", "'zero_expert_type'"),
    ("rope_parameters", {"rope_type": "linear", "factor": 2.0, "rope_theta": 100.0}, "rope_type"),
])
def test_config_refusals_name_the_key(key, value, match):
    raw = hf_config().to_dict() | {key: value}
    with pytest.raises(CheckpointError, match=match):
        config_from_dict(raw)


# ---------------------------------------------------------------- memory and plan-cluster


def test_model_bytes_and_kv_per_token_equal_the_checkpoint(folders):
    """plan-cluster counts real experts only: the checkpoint less any identity experts' gate/up tensors (which
    transformers <= 5.24 allocated and saved, never used; 5.25 saves none); the stacked share per shard is the same."""
    from expertmesh.experts.checkpoint import CheckpointReader

    folder = folders["per_expert"]
    cfg = load_reference_model(folder).cfg
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        stored = sum(math.prod(f.get_slice(key).get_shape()) for key in f.keys())
        unused = sum(math.prod(f.get_slice(key).get_shape()) for key in f.keys()
                     if (m := re.search(r"\.mlp\.experts\.(\d+)\.", key)) and int(m.group(1)) >= EXPERTS)
    assert unused in (0, 2 * ZERO_EXPERTS * 2 * 16 * 32)  # none, or 2 layers x Z identity experts x gate+up [16, 32]
    mem = model_memory(cfg, "float32")
    assert (mem.moe_layers, mem.experts) == (2, EXPERTS)
    assert mem.total_bytes == 4 * (stored - unused)
    assert mem.kv_bytes_per_token == 4 * 4 * (8 + 4)  # 4 sublayers x (latent 8 + rope key 4)
    per_expert = stored_bytes(CheckpointReader(folder))
    fused = stored_bytes(CheckpointReader(folders["fused"]))
    assert per_expert.shard == fused.shard == 4 * 3 * 16 * 32 and per_expert.experts == EXPERTS


def test_plan_cluster_cli(folders, capsys):
    import json

    from expertmesh.ops.cli import main

    assert main(["plan-cluster", "--model", str(folders["fused"]), "--gpu-type", "L4", "--gpus-per-node", "4",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["family"] == "longcat_flash"


def test_published_config_gives_transformers_parameter_count():
    """LongCat-Flash-Chat's size-setting values (transformers' defaults are the published model's): ours is the
    transformers state dict less any identity experts' unused gate/up rows."""
    from transformers import LongcatFlashConfig, LongcatFlashForCausalLM

    raw = LongcatFlashConfig().to_dict() | {"architectures": ["LongcatFlashForCausalLM"]}
    cfg = config_from_dict(raw)
    mem = model_memory(cfg, "bfloat16")
    with torch.device("meta"):
        hf = LongcatFlashForCausalLM(LongcatFlashConfig())
    rows = hf.model.layers[0].mlp.experts.gate_up_proj.shape[0]  # 512 + 256 in transformers <= 5.24, 512 from 5.25
    unused = 28 * (rows - 512) * 2 * 2048 * 6144  # layers x identity experts' rows x gate+up x hidden
    assert mem.total_bytes == 2 * (sum(t.numel() for t in hf.state_dict().values()) - unused)
    assert (mem.moe_layers, mem.experts) == (28, 512)
    assert mem.total_bytes / 2 / 1e9 == pytest.approx(560.66, abs=0.01)  # published: "560B total parameters"
