"""Expert-affinity admission wired into the continuous batcher (router_service/affinity_admission.py,
`router.batcher.admission`): the queue reorder, the configuration's named errors, and on a two-topic model the same
tokens per request as FIFO with about half the expert shards called. No Ray."""

from __future__ import annotations

import asyncio
from collections import deque
from types import SimpleNamespace

import pytest
import torch

from expertmesh.experts.reference import load_reference_model
from expertmesh.ops.bench.topics import make_topical, topic_prompt
from expertmesh.router_service.affinity_admission import prompt_signature, reorder_waiting
from expertmesh.router_service.batching import BatcherConfig, ContinuousBatcher, DoneEvent, GenerationRequest
from expertmesh.router_service.config import ConfigError, MeshConfig

TIMEOUT = 60.0


@pytest.fixture(scope="module")
def topical(checkpoints):
    model = load_reference_model(checkpoints["mixtral"])  # its own copy: the weights are bent in place
    make_topical(model.w, model.cfg.num_experts)
    return model


def _seq(name, arrived, admitted=-1):
    return SimpleNamespace(name=name, arrived=arrived, admitted=admitted)


@pytest.mark.parametrize("override, field", [
    ({"admission": "lifo"}, "admission"), ({"affinity_max_wait_s": -1.0}, "affinity_max_wait_s"),
    ({"affinity_max_wait_s": float("inf")}, "affinity_max_wait_s"), ({"affinity_experts": -1}, "affinity_experts"),
    ({"affinity_experts": True}, "affinity_experts")])
