"""Overload shedding (issue 15 item 4): the pure policy with a fake clock (enters after its window and not before,
bounded share, hysteresis), the deterministic choice of shed slots, the dispatcher moving them to the next-best
expert and counting them, and distributed == in-process reference given the same shed decisions. No Ray."""

from __future__ import annotations

import pytest
import torch

from expertmesh.cluster.routing_table import RoutingTable
from expertmesh.experts.errors import ConfigError
from expertmesh.experts.gating import Routing, route
from expertmesh.experts.reference import load_reference_model
from expertmesh.router_service.config import MeshConfig
from expertmesh.router_service.dispatch import FailoverConfig, RemoteExperts
from expertmesh.router_service.shedding import ShedConfig, ShedPolicy, apply_shed, choose_shed_slots, decide
from tests.fakes import HIDDEN, FakeClock, FakeTransport, expert_weights
from tests.tiny_checkpoints import VOCAB

E = 4
CFG = ShedConfig(enabled=True, replica_tokens_per_step=10, threshold=0.95, window_s=5.0, off_threshold=0.8,
                 off_window_s=3.0, max_share=0.5)
ONE_REPLICA = torch.ones(E, dtype=torch.int64)


def _load(hot: int, others: int = 2) -> torch.Tensor:
    """[E] offered slots: expert 0 gets `hot`, the rest `others`."""
    return torch.tensor([hot] + [others] * (E - 1))


def test_enters_after_the_window_and_not_before():
    policy = ShedPolicy(CFG, E)
    for t in (0.0, 1.0, 2.5, 4.9):  # util 2.0 > 0.95, but not yet for 5 s
        assert policy.observe(0, t, _load(20), ONE_REPLICA).tolist() == [0, 0, 0, 0]
    assert not policy.shedding(0).any()
    shed = policy.observe(0, 5.0, _load(20), ONE_REPLICA)
    assert policy.shedding(0).tolist() == [True, False, False, False]
    # Excess over threshold x capacity is 20 - 9 = 11; the share cap (50 % of 20) bounds it to 10.
    assert shed.tolist() == [10, 0, 0, 0]


def test_one_round_at_or_below_threshold_restarts_the_window():
    policy = ShedPolicy(CFG, E)
    policy.observe(0, 0.0, _load(20), ONE_REPLICA)
    policy.observe(0, 4.0, _load(9), ONE_REPLICA)  # 0.9: not above
    for t in (4.5, 8.0, 9.4):
        assert not policy.observe(0, t, _load(20), ONE_REPLICA).any()
    assert policy.observe(0, 9.5, _load(20), ONE_REPLICA)[0] > 0  # 5 s after 4.5


def test_share_is_bounded_and_only_the_excess_moves():
    state = decide(CFG, 0.0, _load(12), ONE_REPLICA, _shedding_state())[1]
    shed, _ = decide(CFG, 1.0, _load(12), ONE_REPLICA, state)
    assert shed[0] == 12 - 9  # excess (3) under the cap (6)
    for max_share, load in ((0.5, 100), (0.25, 100), (0.1, 37)):
        cfg = ShedConfig(enabled=True, replica_tokens_per_step=10, max_share=max_share, window_s=0)
        shed, _ = decide(cfg, 0.0, _load(load), ONE_REPLICA, _shedding_state())
        assert shed[0] == int(max_share * load)
    # Capacity is per live replica: two replicas of expert 0 carry 20 slots under the threshold.
    two = torch.tensor([2, 1, 1, 1])
    assert decide(CFG, 0.0, _load(19), two, _shedding_state())[0].tolist() == [0, 0, 0, 0]
    # A shard with no live replica is the no-replica policy's business, never shed.
    none = torch.tensor([0, 1, 1, 1])
    shed, state = decide(CFG, 0.0, _load(50), none, _shedding_state())
    assert shed[0] == 0 and not state.shedding[0]


def _shedding_state():
    """A layer state whose expert 0 sheds already."""
    policy = ShedPolicy(ShedConfig(enabled=True, replica_tokens_per_step=10, window_s=0), E)
    policy.observe(0, 0.0, _load(20), ONE_REPLICA)
    assert policy.shedding(0)[0]
    return policy.layers[0]


