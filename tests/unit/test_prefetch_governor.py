"""The prefetch governor (router_service/prefetch_governor.py): hints stay on only while decode steps run faster with
them, measured in alternating windows inside the serving loop; wired through the predictor and the dispatcher."""

from __future__ import annotations

import pytest
import torch

from expertmesh.router_service.config import ExpertsConfig
from expertmesh.router_service.prefetch import NextLayerPredictor
from expertmesh.router_service.prefetch_governor import GovernorSettings, PrefetchGovernor

# Every pair measured (no early verdict), so the tests below see the whole schedule; the early verdict has its own.
SETTINGS = GovernorSettings(window_steps=4, rounds=2, hold_steps=10, decisive=float("inf"))
MEASURE = 2 * SETTINGS.rounds * SETTINGS.window_steps  # decode steps one measurement takes


def run(gov: PrefetchGovernor, steps: int, cost, rows: int = 4, decode: bool = True) -> list[bool]:
    """`steps` steps; cost(hinting, step index) -> seconds. -> whether each step hinted."""
    hinted = []
    for i in range(steps):
        gov.begin(decode=decode, rows=rows)
        hinted.append(gov.hinting)
        gov.end(cost(gov.hinting, i))
    return hinted


@pytest.mark.parametrize("hint_s, off_s, verdict", [(0.010, 0.020, True), (0.030, 0.020, False),
                                                    (0.020, 0.020, False)])  # a tie: no hints, fewer bytes
def test_keeps_hints_only_when_steps_with_them_are_faster(hint_s, off_s, verdict):
    gov = PrefetchGovernor(SETTINGS)
    hinted = run(gov, MEASURE, lambda on, i: hint_s if on else off_s)
    # Windows alternate on, off, on, off: each half of a pair sees nearly the same workload.
    assert hinted == [True] * 4 + [False] * 4 + [True] * 4 + [False] * 4
    assert gov.verdict is verdict and not gov.measuring and gov.hinting is verdict
    assert gov.stats()["last"] == {"hints": verdict, "on_s_per_row": hint_s / 4, "off_s_per_row": off_s / 4}


def test_the_first_step_of_each_window_is_not_counted():
    # The first step after a switch pays for what the other mode left resident (or not): 10x slower here. Counted,
    # it would make the hinted windows look slower; the rest of each hinted window is faster.
    def cost(on: bool, i: int) -> float:
        first = i % SETTINGS.window_steps == 0
        return (0.5 if first else 0.010) if on else 0.020

    gov = PrefetchGovernor(SETTINGS)
    run(gov, MEASURE, cost)
    assert gov.verdict is True


def test_prefill_steps_follow_the_verdict_and_are_not_measured():
    gov = PrefetchGovernor(SETTINGS)
    run(gov, 2, lambda on, i: 0.0)  # inside the first (hinted) window
    assert run(gov, 5, lambda on, i: 99.0, rows=1, decode=False) == [True] * 5  # prompts: not measured
    run(gov, MEASURE - 2, lambda on, i: 0.030 if on else 0.020)
    assert gov.verdict is False and gov.stats()["last"]["on_s_per_row"] < 1.0
    assert run(gov, 3, lambda on, i: 0.0, decode=False) == [False] * 3


def test_measures_again_after_hold_steps_and_follows_a_change():
    gov = PrefetchGovernor(SETTINGS)
    run(gov, MEASURE, lambda on, i: 0.030 if on else 0.020)  # hints cost: off
    assert run(gov, SETTINGS.hold_steps, lambda on, i: 0.020) == [False] * SETTINGS.hold_steps
    assert gov.measuring  # the hold is over
    run(gov, MEASURE, lambda on, i: 0.010 if on else 0.020)  # now they pay (e.g. the node got quieter)
    assert gov.verdict is True and gov.stats()["measurements"] == 2 and gov.stats()["measurements_on"] == 1


def test_a_repeated_verdict_doubles_the_hold_up_to_its_cap_and_a_change_resets_it():
    settings = GovernorSettings(window_steps=4, rounds=2, hold_steps=10, max_hold_factor=4, decisive=float("inf"))
    gov = PrefetchGovernor(settings)
    holds = []
    for _ in range(4):  # hints cost time every time: off, off, off, off
        run(gov, MEASURE, lambda on, i: 0.030 if on else 0.020)
        holds.append(gov.stats()["hold_steps"])
        assert run(gov, gov.hold, lambda on, i: 0.020) == [False] * gov.hold
        assert gov.measuring
    assert holds == [10, 20, 40, 40]  # the first verdict holds hold_steps; each repeat doubles it, capped at 4x
    run(gov, MEASURE, lambda on, i: 0.010 if on else 0.020)  # now hints pay: a new answer, measured again soon
    assert gov.verdict is True and gov.hold == 10


