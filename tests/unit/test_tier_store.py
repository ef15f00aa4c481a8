"""The expert memory tiers (experts/tier_store.py) in process: shards loaded from the memory-mapped checkpoint are the
bits the all-resident actor loads, calls computed over the tiers equal the all-resident grouped compute bit for bit,
the budget holds, pinned shards stay through a call, prefetch turns misses into hits, and the counters count."""

from __future__ import annotations

import threading

import pytest
import torch

from expertmesh.experts.checkpoint import CheckpointReader
from expertmesh.experts.ffn import activation, gated_mlp
from expertmesh.experts.grouped_ffn import GroupedExperts
from expertmesh.experts.tier_store import DiskTier, TierStore
from expertmesh.experts.weights import load_expert_shards
from tests.tiny_checkpoints import write_direct_mixtral

LAYERS, EXPERTS = 3, 4
SILU = activation("silu")


@pytest.fixture(scope="module")
def reader(tmp_path_factory):
    return CheckpointReader(write_direct_mixtral(tmp_path_factory.mktemp("tiers"), layers=LAYERS, experts=EXPERTS))


def _all_shards():
    return [(layer, e) for layer in range(LAYERS) for e in range(EXPERTS)]


def _shard_bytes(reader) -> int:
    return load_expert_shards(reader, [(0, 0)])[(0, 0)].nbytes()


def _store(reader, shards_resident: int, shards=None, **kw) -> TierStore:
    shards = shards or _all_shards()
    return TierStore(shards, DiskTier(reader, torch.float32, torch.device("cpu")),
                     shards_resident * _shard_bytes(reader), **kw)


class CountingTier:
    """A lower tier that hands out the same weights as the checkpoint and records each fetch; `gate` (an Event)
    holds fetches until set, to catch a load in flight."""

    name = "fake"

    def __init__(self, reader):
        self.weights = load_expert_shards(reader, _all_shards())
        self.fetched: list = []
        self.gate: threading.Event | None = None
        self.fail: set = set()

    def fetch(self, shard):
        if self.gate is not None:
            self.gate.wait(10)
        if shard in self.fail:
            raise OSError(f"cannot read {shard}")
        self.fetched.append(shard)
        w = self.weights[shard]
        return type(w)(w.gate_up.clone(), w.down.clone())


def test_disk_tier_loads_the_same_bits_as_the_resident_load(reader):
    resident = load_expert_shards(reader, _all_shards())
    tier = DiskTier(reader, torch.float32, torch.device("cpu"))
    for shard in [(0, 1), (2, 3)]:
        got = tier.fetch(shard)
        assert torch.equal(got.gate_up, resident[shard].gate_up) and torch.equal(got.down, resident[shard].down)


def test_offloaded_calls_equal_the_all_resident_grouped_compute(reader):
    """25 % residency, calls over every layer in turn: each output is bit-identical to GroupedExperts over all."""
    grouped = GroupedExperts(load_expert_shards(reader, _all_shards()), SILU)
    store = _store(reader, shards_resident=3)
    gen = torch.Generator().manual_seed(0)
    for step in range(3):
        for layer in range(LAYERS):
            experts = sorted(torch.randperm(EXPERTS, generator=gen)[:2].tolist())
            counts = torch.randint(1, 5, (2,), generator=gen).tolist()
            x = torch.randn(sum(counts), 32, generator=gen)  # [N, H]
            weights = store.acquire(layer, experts)
            got = torch.cat([gated_mlp(rows, w, SILU) for w, rows in zip(weights, x.split(counts))])
            store.release(layer, experts)
            assert torch.equal(got, grouped.run(layer, experts, counts, x)), (step, layer)
            assert store.resident_bytes() <= store.budget_bytes
    stats = store.stats()
    assert stats["misses"] > 0 and stats["bytes_moved"] == stats["misses"] * _shard_bytes(reader)
    assert stats["hits"] + stats["misses"] == 3 * LAYERS * 2 and stats["stall_s"] > 0 and stats["over_budget"] == 0


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_offloaded_quantised_calls_equal_the_all_resident_quantised_compute(reader, quant):
    """Offload and quantisation together: the disk tier quantises each shard as it reads it, exactly as the
    all-resident load does, so calls over the tiers equal the all-resident quantised compute bit for bit, and a
    resident shard costs its packed bytes."""
    resident = load_expert_shards(reader, _all_shards(), quant=quant)
    grouped = GroupedExperts(dict(resident), SILU)
    shard_bytes = resident[(0, 0)].nbytes()
    assert shard_bytes < _shard_bytes(reader) / 2
    store = TierStore(_all_shards(), DiskTier(reader, torch.float32, torch.device("cpu"), quant), 3 * shard_bytes)
    gen = torch.Generator().manual_seed(1)
    for layer in [0, 1, 2, 0, 2]:
        experts, counts = [1, 3], torch.randint(1, 5, (2,), generator=gen).tolist()
        x = torch.randn(sum(counts), 32, generator=gen)  # [N, H]
        weights = store.acquire(layer, experts)
        got = torch.cat([gated_mlp(rows, w, SILU) for w, rows in zip(weights, x.split(counts))])  # [N, H]
        store.release(layer, experts)
        assert torch.equal(got, grouped.run(layer, experts, counts, x)), layer
    assert store.stats()["misses"] > 0 and store.resident_bytes() <= 3 * shard_bytes


