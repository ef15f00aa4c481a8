"""CUDA graphs for the router's decode step (experts/decode_graphs.py): the bucket policy as pure functions, and the
whole router step replayed as graphs under the fake-CUDA double (ops/fake_cuda/graphs.py), whose replays re-run the
recorded kernels on the recorded tensors, so a value frozen at capture or a tensor rebound instead of copied into
shows up as a wrong logit here as it would on a GPU.

Against the eager CPU router: bit-equal where padding leaves each product's kernel unchanged (exact buckets, or ≥ 4
rows on both sides, experts/reproducible.py); within float rounding, with the same greedy tokens, where it does not.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from expertmesh.experts.decode_graphs import (
    DEFAULT_BATCH_BUCKETS,
    GraphSettings,
    batch_bucket,
    blocks_bucket,
    graph_buckets,
    model_reason,
    rows,
    step_bucket,
)
from expertmesh.experts.gating import route
from expertmesh.experts.modeling import MoEDecoder
from expertmesh.ops.fake_cuda import fake_cuda
from tests.router_step import StepSetup, build_router, prefill_then_decode, prompts, serve, serving_requests
from tests.router_step_cuda import FAMILIES

FAKE = dict(kv_cache_gb=0.01, actor_device="cpu", observe=True)
UNGRAPHABLE = ("qwen3_next", "kimi_linear", "longcat_flash")
GRAPHABLE = tuple(f for f in FAMILIES if f not in UNGRAPHABLE)


# ---- the policy ----------------------------------------------------------------------------------------------------

def test_batch_buckets_pad_up_to_the_next_and_refuse_above_the_largest():
    assert [batch_bucket(n, (1, 2, 4, 8)) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, None]
    assert graph_buckets(256) == DEFAULT_BATCH_BUCKETS
    assert graph_buckets(20) == (1, 2, 4, 8, 16, 20) and graph_buckets(1) == (1,)


def test_history_blocks_round_to_a_power_of_two_within_a_sequence_limit():
    assert [blocks_bucket(n, 100) for n in (1, 2, 3, 5, 64, 65, 100)] == [1, 2, 4, 8, 64, 100, 100]
    with pytest.raises(AssertionError):
        blocks_bucket(0, 8)


def test_only_pure_decode_steps_take_a_bucket():
    buckets = (1, 2, 4)
    assert step_bucket([1, 1, 1], [5, 9, 2], buckets) == 4
    assert step_bucket([1, 3], [5, 9], buckets) is None  # a prompt chunk beside the decode rows
    assert step_bucket([1], [0], buckets) is None  # a one-token prompt: no history
    assert step_bucket([1] * 5, [1] * 5, buckets) is None  # above the largest bucket
    assert step_bucket([], [], buckets) is None


@pytest.mark.parametrize("buckets", [(), (0, 1), (4, 2), (2, 2)])
def test_bucket_settings_are_validated_with_the_field_named(buckets):
    with pytest.raises(ValueError, match="cuda_graph_buckets"):
        GraphSettings(buckets=buckets)


def test_rows_cut_every_per_token_field_and_copy_out_of_graph_memory():
    routing = route(torch.randn(5, 4), 2, True)
    cut = rows(routing, 3)
    assert cut.experts.shape == (3, 2) and cut.weights.shape == (3, 2) and cut.probs.shape == (3, 4)
    assert torch.equal(cut.experts, routing.experts[:3])
    routing.experts.fill_(-7)  # the next replay overwrites the captured tensors
    assert (cut.experts >= 0).all()


# ---- the router step on the fake device ------------------------------------------------------------------------------

@pytest.fixture
def models(router_step_checkpoints) -> dict[str, Path]:
    return router_step_checkpoints


def _graphed(model_dir: Path, buckets: tuple[int, ...], **setup) -> StepSetup:
    return StepSetup(**FAKE, **setup, cuda_graphs=GraphSettings(buckets=buckets))


@pytest.mark.parametrize("family", GRAPHABLE)
def test_graphed_decode_equals_the_eager_cpu_router_bit_for_bit_with_one_read_per_moe_layer(models, family):
    """Exact batch buckets; the 12-token prompt's history crosses a block boundary (16 tokens) while decoding, so
    two blocks buckets are captured, and the padded block tables are masked as eager's are."""
    model_dir = models[family]
    cpu_model, _ = build_router(model_dir, "cpu", torch.float32)
    ids = prompts(cpu_model.cfg.vocab_size, lengths=(7, 12, 3))
    want = prefill_then_decode(cpu_model, ids, steps=6)
    with fake_cuda() as fc:
        model, backend = build_router(model_dir, "cuda", torch.float32, _graphed(model_dir, (1, 2, 3)))
        got = prefill_then_decode(model, ids, steps=6)
        graphs = model.graphs
        assert graphs.captures > 0 and graphs.replays > graphs.captures and not graphs.stats()["failed"]
        # a warm bucket: one decode step reads nothing and waits once per MoE layer (the routing's crossing)
        caches = [model.new_cache() for _ in ids]
        model.forward([torch.tensor(p) for p in ids], caches, logits="last")
        model.forward([torch.tensor([1]) for _ in ids], caches, logits="last")
        captures = graphs.captures
        with fc.counting() as decode:
            logits = model.forward([torch.tensor([2]) for _ in ids], caches, logits="last")
        assert graphs.captures == captures  # replayed, not captured again
        assert all(x.device.type == "cuda" and x.shape == (1, model.cfg.vocab_size) for x in logits)
        moe_layers = len(model.cfg.moe_layers)
        assert decode.syncs == moe_layers, decode.sync_sites
        assert decode.host_reads == 0 and decode.shape_syncs == 0, (decode.read_sites, decode.shape_sync_sites)
    assert all(torch.equal(g, w) for g, w in zip(got, want)), family
    snapshot = backend.observer.snapshot()  # load statistics came from the graphed steps' routings
    assert sum(snapshot["counts"]["shard_load"][0]) > 0


