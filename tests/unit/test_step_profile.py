"""The served step profile: the stage clocks, the table bench serve builds from their deltas, and η_serve."""

from __future__ import annotations

import asyncio

import pytest
import torch

from expertmesh.ops.bench.serve_profile import ROWS, eta_serve, profile_table, stage_deltas, status_profile_line
from expertmesh.router_service.step_profile import STAGES, StageClock

# One stretch of 10 steps, 1 s of wall time, with nested stages that add up (seconds).
DELTA = {
    "loop.idle": 0.10, "loop.busy": 0.85, "loop.schedule": 0.02, "loop.executor": 0.70, "loop.post": 0.10,
    "forward.sampling": 0.03, "post.detokenise": 0.04, "forward.thread": 0.65, "forward.model": 0.60,
    "model.gating": 0.05, "model.lm_head": 0.04, "dispatch.submit": 0.10, "dispatch.wait": 0.30,
    "dispatch.plan": 0.03, "dispatch.send": 0.06, "dispatch.gather": 0.25, "dispatch.combine": 0.02,
    "serve.emit": 0.01, "front.relay": 0.02,
}


def ms(table: dict, stage: str) -> float:
    return next(r["ms"] for r in table["rows"] if r["stage"] == stage)


def test_profile_rows_partition_the_step_and_unaccounted_is_the_rest():
    table = profile_table(DELTA, steps=10, wall_s=1.0, actor_compute_s=0.15)
    assert table["step_ms"] == 100.0
    assert [r["stage"] for r in table["rows"]] == [name for name, _ in ROWS] + ["unaccounted"]
    # Derived rows: each nested stage is subtracted from its parent exactly once.
    assert ms(table, "dense") == pytest.approx(100 * (0.60 - 0.05 - 0.04 - 0.10 - 0.30))
    assert ms(table, "experts' compute") == pytest.approx(15.0)
    assert ms(table, "transport wait") == pytest.approx(10.0)  # gather 25 ms - compute 15 ms
    assert ms(table, "dispatch bookkeeping") == pytest.approx(100 * (0.40 - 0.03 - 0.06 - 0.25 - 0.02))
    assert ms(table, "routing statistics") == pytest.approx(2.0)  # thread 65 - model 60 - sampling 3
    assert ms(table, "event-loop hand-back") == pytest.approx(5.0)
    assert ms(table, "streaming") == pytest.approx(6.0)  # post 10 - detokenise 4
    assert ms(table, "loop other") == pytest.approx(100 * (0.85 - 0.02 - 0.70 - 0.10))
    # idle + busy = 0.95 s of the 1.0 s stretch: 5 ms per step unaccounted.
    assert ms(table, "unaccounted") == pytest.approx(5.0)
    assert sum(r["ms"] for r in table["rows"]) == pytest.approx(100.0, abs=1e-3)
    assert table["accounted_share"] == pytest.approx(0.95)
    assert {r["stage"] for r in table["concurrent"]} == {"Serve message conversion", "gRPC front relay"}


def test_actor_compute_is_capped_at_the_wait_and_unknown_compute_leaves_the_whole_gather_as_wait():
    capped = profile_table(DELTA, steps=10, wall_s=1.0, actor_compute_s=5.0)  # summed over actors: can exceed
    assert ms(capped, "experts' compute") == pytest.approx(25.0)
    assert ms(capped, "transport wait") == 0.0
    unknown = profile_table(DELTA, steps=10, wall_s=1.0)
    assert ms(unknown, "experts' compute") == 0.0 and ms(unknown, "transport wait") == pytest.approx(25.0)


def test_stage_deltas_subtract_snapshots_and_a_new_stage_starts_at_zero():
    assert stage_deltas({"a": 1.0}, {"a": 1.5, "b": 0.25}) == {"a": 0.5, "b": 0.25}
    with pytest.raises(ValueError):
        profile_table(DELTA, steps=0, wall_s=1.0)