def test_preload_fills_the_budget_and_hits_count(reader):
    store = _store(reader, shards_resident=2)
    store.preload()
    assert store.resident() == [(0, 0), (0, 1)] and store.stats()["bytes_moved"] == 0
    store.acquire(0, [0, 1])
    store.release(0, [0, 1])
    stats = store.stats()
    assert (stats["hits"], stats["misses"], stats["stall_s"]) == (2, 0, 0.0)


def test_lru_eviction_and_a_call_needing_more_than_the_budget(reader):
    store = _store(reader, shards_resident=2, eviction="lru")
    for layer in range(3):
        store.acquire(layer, [0])
        store.release(layer, [0])
    assert store.resident() == [(1, 0), (2, 0)]  # (0, 0), least recently used, left
    store.acquire(0, [0, 1, 2])  # three shards pinned at once in a budget of two: loaded over it
    assert store.stats()["over_budget"] >= 1 and store.resident_bytes() > store.budget_bytes
    store.release(0, [0, 1, 2])
    assert store.resident_bytes() <= store.budget_bytes  # given back once the call is done


def test_prefetch_loads_in_background_and_makes_the_next_call_a_hit(reader):
    store = _store(reader, shards_resident=2)
    store.acquire(0, [0])
    store.prefetch([(1, 2), (2, 3), (0, 0)])  # (0, 0) is resident: not loaded again
    store.release(0, [0])
    deadline = 100
    while store.stats()["prefetch_issued"] < 2 and deadline:
        threading.Event().wait(0.05)
        deadline -= 1
    # two prefetched into a budget of two: the second evicted (0, 0) (the first is newer, and pinned while loading)
    before = store.stats()
    store.acquire(2, [3])
    store.release(2, [3])
    after = store.stats()
    assert after["hits"] - before["hits"] == 1 and after["misses"] == before["misses"]
    assert after["prefetch_useful"] == 1 and after["prefetch_issued"] == 2
    store.close()


def test_layer_cycle_keeps_the_shard_whose_layer_comes_next(reader):
    store = _store(reader, shards_resident=2)  # the default order: layer-cycle
    for layer in (0, 1, 2):  # decode: layer 2's load must evict (0, 0) or (1, 0)
        store.acquire(layer, [0])
        store.release(layer, [0])
    assert store.resident() == [(0, 0), (2, 0)]  # (1, 0) runs last of the two after layer 2; LRU keeps (1, 0)
    before = store.stats()["hits"]
    store.acquire(0, [0])  # the next step's first layer: a hit, where LRU on this cycle misses every time
    store.release(0, [0])
    assert store.stats()["hits"] == before + 1