def test_padded_batches_equal_eager_where_kernels_match_and_stay_within_rounding_where_not(models):
    model_dir = models["mixtral"]
    cpu_model, _ = build_router(model_dir, "cpu", torch.float32)
    vocab = cpu_model.cfg.vocab_size
    five = prompts(vocab, lengths=(7, 12, 3, 5, 9))
    three = prompts(vocab, lengths=(7, 12, 3))
    want5, want3 = prefill_then_decode(cpu_model, five, steps=4), prefill_then_decode(cpu_model, three, steps=4)
    with fake_cuda():
        model, _ = build_router(model_dir, "cuda", torch.float32, _graphed(model_dir, (4, 8)))
        got5 = prefill_then_decode(model, five, steps=4)  # 5 rows padded to 8: the same ≥ 4-row kernels
        got3 = prefill_then_decode(model, three, steps=4)  # 3 rows padded to 4: another kernel than eager's 3
        used = model.kv_pool.allocator.num_used
    assert all(torch.equal(g, w) for g, w in zip(got5, want5))
    assert max(float((g - w).abs().max()) for g, w in zip(got3, want3)) < 1e-4
    assert all(torch.equal(g.argmax(-1), w.argmax(-1)) for g, w in zip(got3, want3))
    assert used == 1  # every sequence gave its blocks back; the padding rows' scratch block stays the graphs'


def test_serving_with_graphs_equals_the_eager_cpu_batcher(models):
    """Chunked prefill beside decode (eager steps) and pure decode steps (graphed) interleave, with seeded sampling
    and logit rules; the batch shrinks as requests finish, so buckets change between steps."""
    model_dir = models["qwen3_moe"]
    cpu_model, _ = build_router(model_dir, "cpu", torch.float32)
    requests = serving_requests(cpu_model.cfg.vocab_size, max_tokens=6)
    want = serve(cpu_model, requests)
    with fake_cuda():
        model, _ = build_router(model_dir, "cuda", torch.float32, _graphed(model_dir, (1, 2, 3, 4)))
        got = serve(model, requests)
        replays = model.graphs.replays
    assert got == want and replays > 0


def test_a_failed_capture_logs_why_and_that_bucket_runs_eagerly(models, monkeypatch, caplog):
    model_dir = models["mixtral"]
    cpu_model, _ = build_router(model_dir, "cpu", torch.float32)
    ids = prompts(cpu_model.cfg.vocab_size)
    want = prefill_then_decode(cpu_model, ids)
    real_gate = MoEDecoder._gate_logits

    def reads_the_device(self, layer, h):  # a host read inside the dense step: not capturable
        out = real_gate(self, layer, h)
        float(out[0, 0])
        return out

    with fake_cuda():
        model, _ = build_router(model_dir, "cuda", torch.float32, _graphed(model_dir, (1, 2, 3)))
        monkeypatch.setattr(MoEDecoder, "_gate_logits", reads_the_device)
        with caplog.at_level(logging.WARNING, logger="expertmesh.experts.decode_graphs"):
            got = prefill_then_decode(model, ids)
        stats = model.graphs.stats()
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert stats["captures"] == 0 and stats["failed"] and "not permitted when stream is capturing" in caplog.text