@pytest.mark.parametrize("hint_s, verdict", [(0.030, False), (0.012, True)])
def test_a_pair_far_apart_decides_without_the_other_pairs(hint_s, verdict):
    gov = PrefetchGovernor(GovernorSettings(window_steps=4, rounds=3, hold_steps=10, decisive=0.25))
    hinted = run(gov, 8, lambda on, i: hint_s if on else 0.020)  # one pair: 50 % slower / 40 % faster with hints
    assert hinted == [True] * 4 + [False] * 4
    assert not gov.measuring and gov.verdict is verdict and gov.stats()["measurements"] == 1


def test_a_close_pair_or_pairs_that_disagree_measure_every_pair():
    close = PrefetchGovernor(GovernorSettings(window_steps=4, rounds=3, hold_steps=10, decisive=0.25))
    run(close, 8, lambda on, i: 0.022 if on else 0.020)  # 10 % apart: not decisive
    assert close.measuring
    run(close, 16, lambda on, i: 0.022 if on else 0.020)
    assert not close.measuring and close.verdict is False
    # First pair: 10 % apart; second pair: hints 50 % slower (the load changed). Not far apart in every pair.
    mixed = PrefetchGovernor(GovernorSettings(window_steps=4, rounds=3, hold_steps=10, decisive=0.25))
    run(mixed, 16, lambda on, i: (0.022 if i < 8 else 0.030) if on else 0.020)
    assert mixed.measuring and len(mixed.windows) == 4


def test_when_hints_cost_time_the_governed_rate_is_close_to_on_demand():
    """The issue's target, as a model: a step costs 20 ms on demand and 33 ms with hints (the 2-core box's gate
    29.8 vs 49.1 tok/s). Over a long run the governor hints only in its measuring windows."""
    gov = PrefetchGovernor(GovernorSettings())  # the defaults: 8-step windows, 3 pairs, hold 256
    hinted = run(gov, 3000, lambda on, i: 0.033 if on else 0.020)
    mean_s = sum(0.033 if h else 0.020 for h in hinted) / len(hinted)
    # Within 1.5 % of on demand (ungoverned: 0.61; 0.95 with neither the early verdict nor the growing hold)
    assert 0.020 / mean_s > 0.985
    assert gov.stats()["measurements_on"] == 0


def test_the_predictor_withholds_hints_while_the_governor_says_off():
    gov = PrefetchGovernor(SETTINGS)
    p = NextLayerPredictor("history", [0, 1], governor=gov)
    p.observe(1, torch.tensor([[2, 3]]))
    gov.begin(decode=True, rows=1)
    assert p.predict(0, torch.zeros(1, 4)) == (1, [2, 3])  # the first window hints
    gov.verdict, gov.measuring = False, False
    assert p.predict(0, torch.zeros(1, 4)) is None and p.governed == 1
    p.observe(1, torch.tensor([[2, 3]]))  # the stale prediction from before is not scored against this run
    assert p.stats()["predicted_shards"] == 0 and p.stats()["governor"]["hints"] is False


def test_the_decoder_and_dispatcher_time_each_step_for_the_governor(checkpoints):
    """MoEDecoder.forward calls the dispatcher's begin_step(lengths) / end_step around every forward: a decode step
    (one token per sequence) is measured, a prompt is not."""
    from expertmesh.cluster.routing_table import RoutingTable
    from expertmesh.experts.modeling import MoEDecoder
    from expertmesh.experts.reference import load_reference_model
    from expertmesh.router_service.dispatch import RemoteExperts
    from tests.fakes import FailingInProcessTransport

    plain = load_reference_model(checkpoints["mixtral"])
    cfg = plain.cfg
    layout = {f"e{e}": [(layer, e) for layer in cfg.moe_layers] for e in range(cfg.num_experts)}
    class Handle:  # hints sent as calls of their own land here
        def __init__(self):
            self.prefetch, self.sent = self, []

        def remote(self, shards):
            self.sent.append(shards)

    handles = {name: Handle() for name in layout}
    transport = FailingInProcessTransport(plain.experts.shards, plain.experts.act, handles)
    remote = RemoteExperts(RoutingTable.from_actor_shards(layout), transport)
    gov = PrefetchGovernor(SETTINGS)
    remote.prefetcher = NextLayerPredictor("history", cfg.moe_layers, governor=gov)
    model = MoEDecoder(cfg, plain.w, remote)
    caches = [model.new_cache() for _ in range(2)]
    model.forward([torch.tensor([1, 2, 3]), torch.tensor([4, 5])], caches)  # prompts
    assert gov.windows == [] and gov._step is None
    for _ in range(3):
        model.forward([torch.tensor([7]), torch.tensor([8])], caches)  # decode steps
    assert len(gov.windows) == 1 and gov.windows[0].steps == 3 and gov.windows[0].rows == 4  # first not counted
    assert gov.windows[0].seconds > 0
    assert any(h.sent for h in handles.values())  # the first window hints