def test_a_hint_waits_for_the_release_when_the_order_would_evict_the_shard_in_use(reader):
    """layer-cycle at 2 of 3 slots: while layer 1 computes, the hint for layer 2 would have to evict (0, 0), the
    shard that hits next step; it waits for layer 1's release and evicts (1, 0), needed last."""
    store = _store(reader, shards_resident=2, shards=[(0, 0), (1, 0), (2, 0)])
    store.preload()  # (0, 0), (1, 0)
    assert store.resident() == [(0, 0), (1, 0)]
    store.acquire(1, [0])
    store.prefetch([(2, 0)])
    assert _poll(store, "prefetch_deferred", 1)
    assert store.resident() == [(0, 0), (1, 0)]  # nothing evicted while layer 1 computes
    store.release(1, [0])
    assert _poll(store, "prefetch_issued", 1)
    for _ in range(250):
        if store.resident() == [(0, 0), (2, 0)]:
            break
        threading.Event().wait(0.02)
    assert store.resident() == [(0, 0), (2, 0)]
    before = store.stats()["hits"]
    for layer in (2, 0):
        store.acquire(layer, [0])
        store.release(layer, [0])
    assert store.stats()["hits"] == before + 2
    store.close()


def _poll(store, key, value, seconds=5.0):
    for _ in range(int(seconds / 0.02)):
        if store.stats()[key] >= value:
            return True
        threading.Event().wait(0.02)
    return False


def test_pinned_shards_survive_prefetch_which_waits_for_the_call_to_end(reader):
    tier = CountingTier(reader)
    store = TierStore(_all_shards(), tier, 2 * _shard_bytes(reader))
    store.acquire(0, [0, 1])  # both pinned: the budget is full of pinned shards
    store.prefetch([(1, 0)])
    assert not _poll(store, "prefetch_issued", 1, seconds=0.3)  # no room: it waits, evicting nothing
    assert (1, 0) not in tier.fetched and store.resident() == [(0, 0), (0, 1)]
    store.release(0, [0, 1])
    assert _poll(store, "prefetch_issued", 1)  # the call ended: the hint goes ahead
    assert _poll(store, "resident_shards", 2) and (1, 0) in tier.fetched
    assert store.stats()["prefetch_dropped"] == 0
    store.close()


