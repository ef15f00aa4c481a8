"""Overlap (issue 7): a step split into two micro-batches that ping-pong their expert rounds gives the plain forward's
logits (prefill and KV-cache decode, sequences of different lengths, all three families), keeps one Routing per
layer in the trace, and really interleaves (A's round is in flight while B runs its dense part). No Ray.
"""

from __future__ import annotations

import pytest
import torch

from expertmesh.experts.gating import Routing, concat_routings, route
from expertmesh.experts.modeling import MoEDecoder
from expertmesh.experts.reference import load_reference_model
from tests.fakes import CountingObserver, FailingInProcessTransport
from tests.tiny_checkpoints import VOCAB

FAMILIES = ("mixtral", "qwen2_moe", "olmoe")
TOL = 1e-5


def _prompts(lengths: tuple[int, ...], seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=gen) for n in lengths]


def _pair(path) -> tuple[MoEDecoder, MoEDecoder]:
    plain = load_reference_model(path)
    return plain, MoEDecoder(plain.cfg, plain.w, plain.experts, overlap=True)


@pytest.mark.parametrize("family", FAMILIES)
def test_overlapped_forward_equals_plain_prefill_and_decode(checkpoints, family):
    plain, overlapped = _pair(checkpoints[family])
    prompts = _prompts((9, 3, 6, 1, 4))  # different lengths; the 5 sequences split 9 | 3+6+1+4
    caches_p = [plain.new_cache() for _ in prompts]
    caches_o = [overlapped.new_cache() for _ in prompts]
    want = plain.forward(prompts, caches_p)
    got = overlapped.forward(prompts, caches_o)
    for a, b in zip(want, got):
        torch.testing.assert_close(b, a, rtol=0, atol=TOL)
    _same_trace(plain, overlapped)
    nxt = [x[-1].argmax().view(1) for x in want]
    for _ in range(3):  # decode steps on the KV caches each forward filled
        want = plain.forward(nxt, caches_p)
        got = overlapped.forward(nxt, caches_o)
        for a, b in zip(want, got):
            torch.testing.assert_close(b, a, rtol=0, atol=TOL)
        _same_trace(plain, overlapped)
        nxt = [x[-1].argmax().view(1) for x in want]
    # A mixed step: some sequences prefill more tokens while others decode one.
    mixed = [torch.tensor([1, 2, 3]), nxt[1], nxt[2], torch.tensor([5, 6]), nxt[4]]
    for a, b in zip(plain.forward(mixed, caches_p), overlapped.forward(mixed, caches_o)):
        torch.testing.assert_close(b, a, rtol=0, atol=TOL)
    assert [c.length for c in caches_p] == [c.length for c in caches_o]


def _same_trace(plain: MoEDecoder, overlapped: MoEDecoder) -> None:
    want, got = plain.last_trace.routings, overlapped.last_trace.routings
    assert list(want) == list(got) and want  # one Routing per MoE layer, same layers
    for layer in want:
        assert torch.equal(want[layer].experts, got[layer].experts)
        torch.testing.assert_close(got[layer].weights, want[layer].weights, rtol=0, atol=1e-6)


def test_overlap_needs_two_sequences_and_is_refused_with_capacity(checkpoints):
    plain, overlapped = _pair(checkpoints["mixtral"])
    log = _Recorder(plain.experts)
    overlapped.experts = log
    overlapped.forward(_prompts((7,)))  # one sequence: nothing to overlap, the plain schedule runs
    kinds = [kind for kind, *_ in log.events]
    assert kinds[0] == "begin" and kinds[-1] == "end" and set(kinds[1:-1]) == {"run"}
    with pytest.raises(ValueError, match="overlap"):
        MoEDecoder(plain.cfg, plain.w, plain.experts, capacity_factor=1.0, overlap=True)