def test_eta_serve_is_ours_over_theirs_per_level_and_none_where_a_side_is_missing():
    assert eta_serve({"1": 50.0, "8": 300.0, "32": None}, {"1": 100.0, "8": 400.0, "32": 1000.0}) == {
        "1": 0.5, "8": 0.75, "32": None}
    assert eta_serve({"1": 10.0}, {}) == {"1": None}
    assert eta_serve({"1": 10.0}, {"1": 0.0}) == {"1": None}


def test_stage_clock_sums_and_chains():
    clock = StageClock()
    clock.add("loop.idle", 0.25)
    clock.add("loop.idle", 0.5)
    now = clock.since("loop.busy", 0.0)
    assert clock.snapshot()["loop.idle"] == 0.75 and clock.snapshot()["loop.busy"] == pytest.approx(now)
    snap = clock.snapshot()
    clock.add("loop.idle", 1.0)
    assert snap["loop.idle"] == 0.75  # a snapshot is a copy


def test_status_line_names_the_biggest_stages():
    line = status_profile_line(DELTA, steps=10)
    assert line.startswith("router step profile: 85.00 ms per busy step; ")
    assert "dense 11.00" in line and "transport wait 25.00" in line
    assert status_profile_line({}, steps=0) is None


def test_a_batcher_step_fills_the_loop_forward_and_post_stages():
    """The continuous batcher over a fake decoder: one request of 3 tokens clocks every batcher stage, nested as the
    table assumes (forward inside the executor wait, sampling and text inside post, all inside busy)."""
    from expertmesh.experts.kv_cache import PrefixHit
    from expertmesh.router_service.batching import ContinuousBatcher, GenerationRequest

    class Pool:
        block_size, num_blocks, capacity_tokens = 16, 64, 1024

        class allocator:  # noqa: N801 (stands for an attribute)
            num_free = 64

            @staticmethod
            def can_allocate(n: int) -> bool:
                return True

    class Cache:
        pool = Pool
        length = 0

        def blocks_needed(self, n: int) -> int:
            return 0

        def lookup_prefix(self, token_ids: list[int]) -> PrefixHit:
            return PrefixHit([], [], Pool.block_size)  # nothing cached

        def uncommitted(self) -> bool:
            return False

        def reserve(self, n: int) -> None:
            pass

        def free(self) -> None:
            pass

    class Model:
        kv_pool = Pool
        device = torch.device("cpu")

        class cfg:  # noqa: N801
            num_experts = 2

        class last_trace:  # noqa: N801
            routings: dict = {}

        def new_cache(self):
            return Cache()

        def forward(self, inputs, caches, logits):
            for cache, x in zip(caches, inputs):
                cache.length += int(x.numel())
            return [torch.arange(5.0).expand(int(x.numel()), 5) for x in inputs]  # token 4 wins

    batcher = ContinuousBatcher(Model(), decode=lambda ids: "x" * len(ids))

    async def run() -> list:
        return [e async for e in batcher.stream(GenerationRequest(prompt_ids=[1, 2], max_tokens=3))]

    events = asyncio.run(run())
    assert [e.token_ids for e in events[:-1]] == [[4], [4], [4]]
    s = batcher.profile.snapshot()
    assert set(s) <= set(STAGES)
    for stage in ("loop.busy", "loop.schedule", "loop.executor", "loop.post", "forward.thread", "forward.model",
                  "forward.sampling", "post.detokenise"):
        assert s[stage] > 0, stage
    assert s["forward.model"] + s["forward.sampling"] <= s["forward.thread"] <= s["loop.executor"] <= s["loop.busy"]
    assert s["post.detokenise"] <= s["loop.post"]