def test_a_hint_is_dropped_when_the_budget_holds_no_second_shard(reader):
    store = TierStore(_all_shards(), CountingTier(reader), _shard_bytes(reader) // 2)
    store.acquire(1, [0])  # a call still gets its shard, over the budget, and gives it back after
    store.release(1, [0])
    assert store.resident() == [] and store.resident_bytes() == 0
    store.prefetch([(1, 1)])
    assert _poll(store, "prefetch_dropped", 1) and store.stats()["prefetch_issued"] == 0
    store.close()


def test_a_call_waits_for_a_prefetch_in_flight_instead_of_loading_twice(reader):
    tier = CountingTier(reader)
    tier.gate = threading.Event()
    store = TierStore(_all_shards(), tier, 2 * _shard_bytes(reader))
    store.prefetch([(1, 1)])
    deadline = 100
    while store.stats()["prefetch_issued"] < 1 and deadline:
        threading.Event().wait(0.02)
        deadline -= 1
    threading.Timer(0.1, tier.gate.set).start()
    weights = store.acquire(1, [1])
    store.release(1, [1])
    assert tier.fetched == [(1, 1)] and torch.equal(weights[0].down, tier.weights[(1, 1)].down)
    stats = store.stats()
    assert stats["misses"] == 1 and stats["prefetch_useful"] == 1 and stats["stall_s"] > 0
    store.close()


def test_a_failed_load_fails_the_call_and_leaves_nothing_pinned(reader):
    tier = CountingTier(reader)
    tier.fail = {(2, 2)}
    store = TierStore(_all_shards(), tier, 2 * _shard_bytes(reader))
    with pytest.raises(OSError, match="cannot read"):
        store.acquire(2, [1, 2])
    assert not store._pins and not store._loading
    tier.fail = set()
    assert len(store.acquire(2, [2])) == 1  # the next call loads it
    store.release(2, [2])


def test_status_shows_an_actors_tiers(reader):
    import json

    from expertmesh.ops.commands.status import tier_note
    from expertmesh.protos import admin_pb2

    store = _store(reader, shards_resident=2)
    store.preload()
    for layer in range(LAYERS):
        store.acquire(layer, [0])
        store.release(layer, [0])
    note = tier_note(admin_pb2.ReplicaState(tiers_json=json.dumps(store.stats())))
    assert "(2/12 shards, disk), 33% hits" in note and "prefetch 0/0 useful" in note
    assert tier_note(admin_pb2.ReplicaState()) == ""  # all resident: nothing to show


def test_one_row_calls_offloaded_equal_resident_on_weights_stored_off_the_boundary(tmp_path):
    """The `bench offload` model shrunk to hidden 64: its down weights sit 24 bytes past a 64-byte boundary in the
    file. A one-row product (a decode step's token) is a gemv whose sums depend on where the weight starts, so
    before loads were aligned the offloaded shards (read in place) and the resident stacks (fresh allocations)
    differed in the last bit. Every loaded weight now starts on the boundary, and the two agree bit for bit."""
    from expertmesh.experts.reproducible import CPU_ALIGN
    from expertmesh.ops.bench.checkpoints import MIXTRAL, write_bench_checkpoint

    small = dict(MIXTRAL, hidden=64, inter=128, heads=4, kv_heads=2, vocab=256)
    reader = CheckpointReader(write_bench_checkpoint(tmp_path / "model", small, layers=2))
    shards = [(layer, e) for layer in reader.config.moe_layers for e in range(reader.config.num_experts)]
    tier = DiskTier(reader, torch.float32, torch.device("cpu"))
    for weights in [*load_expert_shards(reader, shards).values(), *(tier.fetch(s) for s in shards[:4])]:
        assert weights.gate_up.data_ptr() % CPU_ALIGN == 0 and weights.down.data_ptr() % CPU_ALIGN == 0
    grouped = GroupedExperts(load_expert_shards(reader, shards), SILU)
    gen = torch.Generator().manual_seed(0)
    for layer, expert in shards:
        x = torch.randn(1, 64, generator=gen)  # [1, H]
        assert torch.equal(gated_mlp(x, tier.fetch((layer, expert)), SILU), grouped.run(layer, [expert], [1], x))


@pytest.mark.parametrize("quant", ["none", "int8"])
def test_host_tier_copies_to_cuda_on_its_own_stream_and_waits_only_for_that_copy(reader, fc, quant):
    """On the fake-CUDA double: the pinned host copy goes up with non_blocking on a stream of the tier's own (not the
    default stream the expert kernels run on), the loading thread waits on that copy's event (one sync, no device-wide
    one), every new tensor is recorded on the compute stream, and the bits are the host's."""
    from expertmesh.experts.tier_store import HostTier, _tensors, pinned_copy

    host = {s: pinned_copy(w) for s, w in load_expert_shards(reader, [(0, 1), (1, 2)], quant=quant).items()}
    tier = HostTier(host, torch.device("cuda:0"))
    seen: list = []
    real_to = type(host[(0, 1)]).to

    def spy(self, device, *args, **kwargs):
        seen.append((torch.cuda.current_stream(), kwargs.get("non_blocking")))
        return real_to(self, device, *args, **kwargs)

    from expertmesh.ops.fake_cuda.tensor import FakeCudaTensor

    recorded: list = []
    real_record = FakeCudaTensor.record_stream
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(type(host[(0, 1)]), "to", spy)
        mp.setattr(FakeCudaTensor, "record_stream", lambda t, s: recorded.append(s) or real_record(t, s))
        with fc.counting() as counts:
            out = tier.fetch((0, 1))
    (stream, non_blocking), = seen
    assert stream is tier._copy_stream and stream is not torch.cuda.default_stream() and non_blocking is True
    tensors = _tensors(out)
    assert tensors and all(t.device.type == "cuda" for t in tensors)
    assert recorded == [torch.cuda.default_stream()] * len(tensors)
    for got, want in zip(tensors, _tensors(host[(0, 1)])):
        assert torch.equal(got.cpu(), want)
    assert counts.syncs == 1 and counts.host_reads == 0, counts  # the copy event's synchronize, nothing else
    assert tier.fetch((1, 2)) is not None and tier._copy_stream is stream  # one stream for every load