def test_hysteresis_stops_only_below_the_off_threshold_held_for_its_window():
    policy = ShedPolicy(CFG, E)
    policy.layers[0] = _shedding_state()
    # Between off_threshold (0.8) and threshold (0.95): keeps shedding state (sheds nothing: no excess).
    for t in (10.0, 20.0, 30.0):
        assert policy.observe(0, t, _load(9), ONE_REPLICA)[0] == 0
        assert policy.shedding(0)[0]
    policy.observe(0, 31.0, _load(5), ONE_REPLICA)  # below 0.8 from t=31
    policy.observe(0, 33.0, _load(8), ONE_REPLICA)  # 0.8 is not below: the off clock restarts
    policy.observe(0, 33.5, _load(5), ONE_REPLICA)
    policy.observe(0, 36.0, _load(5), ONE_REPLICA)
    assert policy.shedding(0)[0]  # 2.5 s below so far
    policy.observe(0, 36.5, _load(5), ONE_REPLICA)
    assert not policy.shedding(0)[0]
    # Back above: a fresh entry window, not an immediate restart.
    assert policy.observe(0, 37.0, _load(20), ONE_REPLICA)[0] == 0
    assert policy.observe(0, 42.0, _load(20), ONE_REPLICA)[0] == 10


def _routing(tokens: int, seed: int, hot: int | None = None, top_k: int = 2) -> Routing:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, E, generator=gen)  # [T, E]
    if hot is not None:
        logits[:, hot] += 10.0  # every token's favourite
    return route(logits, top_k, renormalize=True)


def test_choice_is_the_lowest_probability_slots_and_deterministic():
    routing = _routing(12, seed=1, hot=0)
    shed = torch.tensor([5, 0, 0, 0])
    move = choose_shed_slots(routing, shed)
    assert torch.equal(move, choose_shed_slots(routing, shed.clone()))
    assert int(move.sum()) == 5 and bool((routing.experts[move] == 0).all())
    moved_p = routing.probs[move.any(1), 0]
    kept = (routing.experts == 0).any(1) & ~move.any(1)
    assert moved_p.max() <= routing.probs[kept, 0].min()
    # Ties go to the earlier token.
    flat = Routing(experts=torch.tensor([[0, 1]] * 4), weights=torch.full((4, 2), 0.5),
                   probs=torch.full((4, E), 0.25))
    assert choose_shed_slots(flat, torch.tensor([2, 0, 0, 0]))[:, 0].tolist() == [True, True, False, False]


def _choose_by_loop(routing: Routing, shed: torch.Tensor) -> torch.Tensor:
    """The obvious per-expert loop choose_shed_slots vectorises."""
    move = torch.zeros_like(routing.experts, dtype=torch.bool)
    for expert in torch.nonzero(shed).flatten().tolist():
        where = torch.nonzero(routing.experts == expert)
        pick = torch.sort(routing.probs[where[:, 0], expert], stable=True).indices[: int(shed[expert])]
        move[where[pick, 0], where[pick, 1]] = True
    return move


def test_vectorised_choice_equals_the_per_expert_loop():
    gen = torch.Generator().manual_seed(0)
    for _ in range(60):
        tokens, experts = int(torch.randint(1, 60, (1,), generator=gen)), int(torch.randint(2, 33, (1,), generator=gen))
        top_k = int(torch.randint(1, min(experts, 8) + 1, (1,), generator=gen))
        logits = torch.randn(tokens, experts, generator=gen).round(decimals=1)  # rounded: many ties
        routing = route(logits, top_k, renormalize=True)
        shed = torch.randint(0, 5, (experts,), generator=gen)
        assert torch.equal(choose_shed_slots(routing, shed), _choose_by_loop(routing, shed))


def test_shed_slots_go_to_the_next_best_target_and_are_counted():
    routing = _routing(12, seed=2, hot=0)
    targets = torch.tensor([False, True, False, True])  # 0 sheds, 2 sheds too (or is down)
    served = apply_shed(routing, torch.tensor([4, 0, 0, 0]), targets)
    assert served.shed == 4 and served.degraded == 0
    order = torch.sort(routing.probs, dim=-1, descending=True, stable=True).indices
    for t in torch.nonzero(served.shed_per_token).flatten().tolist():
        before, after = set(routing.experts[t].tolist()), set(served.experts[t].tolist())
        (new,) = after - before
        assert new == next(e for e in order[t].tolist() if targets[e] and e not in before)
        assert torch.isclose(served.weights[t].sum(), routing.weights[t].sum())
    untouched = served.shed_per_token == 0
    assert torch.equal(served.weights[untouched], routing.weights[untouched])
    # Nowhere to go: a shed slot stays (never dropped).
    stay = apply_shed(routing, torch.tensor([4, 0, 0, 0]), torch.zeros(E, dtype=torch.bool))
    assert stay.shed == 0 and stay.dropped == 0 and torch.equal(stay.experts, routing.experts)