def test_a_dispatched_layer_fills_the_dispatch_stages_nested_in_submit_and_wait():
    from expertmesh.cluster.routing_table import RoutingTable
    from expertmesh.experts.gating import route
    from expertmesh.router_service.dispatch import RemoteExperts
    from tests.fakes import HIDDEN, FakeTransport, expert_weights

    shards = expert_weights(1, 2)
    table = RoutingTable.from_actor_shards({"a": [(0, 0)], "b": [(0, 1)]})
    remote = RemoteExperts(table, FakeTransport(table, shards))
    gen = torch.Generator().manual_seed(0)
    remote.run(0, torch.randn(6, HIDDEN, generator=gen), route(torch.randn(6, 2, generator=gen), 1, True))
    s = remote.profile.snapshot()
    for stage in ("dispatch.submit", "dispatch.wait", "dispatch.plan", "dispatch.send", "dispatch.gather",
                  "dispatch.combine"):
        assert s[stage] > 0, stage
    assert s["dispatch.plan"] + s["dispatch.send"] <= s["dispatch.submit"]
    assert s["dispatch.gather"] + s["dispatch.combine"] <= s["dispatch.wait"]


def test_an_open_stage_counts_up_to_each_snapshot_and_once_when_closed():
    """The batcher's idle wait may span two snapshots: each stretch gets its own part, the total is counted once."""
    import time

    clock = StageClock()
    clock.open("loop.idle", time.perf_counter() - 1.0)  # waiting for a second already
    first = clock.snapshot()["loop.idle"]
    assert first >= 1.0
    second = clock.snapshot()["loop.idle"]
    assert second >= first
    clock.close("loop.idle")
    closed = clock.snapshot()["loop.idle"]
    assert closed >= second and clock.snapshot()["loop.idle"] == closed  # closed: no longer grows
    clock.close("loop.idle")  # closing a stage that is not open adds nothing
    assert clock.snapshot()["loop.idle"] == closed


def test_the_profile_chart_is_a_png_drawn_from_a_saved_result(tmp_path):
    import json

    from expertmesh.ops.bench.serve_chart import chart_from_result

    table = profile_table(DELTA, steps=10, wall_s=1.0, actor_compute_s=0.15)
    result = {"model": "embedded", "max_tokens": 32,
              "runs": {"refs": {"levels": {"1": {"profile": table}, "8": {"profile": table}}}}}
    (tmp_path / "r.json").write_text(json.dumps(result))
    path = chart_from_result(tmp_path / "r.json")
    assert path == tmp_path / "r.png" and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_reference_rate_is_both_runs_tokens_over_their_time():
    from expertmesh.ops.bench.serve_report import combine_rates

    run = {"tokens": 64, "batch": 1, "rounds": 2, "torch_threads": 2}
    got = combine_rates(run | {"wall_s": 1.0, "tokens_per_s": 64.0}, run | {"wall_s": 3.0, "tokens_per_s": 64 / 3})
    assert got["tokens_per_s"] == 32.0 and got["tokens"] == 128 and got["rounds"] == 4
    assert got["before_tokens_per_s"] == 64.0


def test_expertmesh_status_prints_the_profile_line_from_router_stats():
    from expertmesh.ops.commands.status import status_lines
    from expertmesh.protos import admin_pb2

    state = admin_pb2.ClusterState(model="m", router=admin_pb2.RouterStats(steps=10, stage_seconds=DELTA))
    assert any(line.startswith("router step profile: 85.00 ms per busy step") for line in status_lines(state))
    fresh = admin_pb2.ClusterState(model="m", router=admin_pb2.RouterStats())
    assert not any("step profile" in line for line in status_lines(fresh))


def test_the_in_process_engine_reference_counts_every_token_and_frees_its_cache(checkpoints):
    """bench serve's second baseline: expertmesh's decoder with local experts, timed like transformers; every
    sequence gets exactly max_tokens (no early stop) and the KV blocks go back to the pool."""
    from expertmesh.ops.bench.serve_reference import EngineReference

    engine = EngineReference(str(checkpoints["mixtral"]))
    allocator = engine.model.kv_pool.allocator
    free = allocator.num_free
    prompts = [[3, 14, 15, 92], [65, 35, 89, 79]]
    got = engine.rate([prompts, prompts], max_tokens=5)
    assert got["tokens"] == 2 * 2 * 5 and got["batch"] == 2 and got["rounds"] == 2 and got["tokens_per_s"] > 0
    assert allocator.num_free == free
