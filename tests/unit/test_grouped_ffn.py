"""Grouped expert compute (experts/grouped_ffn.py): bit-identical to one gated_mlp per expert, and an expert's rows
give the same bits whichever other experts share the call - what lets the reference (all experts in one call) and
the actors (a slice each, a replica's chunk) agree bit for bit."""

from __future__ import annotations

import pytest
import torch

from expertmesh.experts import grouped_ffn
from expertmesh.experts.ffn import GatedMLPWeights, activation, gated_activation, gated_mlp
from expertmesh.experts.gating import route
from expertmesh.experts.grouped_ffn import GroupedExperts
from expertmesh.experts.reference import LocalExperts
from tests.loop_oracles import loop_local_run

SILU = activation("silu")


def _shards(experts: int, hidden: int, inter: int, layers: int = 1, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return {
        (layer, e): GatedMLPWeights.from_parts(torch.randn(inter, hidden, generator=gen) * 0.2,
                                               torch.randn(inter, hidden, generator=gen) * 0.2,
                                               torch.randn(hidden, inter, generator=gen) * 0.2)
        for layer in range(layers) for e in range(experts)
    }


def _per_expert(shards, layer, experts, counts, x):
    return torch.cat([gated_mlp(rows, shards[(layer, e)], SILU) for e, rows in zip(experts, x.split(counts))])


# (experts, hidden, inter, rows per expert): small, and rows x inter above torch's parallel grain (32768)
SIZES = [(8, 16, 24, 3), (64, 32, 48, 5), (8, 64, 704, 60), (16, 128, 352, 120)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("experts,hidden,inter,rows", SIZES)
def test_grouped_equals_one_gated_mlp_per_expert(experts, hidden, inter, rows, dtype):
    shards = {key: GatedMLPWeights(w.gate_up.to(dtype), w.down.to(dtype))
              for key, w in _shards(experts, hidden, inter).items()}
    reference = {k: GatedMLPWeights(w.gate_up.clone(), w.down.clone()) for k, w in shards.items()}
    grouped = GroupedExperts(shards, SILU)
    gen = torch.Generator().manual_seed(1)
    hit = sorted(torch.randperm(experts, generator=gen)[: max(1, experts // 2)].tolist())
    counts = torch.randint(1, 2 * rows, (len(hit),), generator=gen).tolist()
    x = torch.randn(sum(counts), hidden, generator=gen).to(dtype)
    got = grouped.run(0, hit, counts, x)
    assert torch.equal(got, _per_expert(reference, 0, hit, counts, x))
    assert torch.equal(shards[(0, hit[0])].gate_up, reference[(0, hit[0])].gate_up)  # views hold the same weights


@pytest.mark.parametrize("experts,hidden,inter,rows", SIZES)
def test_an_experts_rows_give_the_same_bits_alone_or_with_others(experts, hidden, inter, rows):
    grouped = GroupedExperts(_shards(experts, hidden, inter), SILU)
    alone_host = GroupedExperts(_shards(experts, hidden, inter), SILU)
    gen = torch.Generator().manual_seed(2)
    counts = torch.randint(rows, 2 * rows, (experts,), generator=gen).tolist()
    x = torch.randn(sum(counts), hidden, generator=gen)
    together = grouped.run(0, list(range(experts)), counts, x).split(counts)
    for e, rows_e in zip(range(experts), x.split(counts)):
        assert torch.equal(alone_host.run(0, [e], [counts[e]], rows_e), together[e])
    # a replica's chunk of an expert's rows, next to another expert
    e, half = experts // 2, counts[experts // 2] // 2
    chunk = x.split(counts)[e][half:]
    pair = grouped.run(0, [0, e], [counts[0], chunk.shape[0]], torch.cat([x.split(counts)[0], chunk]))
    assert torch.equal(pair[counts[0]:], together[e][half:])


def test_loop_fallback_gives_the_same_bits(monkeypatch):
    shards = _shards(8, 32, 64)
    grouped = GroupedExperts(shards, SILU)
    x = torch.randn(40, 32, generator=torch.Generator().manual_seed(3))
    experts, counts = [1, 2, 5, 7], [10, 5, 20, 5]
    fast = grouped.run(0, experts, counts, x)
    monkeypatch.setattr(grouped_ffn, "_grouped_mm_ok", {("cpu", torch.float32): False})
    assert torch.equal(grouped.run(0, experts, counts, x), fast)


def test_experts_in_any_order_give_each_row_its_experts_output():
    shards = _shards(8, 16, 24)
    grouped = GroupedExperts(shards, SILU)
    x = torch.randn(12, 16, generator=torch.Generator().manual_seed(4))
    got = grouped.run(0, [5, 1, 3], [4, 6, 2], x)
    assert torch.equal(got, _per_expert(shards, 0, [5, 1, 3], [4, 6, 2], x))


def test_layers_are_stacked_separately_and_empty_calls_work():
    shards = _shards(4, 16, 24, layers=2)
    grouped = GroupedExperts(shards, SILU)
    assert sorted(grouped.layers) == [0, 1] and grouped.layers[1].gate_up.shape == (4, 48, 16)
    x = torch.randn(3, 16)
    assert not torch.equal(grouped.run(0, [2], [3], x), grouped.run(1, [2], [3], x))
    assert grouped.run(0, [], [], torch.zeros(0, 16)).shape == (0, 16)


@pytest.mark.parametrize("experts,k,tokens", [(8, 2, 13), (64, 8, 40), (256, 8, 64)])
def test_local_experts_equal_mains_per_expert_reference(experts, k, tokens):
    shards = _shards(experts, 16, 24, layers=2, seed=experts)
    old_shards = {key: GatedMLPWeights(w.gate_up.clone(), w.down.clone()) for key, w in shards.items()}
    local = LocalExperts(shards, "silu")
    gen = torch.Generator().manual_seed(k)
    hidden = torch.randn(tokens, 16, generator=gen)
    for layer in range(2):
        routing = route(torch.randn(tokens, experts, generator=gen), k, renormalize=True)
        assert torch.equal(local.run(layer, hidden, routing), loop_local_run(old_shards, SILU, layer, hidden, routing))


def test_activation_bits_do_not_depend_on_the_rows_around_them():
    # torch splits a large elementwise op over threads at element offsets, and computes the element tail before a
    # split with scalar code (exp differs from the SIMD one in the last bit): without row blocks, a row's
    # activation would depend on how many rows share the call.
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        inter = 352
        h = torch.randn(400, 2 * inter, generator=torch.Generator().manual_seed(5)) * 4  # [T, 2I]
        alone = torch.cat([gated_activation(h[i:i + 1], SILU) for i in range(h.shape[0])])  # [T, I]
        for n in range(300, 400, 7):
            assert torch.equal(gated_activation(h[:n], SILU), alone[:n]), n
    finally:
        torch.set_num_threads(threads)


def test_a_grouped_kernel_that_refuses_falls_back_to_the_loop(monkeypatch):
    shards = _shards(8, 16, 24)
    grouped = GroupedExperts(shards, SILU)
    x = torch.randn(9, 16, generator=torch.Generator().manual_seed(6))
    want = grouped.run(0, [0, 3], [4, 5], x)

    def refuse(*args, **kwargs):
        raise RuntimeError("grouped gemm: unsupported alignment")

    monkeypatch.setattr(grouped_ffn, "_grouped_mm_ok", {("cpu", torch.float32): True})
    monkeypatch.setattr(torch, "_grouped_mm", refuse)
    assert torch.equal(grouped.run(0, [0, 3], [4, 5], x), want)
    assert grouped_ffn._grouped_mm_ok[("cpu", torch.float32)] is False