def test_config_fields_are_named_and_off_by_default():
    assert MeshConfig().failover.shed.enabled is False
    # The Serve application builder and config files carry it as a plain dict.
    on = MeshConfig.from_dict({"failover": {"shed": {"enabled": True, "window_s": 2.0, "max_share": 0.25}}})
    assert MeshConfig.from_dict(on.to_dict()).validate().failover.shed == ShedConfig(True, window_s=2.0, max_share=0.25)
    with pytest.raises(ConfigError, match=r"failover\.shed\.off_threshold"):
        MeshConfig.from_dict({"failover": {"shed": {"threshold": 0.9, "off_threshold": 0.95}}}).validate()
    with pytest.raises(ConfigError, match=r"failover\.shed\.max_share"):
        MeshConfig.from_dict({"failover": {"shed": {"max_share": 0}}}).validate()
    with pytest.raises(ConfigError, match=r"failover\.shed\.replica_tokens_per_step"):
        MeshConfig.from_dict({"failover": {"shed": {"replica_tokens_per_step": 0}}}).validate()


def _backend(clock: FakeClock, replicas: int = 1) -> tuple[RemoteExperts, FakeTransport]:
    layout = {f"e{e}-r{r}": [(0, e)] for e in range(E) for r in range(replicas)}
    table = RoutingTable.from_actor_shards(layout)
    transport = FakeTransport(table, expert_weights(1, E))
    failover = FailoverConfig(shed=ShedConfig(enabled=True, replica_tokens_per_step=4, window_s=5.0))
    return RemoteExperts(table, transport, failover, clock=clock), transport


def test_dispatcher_sheds_after_the_window_to_the_next_best_expert_and_counts():
    clock = FakeClock()
    backend, transport = _backend(clock)
    hidden = torch.randn(12, HIDDEN, generator=torch.Generator().manual_seed(0))
    routing = _routing(12, seed=3, hot=0, top_k=1)  # 12 tokens on expert 0 alone: util 3.0
    plain = backend.run(0, hidden, routing)
    assert backend.shed_slots == 0 and backend.effective[0] is routing
    clock.now += 5.0
    transport.submitted.clear()
    shed_out = backend.run(0, hidden, routing)
    served = backend.effective[0]
    assert backend.shed_slots == served.shed == 6  # min(12 - floor(0.95 x 4), 50 % of 12)
    shed, targets = backend.last_shed[0]
    assert shed.tolist() == [6, 0, 0, 0] and targets.tolist() == [False, True, True, True]
    assert torch.equal(served.experts, apply_shed(routing, shed, targets).experts)
    to_hot = sum(sum(c) for a, _, _, c, _ in transport.submitted if a == "e0-r0")
    assert to_hot == 12 - 6
    assert not torch.equal(plain, shed_out)
    # Twice the replicas, twice the capacity: no longer overloaded enough to shed the same share.
    backend2, _ = _backend(FakeClock(), replicas=3)
    backend2.run(0, hidden, routing)
    backend2.clock.now += 5.0
    backend2.run(0, hidden, routing)
    assert backend2.shed_slots == 12 - 11  # capacity 12: excess over floor(0.95 x 12) = 11


class _ReplayShed:
    """The reference's LocalExperts serving the routing the dispatcher's recorded shed decisions make."""

    def __init__(self, inner, decisions):
        self.inner, self.decisions = inner, decisions

    def _served(self, layer, routing):
        return apply_shed(routing, *self.decisions[layer])

    def effective_routing(self, layer, routing):
        return self._served(layer, routing)

    def run(self, layer, hidden, routing):
        return self.inner.run(layer, hidden, self._served(layer, routing))


def test_distributed_with_shedding_equals_reference_with_the_same_decisions(checkpoints):
    from expertmesh.experts.modeling import MoEDecoder
    from tests.fakes import FailingInProcessTransport

    reference = load_reference_model(checkpoints["mixtral"])
    cfg, local = reference.cfg, reference.experts
    layout = {f"e{e}": [(layer, e) for layer in cfg.moe_layers] for e in range(cfg.num_experts)}
    transport = FailingInProcessTransport(local.shards, local.act, {name: object() for name in layout})
    clock = FakeClock()
    shed = ShedConfig(enabled=True, replica_tokens_per_step=3, window_s=1.0)
    backend = RemoteExperts(RoutingTable.from_actor_shards(layout), transport, FailoverConfig(shed=shed), clock=clock)
    distributed = MoEDecoder(cfg, reference.w, backend)
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen) for n in (9, 7)]
    distributed.forward(prompts)  # starts the windows
    clock.now += 1.0
    got = distributed.forward(prompts)
    assert backend.shed_slots > 0
    decisions = dict(backend.last_shed)
    replay = MoEDecoder(cfg, reference.w, _ReplayShed(local, decisions))
    want = replay.forward(prompts)
    plain = reference.forward(prompts)
    for g, w, p in zip(got, want, plain):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-5)
        assert (g - p).abs().max() > 1e-3  # shedding really changed the output
    for layer in cfg.moe_layers:
        served = distributed.last_trace.routings[layer]
        replayed = replay.last_trace.routings[layer]
        assert served.shed == replayed.shed
        assert torch.equal(served.experts, replayed.experts) and torch.equal(served.weights, replayed.weights)