def test_configuration_builds_the_governor_or_none_and_names_a_bad_field():
    assert ExpertsConfig().prefetch_governor().settings.hold_steps == 256
    assert ExpertsConfig(prefetch_governor_hold_steps=None).prefetch_governor() is None
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="prefetch_governor_hold_steps"):
            ExpertsConfig(prefetch_governor_hold_steps=bad).validate()


def test_bench_section_alternates_the_modes_and_compares_tokens(checkpoints):
    """ops/bench/offload_governor.py on the in-process model standing in for a mesh (its experts take no hints, so
    this checks the section's shape, order and token check; the served bench test checks the governor decides)."""
    from types import SimpleNamespace

    from expertmesh.experts.reference import load_reference_model
    from expertmesh.ops.bench.offload_governor import GovernorWorkload, decode_with_and_without_governor, summarize

    model = load_reference_model(checkpoints["mixtral"])
    mesh = SimpleNamespace(model=model, backend=SimpleNamespace(prefetcher="kept"))
    context = torch.randint(0, model.cfg.vocab_size, (3, 5), generator=torch.Generator().manual_seed(0))
    result = decode_with_and_without_governor(mesh, context, GovernorWorkload(steps=4, rounds=2))
    assert [(r["mode"], r["round"]) for r in result["runs"]] == [
        ("off", 0), ("gate", 0), ("gate+governor", 0), ("gate+governor", 1), ("gate", 1), ("off", 1)]
    assert result["summary"]["all_tokens_equal"] and mesh.backend.prefetcher == "kept"
    assert result["summary"]["vs_on_demand"]["off"] == 1.0
    governed = [r for r in result["runs"] if r["mode"] == "gate+governor"]
    assert all(r["governor"]["measuring"] for r in governed)  # no dispatcher here: no step was timed
    # A run whose tokens differ from on demand's is reported, not hidden.
    runs = [dict(r) for r in result["runs"]]
    runs[1]["same_tokens_as_on_demand"] = False
    assert summarize(runs)["all_tokens_equal"] is False


def test_router_stats_and_status_say_whether_hints_are_on_and_why():
    from expertmesh.ops.commands.status import prefetch_line
    from expertmesh.protos import admin_pb2
    from expertmesh.router_service.prefetch import prefetch_note

    assert prefetch_note(None) == "" and prefetch_line(admin_pb2.RouterStats()) is None  # prefetch off: no line
    assert prefetch_note(NextLayerPredictor("history", [0, 1])) == "history"  # no governor
    gov = PrefetchGovernor(SETTINGS)
    p = NextLayerPredictor("history", [0, 1], governor=gov)
    assert prefetch_note(p) == "history, measuring"
    run(gov, MEASURE, lambda on, i: 0.030 if on else 0.020)
    note = prefetch_note(p)
    assert note == "history, hints off: 7.5 ms per sequence-row with them, 5.0 without, held 10 steps (0 done)", note
    assert prefetch_line(admin_pb2.RouterStats(prefetch=note)) == f"prefetch: {note}"


def test_the_prefetch_hints_gauge_follows_the_governors_verdict():
    from expertmesh.router_service.prefetch import prefetch_gauge

    assert prefetch_gauge(None) is None  # prefetch off: no series
    assert prefetch_gauge(NextLayerPredictor("history", [0, 1])) == 1.0  # no governor: hints always go
    gov = PrefetchGovernor(SETTINGS)
    p = NextLayerPredictor("history", [0, 1], governor=gov)
    assert prefetch_gauge(p) == -1.0  # measuring, no verdict yet
    run(gov, MEASURE, lambda on, i: 0.030 if on else 0.020)
    assert prefetch_gauge(p) == 0.0  # faster without: withheld
    run(gov, SETTINGS.hold_steps + MEASURE, lambda on, i: 0.020 if on else 0.030)
    assert prefetch_gauge(p) == 1.0  # measured again, faster with: sent
