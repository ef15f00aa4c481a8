"""Fakes shared by the tests: in-process transports, a fake expert forward, weight builders, a fake clock.

Everything here runs in this process without Ray, so unit tests can drive the router's dispatch, failover and remap
logic against exact in-process expert math. Test modules import from here (never from each other).
"""

from __future__ import annotations

import torch

from expertmesh.cluster.routing_table import RoutingTable
from expertmesh.experts.arrays import HostTensor, pack, to_tensor
from expertmesh.experts.ffn import GatedMLPWeights, activation, gated_mlp
from expertmesh.ops.fake_cuda import FakeCudaTensor

# Hidden and intermediate sizes of the weights `expert_weights` builds (small: the math, not the size, is tested).
HIDDEN, INTER = 16, 24


def expert_weights(layers: int, experts: int, seed: int = 0) -> dict[tuple[int, int], GatedMLPWeights]:
    """(layer, expert) -> random gated-MLP weights [INTER, HIDDEN] / [HIDDEN, INTER], the same for the same seed."""
    gen = torch.Generator().manual_seed(seed)
    return {
        (layer, e): GatedMLPWeights.from_parts(
            torch.randn(INTER, HIDDEN, generator=gen) * 0.3,
            torch.randn(INTER, HIDDEN, generator=gen) * 0.3,
            torch.randn(HIDDEN, INTER, generator=gen) * 0.3,
        )
        for layer in range(layers)
        for e in range(experts)
    }


class FakeTransport:
    """Runs each call in process, only on shards the addressed actor hosts; records every call.

    Checks what a real transport would get: host rows [sum(counts), HIDDEN] as a HostTensor (raw bytes + dtype tag),
    distinct experts, one count each.
    """

    def __init__(self, table: RoutingTable, shards: dict[tuple[int, int], GatedMLPWeights], hidden_act: str = "silu"):
        self.table = table
        self.shards = shards
        self.act = activation(hidden_act)
        self.submitted: list[tuple[str, int, list[int], list[int], tuple[int, ...]]] = []
        self.gathers = 0

    def submit(self, actor: str, layer: int, experts: list[int], counts: list[int], x: HostTensor):
        assert isinstance(x, HostTensor) and x.shape == (sum(counts), HIDDEN)
        assert len(experts) == len(counts) == len(set(experts))
        self.submitted.append((actor, layer, list(experts), list(counts), x.shape))
        outs = []
        for expert, rows in zip(experts, to_tensor(x).split(counts)):
            assert (layer, expert) in self.table.actors[actor], f"{actor} does not host {(layer, expert)}"
            outs.append(gated_mlp(rows, self.shards[(layer, expert)], self.act))
        return pack(torch.cat(outs))

    def gather_settled(self, handles, timeout):
        self.gathers += 1
        return [h if isinstance(h, BaseException) else to_tensor(h) for h in handles]


class NamedFakeTransport(FakeTransport):
    """FakeTransport with the name -> handle map every real transport keeps (a table switch edits it)."""

    def __init__(self, table: RoutingTable, shards: dict[tuple[int, int], GatedMLPWeights]):
        super().__init__(table, shards)
        self.actors = {name: object() for name in table.actors}


class FailingInProcessTransport:
    """Runs each call here (outputs computed at submit, any hidden size); `fail` names actors whose next call fails.

    `log` records ("submit", layer, tokens) and ("gather", None, 0) in order, to check when rounds went out.
    """

    def __init__(self, shards: dict[tuple[int, int], GatedMLPWeights], act, actors: dict[str, object]):
        self.shards, self.act, self.actors = shards, act, actors
        self.fail: set[str] = set()
        self.log: list[tuple[str, int | None, int]] = []

    def submit(self, actor, layer, experts, counts, x):
        self.log.append(("submit", layer, sum(counts)))
        if actor in self.fail:
            self.fail.discard(actor)
            return RuntimeError(f"{actor} failed")
        rows = to_tensor(x).split(counts)
        return torch.cat([gated_mlp(r, self.shards[(layer, e)], self.act) for e, r in zip(experts, rows)])

    def gather_settled(self, handles, timeout):
        self.log.append(("gather", None, 0))
        return list(handles)


class CountingObserver:
    """A dispatch observer that sums the (token, slot) pairs served per layer and ignores retries."""

    def __init__(self):
        self.tokens: dict[int, int] = {}

    def on_layer(self, layer, served, calls, seconds):
        self.tokens[layer] = self.tokens.get(layer, 0) + sum(sum(c.counts) for c in calls)

    def on_retry(self, actor):
        pass


class FakeExperts:
    """An expert actor's forward without the actor: returns x * 2 + layer, records every call, and raises KeyError
    for a negative layer (a shard the actor does not host)."""

    def __init__(self):
        self.seen = []

    def forward(self, layer, experts, counts, x, trace=None):
        self.seen.append((layer, experts, counts, x.shape, trace))
        if layer < 0:
            raise KeyError((layer, experts[0]))
        return pack(to_tensor(x) * 2 + layer)


class FakeClock:
    """A clock that stands still until a test moves `now` (seconds)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FakeMetric:
    """Stands for a Ray metric (counter, gauge, histogram): what was recorded per tag set, and how many calls."""

    def __init__(self, spec):
        self.spec = spec
        self.values: dict[tuple, float] = {}
        self.calls = 0

    def _key(self, tags):
        assert set(tags or {}) == set(self.spec.tags), (self.spec.name, tags)
        return tuple(sorted((tags or {}).items()))

    def inc(self, value, tags=None):
        self.calls += 1
        key = self._key(tags)
        self.values[key] = self.values.get(key, 0.0) + value

    def set(self, value, tags=None):
        self.values[self._key(tags)] = value

    def observe(self, value, tags=None):
        self.inc(1, tags)


def host(t: torch.Tensor) -> torch.Tensor:
    """The CPU data under a fake-CUDA tensor, read without counting."""
    assert isinstance(t, FakeCudaTensor), type(t)
    return t._elem