def _shedding_model(checkpoints, window_s: float = 0.0):
    from expertmesh.experts.modeling import MoEDecoder
    from tests.fakes import FailingInProcessTransport

    reference = load_reference_model(checkpoints["mixtral"])
    cfg, local = reference.cfg, reference.experts
    layout = {f"e{e}": [(layer, e) for layer in cfg.moe_layers] for e in range(cfg.num_experts)}
    transport = FailingInProcessTransport(local.shards, local.act, {name: object() for name in layout})
    shed = ShedConfig(enabled=True, replica_tokens_per_step=2, window_s=window_s)
    backend = RemoteExperts(RoutingTable.from_actor_shards(layout), transport, FailoverConfig(shed=shed))
    return MoEDecoder(cfg, reference.w, backend), backend


def test_shed_slots_are_counted_per_response_in_grpc_and_openai(checkpoints):
    import asyncio

    from expertmesh.router_service.batching import ContinuousBatcher, DoneEvent, GenerationRequest
    from expertmesh.router_service.openai_requests import event_dict
    from expertmesh.router_service.openai_responses import routing_extension
    from expertmesh.router_service.proto_mapping import done_message

    model, backend = _shedding_model(checkpoints)
    gen = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, VOCAB, (12,), generator=gen).tolist()

    async def main():
        events = [e async for e in ContinuousBatcher(model, None).stream(
            GenerationRequest(prompt_ids=prompt, max_tokens=4))]
        return events[-1]

    done = asyncio.run(asyncio.wait_for(main(), 30))
    assert isinstance(done, DoneEvent)
    assert done.shed == backend.shed_slots > 0  # one request: every shed slot of the run is its own
    assert done_message(done).done.routing.shed_tokens == done.shed
    summary = routing_extension([event_dict(done, str)["done"]])["routing"]
    assert (summary["shed_tokens"], summary["dropped_tokens"], summary["degraded_tokens"]) == (done.shed, 0, 0)


def test_shed_metrics_counter_and_gauges(monkeypatch):
    import numpy as np

    from expertmesh.router_service import metrics
    from expertmesh.router_service.observability_config import MetricsConfig

    class Fake:
        def __init__(self, spec):
            self.values = {}

        def inc(self, value, tags=None):
            key = tuple(sorted((tags or {}).items()))
            self.values[key] = self.values.get(key, 0.0) + value

        def set(self, value, tags=None):
            self.values[tuple(sorted((tags or {}).items()))] = value

        def observe(self, value, tags=None):
            pass

    monkeypatch.setattr(metrics, "_make", Fake)
    policy = ShedPolicy(ShedConfig(enabled=True, replica_tokens_per_step=10, window_s=0), E)
    policy.observe(0, 0.0, _load(20), ONE_REPLICA)
    for per_shard in (True, False):
        m = metrics.RouterMetrics([0], E, MetricsConfig(per_shard_labels=per_shard))
        m.record_layer(0, np.array([10, 4, 4, 2]), [], 0.01, shed=10)
        m.flush(m.shed_gauges(policy))
        assert m.m["expertmesh_shed_tokens"].values == {(("layer", "0"),): 10.0}
        util, shedding = m.m["expertmesh_shard_utilization"].values, m.m["expertmesh_shedding"].values
        if per_shard:
            assert util[(("expert", "0"), ("layer", "0"))] == 2.0 and util[(("expert", "1"), ("layer", "0"))] == 0.2
            assert [shedding[(("expert", str(e)), ("layer", "0"))] for e in range(E)] == [1.0, 0.0, 0.0, 0.0]
        else:
            assert util == {(("expert", "all"), ("layer", "0")): 2.0}
            assert shedding == {(("expert", "all"), ("layer", "0")): 1.0}


def test_flags_set_the_shed_section():
    import argparse

    from expertmesh.ops.commands.mesh_flags import add_mesh_flags, mesh_config_from_args

    parser = argparse.ArgumentParser()
    add_mesh_flags(parser)
    args = parser.parse_args(["--shed-overload", "--shed-capacity", "16", "--shed-threshold", "0.9",
                              "--shed-window-s", "2", "--shed-off-threshold", "0.5", "--shed-off-window-s", "3",
                              "--shed-max-share", "0.3"])
    assert mesh_config_from_args(args).failover.shed == ShedConfig(True, 16, 0.9, 2.0, 0.5, 3.0, 0.3)
    assert mesh_config_from_args(parser.parse_args([])).failover.shed == ShedConfig()
    with pytest.raises(ConfigError, match=r"failover\.shed\.max_share"):
        mesh_config_from_args(parser.parse_args(["--shed-max-share", "1.5"]))