def test_a_per_step_policy_decides_each_step_and_changes_no_logit(checkpoints):
    """router.overlap "auto": the decoder asks its policy every step with the step's lengths and cached lengths;
    a step it declines runs the plain schedule, one it accepts the ping-pong one, with the same logits."""
    plain, _ = _pair(checkpoints["mixtral"])
    asked: list[tuple[list[int], list[int]]] = []

    def policy(lengths, starts):  # split decode steps only (prefill steps decline)
        asked.append((list(lengths), list(starts)))
        return all(n == 1 for n in lengths)

    log = _Recorder(plain.experts)
    auto = MoEDecoder(plain.cfg, plain.w, log, overlap=policy)
    prompts = _prompts((5, 3, 4))
    caches_p, caches_a = [plain.new_cache() for _ in prompts], [auto.new_cache() for _ in prompts]
    want, got = plain.forward(prompts, caches_p), auto.forward(prompts, caches_a)
    assert {kind for kind, *_ in log.events} == {"begin", "end", "run"}  # declined: plain schedule
    step = [x[-1].argmax().view(1) for x in want]
    log.events.clear()
    want, got = plain.forward(step, caches_p), auto.forward(step, caches_a)
    assert {kind for kind, *_ in log.events} == {"begin", "end", "submit", "wait"}  # accepted: ping-pong
    for a, b in zip(want, got):
        torch.testing.assert_close(b, a, rtol=0, atol=TOL)
    assert asked == [([5, 3, 4], [0, 0, 0]), ([1, 1, 1], [5, 3, 4])]


class _Recorder:
    """ExpertBackend that logs submit/wait/run (with the token count) and the step hooks."""

    def __init__(self, inner):
        self.inner = inner
        self.events: list[tuple] = []

    def effective_routing(self, layer: int, routing: Routing) -> Routing:
        return routing

    def begin_step(self, lengths: list[int] | None = None) -> None:
        self.events.append(("begin",))

    def end_step(self) -> None:
        self.events.append(("end",))

    def run(self, layer, hidden, routing):
        self.events.append(("run", layer, hidden.shape[0]))
        return self.inner.run(layer, hidden, routing)

    def submit(self, layer, hidden, routing):
        self.events.append(("submit", layer, hidden.shape[0]))
        return layer, hidden.shape[0], self.inner.run(layer, hidden, routing)

    def wait(self, pending):
        layer, n, out = pending
        self.events.append(("wait", layer, n))
        return out


def test_schedule_interleaves_the_two_micro_batches(checkpoints, monkeypatch):
    plain, overlapped = _pair(checkpoints["mixtral"])
    log = _Recorder(plain.experts)
    overlapped.experts = log
    real_attention = MoEDecoder._attention

    def attention(self, layer, h, *args):  # the dense part of a layer starts with its attention
        log.events.append(("dense", layer, h.shape[0]))
        return real_attention(self, layer, h, *args)

    monkeypatch.setattr(MoEDecoder, "_attention", attention)
    overlapped.forward(_prompts((4, 4, 3, 6)))  # halves: 4+4 | 3+6 tokens (sizes tell A from B)
    events = log.events
    assert events[0] == ("begin",) and events[-1] == ("end",)
    layers = plain.cfg.num_layers
    a, b = 8, 9
    expected: list[tuple] = []
    for i in range(layers):
        for n in (a, b):
            if i:
                expected.append(("wait", i - 1, n))
            expected += [("dense", i, n), ("submit", i, n)]
    expected += [("wait", layers - 1, a), ("wait", layers - 1, b)]
    assert events[1:-1] == expected
    # In words: A submits layer i before B's dense part of layer i, and B submits before A waits for layer i.
    for i in range(layers):
        assert events.index(("submit", i, a)) < events.index(("dense", i, b)) < events.index(("submit", i, b))
        assert events.index(("submit", i, b)) < events.index(("wait", i, a))


def test_dense_layers_run_inline_in_the_schedule(checkpoints):
    plain, overlapped = _pair(checkpoints["qwen2_moe"])  # layer 1 has a dense MLP (mlp_only_layers)
    log = _Recorder(plain.experts)
    overlapped.experts = log
    prompts = _prompts((5, 3, 5))
    want = plain.forward(prompts)
    got = overlapped.forward(prompts)
    for x, y in zip(want, got):
        torch.testing.assert_close(y, x, rtol=0, atol=TOL)
    submitted = sorted({e[1] for e in log.events if e[0] == "submit"})
    assert submitted == sorted(plain.cfg.moe_layers) and 1 not in submitted