def test_config_errors_name_the_field(override, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        BatcherConfig(**override).validate()
    key = next(iter(override))
    with pytest.raises(ConfigError, match=f"router.batcher.{field}"):
        MeshConfig.from_dict({"router": {"batcher": {key: override[key]}}}).validate()


def test_fifo_is_the_default():
    assert BatcherConfig().admission == "fifo"


def test_reorder_puts_the_overlapping_requests_first_and_keeps_preempted_ones_at_the_head():
    sigs = {"run": {0, 1}, "a": {2, 3}, "b": {0, 1}, "c": {0, 2}, "old": {3}}
    waiting = deque([_seq("old", 0.0, admitted=5), _seq("a", 1.0), _seq("b", 2.0), _seq("c", 3.0)])
    reorder_waiting(waiting, [_seq("run", 0.0, 0)], free=3, now=4.0, max_wait_s=10.0,
                    signature_of=lambda s: frozenset(sigs[s.name]))
    assert [s.name for s in waiting] == ["old", "b", "c", "a"]
    # the fairness bound: "a" has waited past it, so it goes first whatever its experts
    waiting = deque([_seq("a", 1.0), _seq("b", 2.0), _seq("c", 3.0)])
    reorder_waiting(waiting, [_seq("run", 0.0, 0)], free=1, now=4.0, max_wait_s=3.0,
                    signature_of=lambda s: frozenset(sigs[s.name]))
    assert [s.name for s in waiting] == ["a", "b", "c"]


def test_reorder_leaves_the_queue_alone_when_every_waiting_request_fits():
    waiting = deque([_seq("a", 1.0), _seq("b", 2.0)])
    reorder_waiting(waiting, [], free=2, now=4.0, max_wait_s=10.0,
                    signature_of=lambda s: pytest.fail("no signature needed"))
    assert [s.name for s in waiting] == ["a", "b"]


def test_prompt_signature_follows_the_topic(topical):
    vocab, half = topical.cfg.vocab_size, topical.cfg.num_experts // 2
    assert prompt_signature(topical, topic_prompt(0, 8, vocab, seed=1), keep=0) <= set(range(half))
    assert prompt_signature(topical, topic_prompt(1, 8, vocab, seed=1), keep=0) <= set(range(half, 2 * half))


def test_more_topics_each_route_to_their_own_experts(checkpoints):
    """bench offload --affinity-topics N: N topics, each routed to its 1/N of the experts (olmoe: 8 experts, so 4
    topics of 2 each; its top-3's third pick necessarily lies outside the topic's 2), and the directions point away
    from each other as a regular simplex's corners."""
    from expertmesh.ops.bench.topics import topic_directions

    u = topic_directions(64, 4)
    gram = u @ u.T  # [4, 4]
    assert torch.allclose(gram, torch.full((4, 4), -1 / 3) + torch.eye(4) * (4 / 3), atol=1e-5)
    two = topic_directions(64, 2)
    assert torch.equal(two[0], -two[1])  # two topics: +u and -u, as the committed runs used
    model = load_reference_model(checkpoints["olmoe"])
    make_topical(model.w, model.cfg.num_experts, topics=4)
    vocab = model.cfg.vocab_size
    for topic in range(4):
        prompt = topic_prompt(topic, 8, vocab, seed=7, topics=4)
        assert all(t * 4 // vocab == topic for t in prompt), prompt  # the topic's part of the vocabulary
        h = torch.nn.functional.embedding(torch.tensor(prompt), model.w.embed)  # [8, H]
        picks = model.predict_experts(model.cfg.moe_layers[0], h)  # [8, 3]
        assert all(set(row[:2]) == {2 * topic, 2 * topic + 1} for row in picks.tolist()), (topic, picks)


async def _serve(model, config: BatcherConfig, prompts: list[list[int]], max_tokens: int):
    batcher = ContinuousBatcher(model, None, config)

    async def one(p):
        tokens, done = [], None
        async for event in batcher.stream(GenerationRequest(prompt_ids=p, max_tokens=max_tokens)):
            if isinstance(event, DoneEvent):
                done = event
            else:
                tokens.extend(event.token_ids)
        return tokens, done

    results = await asyncio.wait_for(asyncio.gather(*(one(p) for p in prompts)), TIMEOUT)
    return batcher, results


def test_affinity_gives_fifos_tokens_with_about_half_the_shard_calls(topical):
    vocab = topical.cfg.vocab_size
    prompts = [topic_prompt(r % 2, 5 + r % 3, vocab, seed=40 + r) for r in range(8)]  # topics alternate
    fifo_b, fifo = asyncio.run(_serve(topical, BatcherConfig(max_active=2), prompts, 6))
    aff_b, aff = asyncio.run(_serve(topical, BatcherConfig(max_active=2, admission="affinity",
                                                           affinity_max_wait_s=60.0), prompts, 6))
    assert [t for t, _ in aff] == [t for t, _ in fifo]  # same tokens per request: only the grouping changed
    assert [d.tokens_per_expert for _, d in aff] == [d.tokens_per_expert for _, d in fifo]
    fifo_s, aff_s = fifo_b.stats(), aff_b.stats()
    assert fifo_s["finished_requests"] == aff_s["finished_requests"] == 8
    assert aff_s["expert_shard_calls"] <= 0.65 * fifo_s["expert_shard_calls"], (aff_s, fifo_s)
    # a zero wait bound makes every waiting request overdue: admission by age, FIFO's shard calls
    zero_b, zero = asyncio.run(_serve(topical, BatcherConfig(max_active=2, admission="affinity",
                                                             affinity_max_wait_s=0.0), prompts, 6))
    assert [t for t, _ in zero] == [t for t, _ in fifo]
    assert zero_b.stats()["expert_shard_calls"] == fifo_s["expert_shard_calls"]


def test_status_and_metrics_report_the_expert_loads():
    from expertmesh.ops.commands.status import status_lines
    from expertmesh.protos import admin_pb2
    from expertmesh.router_service.http_metrics import FrontCounters, prometheus_text

    stats = admin_pb2.RouterStats(steps=10, expert_shard_calls=45, finished_requests=3)
    lines = status_lines(admin_pb2.ClusterState(model="m", router=stats))
    assert "expert loads: 4.5 shards per step, 15.0 per finished request (45 shard calls, 3 requests)" in lines
    fresh = status_lines(admin_pb2.ClusterState(model="m", router=admin_pb2.RouterStats()))
    assert any(line.startswith("expert loads: - shards per step, - per finished") for line in fresh)
    text = prometheus_text(FrontCounters(), {"expert_shard_calls": 45, "finished_requests": 3, "replica": "r"})
    assert 'expertmesh_router_expert_shard_calls_total{replica="r"} 45' in text
    assert 'expertmesh_router_finished_requests_total{replica="r"} 3' in text


def test_bench_fifo_vs_affinity_on_a_mesh_double(checkpoints):
    """ops/bench/offload_affinity.py on the in-process model standing in for a mesh (no actors: no tier counters):
    the runs alternate, tokens equal FIFO's, affinity calls fewer shards, and the router's weights are put back."""
    import torch

    from expertmesh.ops.bench.offload_affinity import AffinityWorkload, serve_fifo_vs_affinity

    model = load_reference_model(checkpoints["mixtral"])
    embed = model.w.embed.clone()
    mesh = SimpleNamespace(model=model, backend=SimpleNamespace(prefetcher="kept"))
    zeros = dict.fromkeys(("hits", "misses", "bytes_moved", "stall_s", "prefetch_issued", "prefetch_useful",
                           "compute_s"), 0.0)
    workload = AffinityWorkload(requests=6, prompt=4, max_tokens=4, max_active=2, rounds=2)
    result = serve_fifo_vs_affinity(mesh, lambda m: dict(zeros), workload)
    assert [(r["admission"], r["round"]) for r in result["runs"]] == [
        ("fifo", 0), ("affinity", 0), ("fifo", 1), ("affinity", 1)]
    summary = result["summary"]
    assert summary["same_tokens"] and summary["shard_calls_fewer_x"] >= 1.5, result
    assert torch.equal(model.w.embed, embed) and mesh.backend.prefetcher == "kept"


def test_with_nothing_running_the_last_batchs_experts_are_the_reference():
    sigs = {"a": {2, 3}, "b": {0, 1}, "c": {2, 3}}
    waiting = deque([_seq("a", 1.0), _seq("b", 2.0), _seq("c", 3.0)])
    reorder_waiting(waiting, [], free=1, now=4.0, max_wait_s=10.0,
                    signature_of=lambda s: frozenset(sigs[s.name]), recent=frozenset({0, 1}))
    assert [s.name for s in waiting] == ["b", "a", "c"]  # b's experts are still resident; a would reload