@pytest.mark.parametrize("family", UNGRAPHABLE)
def test_models_whose_decode_step_cannot_be_graphed_say_why(models, family):
    cfg = build_router(models[family], "cpu", torch.float32)[0].cfg
    assert model_reason(cfg, None) is not None
    with fake_cuda():
        with pytest.raises(ValueError, match="cuda_graphs: this model's decode step cannot be graphed"):
            build_router(models[family], "cuda", torch.float32, _graphed(models[family], (1, 2)))


def test_graphs_refuse_a_cpu_decoder_and_a_capacity_factor(models):
    with pytest.raises(ValueError, match="cuda_graphs: the decoder is on cpu"):
        build_router(models["mixtral"], "cpu", torch.float32, StepSetup(cuda_graphs=GraphSettings()))
    cfg = build_router(models["mixtral"], "cpu", torch.float32)[0].cfg
    assert "capacity factor" in model_reason(cfg, 1.25)


@pytest.mark.parametrize("setting, device, family, expect", [
    ("auto", "cuda", "mixtral", "graphs"),
    ("auto", "cpu", "mixtral", None),  # a CPU router: eager
    ("auto", "cuda", "qwen3_next", None),  # a model that cannot be graphed: eager, with a log line
    ("off", "cuda", "mixtral", None),
    ("on", "cuda", "mixtral", "graphs"),
    ("on", "cpu", "mixtral", "router.cuda_graphs: on, but the router computes on cpu"),
    ("on", "cuda", "kimi_linear", "router.cuda_graphs: on, but linear-attention layers"),
])
def test_the_router_setting_turns_graphs_on_where_they_can_run(models, setting, device, family, expect):
    from types import SimpleNamespace

    from expertmesh.router_service.config import RouterConfig
    from expertmesh.router_service.router import Router

    cfg = build_router(models[family], "cpu", torch.float32)[0].cfg
    router = SimpleNamespace(device=torch.device(device), model_config=cfg)
    settings = RouterConfig(cuda_graphs=setting, cuda_graph_max_batch=48)
    if expect is None or expect == "graphs":
        got = Router._graph_setting(router, settings)
        assert (got is None) == (expect is None)
        assert got is None or got.buckets == (1, 2, 4, 8, 16, 24, 32, 48)
        # what `expertmesh status` shows: on, or off and why (plain "off" when the setting says so)
        if got is not None:
            assert router.graphs_note == "on (decode batches up to 48)"
        elif setting == "off":
            assert router.graphs_note == "off"
        else:
            assert router.graphs_note.startswith("off (") and router.graphs_note.endswith(")")
    else:
        with pytest.raises(ValueError, match=expect):
            Router._graph_setting(router, settings)


def test_status_metrics_and_batcher_stats_report_the_graphs(models):
    """What an operator sees: `expertmesh status` says whether graphs are on (and why not), the buckets and replays;
    /metrics exports them; the batcher's stats carry the decoder's counts."""
    from expertmesh.ops.commands.status import status_lines
    from expertmesh.protos import admin_pb2
    from expertmesh.router_service.batching import graph_stats
    from expertmesh.router_service.http_metrics import FrontCounters, prometheus_text

    on = admin_pb2.RouterStats(cuda_graphs="on (decode batches up to 256)", cuda_graph_buckets=3,
                               cuda_graph_replays=120, cuda_graph_failed_buckets=1)
    lines = status_lines(admin_pb2.ClusterState(model="m", router=on))
    assert ("CUDA graphs: on (decode batches up to 256): 3 buckets captured, 120 replays, 1 buckets failed to "
            "capture (eager; see the router's log)") in lines
    off = admin_pb2.RouterStats(cuda_graphs="off (the router computes on cpu)")
    assert "CUDA graphs: off (the router computes on cpu)" in status_lines(admin_pb2.ClusterState(router=off))
    text = prometheus_text(FrontCounters(), {"cuda_graph_buckets": 3, "cuda_graph_replays": 120, "replica": "r"})
    assert 'expertmesh_router_cuda_graph_buckets{replica="r"} 3' in text
    assert 'expertmesh_router_cuda_graph_replays_total{replica="r"} 120' in text
    assert graph_stats(None) == {"cuda_graph_buckets": 0, "cuda_graph_replays": 0, "cuda_graph_captures": 0,
                                 "cuda_graph_failed_buckets": 0}
    with fake_cuda():
        model, _ = build_router(models["mixtral"], "cuda", torch.float32,
                                _graphed(models["mixtral"], (1, 2, 3)))
        prefill_then_decode(model, prompts(model.cfg.vocab_size), steps=2)
        got = graph_stats(model.graphs)
    assert got["cuda_graph_buckets"] == 1 and got["cuda_graph_captures"] == 3 and got["cuda_graph_replays"] > 3
    assert got["cuda_graph_failed_buckets"] == 0
