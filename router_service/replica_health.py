"""Which replicas of a shard may take a call: the router's view of its expert actors' health. Pure (no Ray at import;
it tells a dead actor from a failed call with Ray's exception type, looked up then), so the failover decisions are
unit-tested without a cluster.

  dead           actors known to be gone (killed, node lost) until the reviver finds them again or a table retires them
  breakers       per-actor circuit breakers (cluster/breaker.py): a slow or erroring actor is ejected for a while
  failed_in_step actors a call failed on since the current step began (a held step may switch to a table retiring them)

The routing table is passed in, never kept: live remap (table_switch.py) decides which table a step uses.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection

import torch

from ..cluster.breaker import BreakerBoard
from ..cluster.routing_table import RoutingTable, Shard
from ..experts.gating import Routing
from .dispatch_plan import all_served
from .failover_config import FailoverConfig


class ReplicaHealth:
    """Dead actors, breakers and the reviver's cadence for one router. `reviver` (optional) looks dead replicas up
    again, e.g. by actor name after the controller restored them; it returns the names that are back."""

    def __init__(self, failover: FailoverConfig, breakers: BreakerBoard | None = None,
                 reviver: Callable[[set[str]], set[str]] | None = None, clock: Callable[[], float] = time.monotonic,
                 is_death: Callable[[BaseException], bool] | None = None):
        self.failover = failover
        self.breakers = breakers or BreakerBoard()
        self.reviver = reviver
        self.clock = clock
        self.is_death = is_death or is_actor_death  # tests pass their own: the default imports Ray
        self.dead: set[str] = set()
        self.failed_in_step: set[str] = set()
        self._last_revive = 0.0
        # live replicas per shard, [E] per layer, for one (table, dead set)
        self._replica_counts: tuple[tuple, dict[int, torch.Tensor]] | None = None

    # ---- asking ------------------------------------------------------------------------------------------------

    def live_replicas(self, table: RoutingTable, shard: Shard) -> list[str]:
        """Replicas that may take this step's calls. Asking may grant a half-open replica its one probe, so call
        it only for replicas that will then get a call (plan_calls, replanning a failed call)."""
        return self.breakers.usable_replicas(table.replicas.get(shard, ()), self.clock(), frozenset(self.dead))

    def has_live_replica(self, table: RoutingTable, shard: Shard) -> bool:
        """Whether the shard can be served at all, without touching the breakers (usable_replicas is never empty
        while one replica is alive)."""
        return any(actor not in self.dead for actor in table.replicas.get(shard, ()))

    def replicas_of(self, table: RoutingTable) -> Callable[[Shard], list[str]] | None:
        """How plan_calls picks a shard's replicas: None (the table's, planned without a Python step per expert)
        while no replica is dead and every breaker is closed - then live_replicas would return exactly those and
        change no breaker - else live_replicas on `table`."""
        if not self.dead and self.breakers.all_closed():
            return None
        return lambda shard: self.live_replicas(table, shard)

    def missing_experts(self, table: RoutingTable, layer: int, routing: Routing) -> list[int]:
        """Experts `routing` sends slots to at `layer` that have no live replica (ascending)."""
        if not self.dead and all_served(table, layer, routing.experts):
            return []  # nothing is dead and the table serves every routed expert (no Python step per expert)
        hit = torch.unique(routing.experts[routing.experts >= 0]).tolist()
        return [e for e in hit if not self.has_live_replica(table, (layer, e))]

    def live_replica_counts(self, table: RoutingTable, layer: int, num_experts: int) -> torch.Tensor:
        """[E] int64 replicas of each of the layer's shards that are not dead (cached per table and dead set)."""
        key = (id(table), table.epoch, frozenset(self.dead))
        if self._replica_counts is None or self._replica_counts[0] != key:
            self._replica_counts = (key, {})
        per_layer = self._replica_counts[1]
        if layer not in per_layer:
            replicas = table.replicas
            per_layer[layer] = torch.tensor([  # host: policy bookkeeping
                sum(1 for a in replicas.get((layer, e), ()) if a not in self.dead) for e in range(num_experts)
            ], dtype=torch.int64)
        return per_layer[layer]

    def live_mask(self, table: RoutingTable, layer: int, num_experts: int) -> torch.Tensor:
        """[E] bool: the layer's experts with a live replica (has_live_replica for each, from the cached counts)."""
        return self.live_replica_counts(table, layer, num_experts) > 0

    def gone(self) -> set[str]:
        """Actors that will answer no call of this step: dead, or a call to them failed (a call to an actor on a lost
        node can hang until its timeout instead of failing as a death, hence "failed" counts as gone too)."""
        return self.dead | self.failed_in_step

    # ---- telling -----------------------------------------------------------------------------------------------

    def record_ok(self, actor: str) -> None:
        self.breakers.record(actor, self.clock(), ok=True)

    def mark_failed(self, actor: str, error: BaseException) -> None:
        self.breakers.record(actor, self.clock(), ok=False)
        self.failed_in_step.add(actor)
        if self.is_death(error):
            self.dead.add(actor)

    def nodes_lost(self, actors: Collection[str]) -> None:
        """The node watch found these actors on a dead node: dead from now on (the reviver finds their restores).
        Called on the dispatching thread, between calls (the watch hands them over: router_service/node_watch.py)."""
        self.dead.update(actors)

    def forget(self, actor: str) -> None:
        """The actor is back (restored) or retired by the table: not dead, and a closed breaker if it is called."""
        self.dead.discard(actor)
        self.breakers.states.pop(actor, None)

    def new_step(self) -> None:
        self.failed_in_step = set()

    def revive(self, force: bool = False) -> None:
        """Ask the reviver which dead actors are back, at most every failover.revive_interval_s unless forced."""
        now = self.clock()
        if not self.dead or self.reviver is None:
            return
        if not force and now - self._last_revive < self.failover.revive_interval_s:
            return
        self._last_revive = now
        for actor in self.reviver(set(self.dead)):
            self.forget(actor)  # a restored replica starts with a closed breaker


def is_actor_death(error: BaseException) -> bool:
    """An actor that is gone (killed, node lost), as opposed to a slow or erroring one."""
    import ray

    from .transports.base import ActorNodeLost

    return isinstance(error, (ray.exceptions.RayActorError, ActorNodeLost))