def _routing(experts: list[list[int]], **extra) -> Routing:
    e = torch.tensor(experts)
    return Routing(experts=e, weights=torch.full(e.shape, 0.5), **extra)


def test_concat_routings_pinned():
    a = _routing([[0, 1], [2, 3]], rerouted=1, dropped=0, probs=torch.zeros(2, 4))
    b = _routing([[3, -1]], rerouted=0, dropped=1, probs=torch.ones(1, 4),
                 degraded_per_token=torch.tensor([1]))
    both = concat_routings([a, b])
    assert both.experts.tolist() == [[0, 1], [2, 3], [3, -1]]
    assert both.weights.shape == (3, 2) and both.num_tokens == 3
    assert (both.rerouted, both.dropped, both.degraded) == (1, 1, 1)
    assert both.probs.tolist() == [[0.0] * 4, [0.0] * 4, [1.0] * 4]
    assert both.degraded_per_token.tolist() == [0, 0, 1]  # a part without the field counts no degraded slot
    assert both.rerouted_per_token is None  # missing in both parts
    assert both.tokens_per_expert(4).tolist() == [1, 1, 1, 2]
    assert concat_routings([a]) is a
    # The concatenation of two halves' routings is the routing of the whole (routing is per token).
    logits = torch.randn(10, 4, generator=torch.Generator().manual_seed(0))
    whole, halves = route(logits, 2, True), concat_routings([route(logits[:6], 2, True), route(logits[6:], 2, True)])
    assert torch.equal(whole.experts, halves.experts) and torch.equal(whole.weights, halves.weights)


def test_remote_experts_submit_wait_under_overlap_with_failover(checkpoints):
    from expertmesh.cluster.routing_table import RoutingTable
    from expertmesh.router_service.dispatch import RemoteExperts

    plain, _ = _pair(checkpoints["olmoe"])
    cfg, local = plain.cfg, plain.experts
    # Two replicas per expert, so a failed call's tokens move to the other one within the step.
    layout = {f"e{e}-r{r}": [(layer, e) for layer in cfg.moe_layers] for e in range(cfg.num_experts) for r in (0, 1)}
    transport = FailingInProcessTransport(local.shards, local.act, {name: object() for name in layout})
    backend = RemoteExperts(RoutingTable.from_actor_shards(layout), transport)
    backend.observer = CountingObserver()
    overlapped = MoEDecoder(cfg, plain.w, backend, overlap=True)
    prompts = _prompts((6, 2, 7), seed=3)
    want = plain.forward(prompts)
    transport.fail = {"e0-r0", "e1-r1", "e2-r0"}
    got = overlapped.forward(prompts)
    for a, b in zip(want, got):
        torch.testing.assert_close(b, a, rtol=0, atol=TOL)
    assert backend.retried_calls > 0
    _same_trace(plain, overlapped)
    # Load statistics count every (token, slot) once though each layer ran as two rounds.
    assert backend.observer.tokens == {layer: 15 * cfg.top_k for layer in cfg.moe_layers}
    # Calls of both micro-batches add up per layer.
    hit = {layer: int(torch.unique(r.experts).numel()) for layer, r in plain.last_trace.routings.items()}
    assert all(hit[layer] <= n <= 2 * 2 * hit[layer] + 3 for layer, n in backend.calls_per_layer.items())
    # B's first round went out before A's was gathered: every slot of layer 0 (both micro-batches) was submitted
    # before the first gather.
    first_gather = [kind for kind, *_ in transport.log].index("gather")
    before = transport.log[:first_gather]
    assert {layer for _, layer, _ in before} == {cfg.moe_layers[0]}
    assert sum(n for *_, n in before) == 15 * cfg.top_k


def test_configs_refuse_overlap_with_capacity_naming_the_field():
    from expertmesh.router_service.config import ConfigError, MeshConfig

    with pytest.raises(ConfigError, match="^router.overlap:") as err:
        MeshConfig.from_dict({"router": {"overlap": True, "capacity_factor": 1.25}}).validate()
    assert err.value.field == "router.overlap"
    assert MeshConfig.from_dict({"router": {"overlap": True}}).validate().router.overlap
