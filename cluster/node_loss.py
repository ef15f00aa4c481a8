"""Which nodes died and which of our actors were on them, from successive `ray.nodes()` snapshots. Pure; no Ray.

Ray's GCS flips a node's `Alive` to False once its health checks fail (`health_check_period_ms` x
`health_check_failure_threshold` after the raylet stops answering; README: Failover has the settings), and it keeps
dead nodes in the table for a while. Waiting instead for calls or pings to the actors on that node to fail costs the
same detection plus however long each call was going to take (a call in flight to a lost node can hang until
`failover.call_timeout_s`). So both the router (router_service/node_watch.py) and the controller (the node watch in
cluster/controller.py) poll `ray.nodes()` every ~0.5 s and act on what this module decides:

    state = NodeWatchState()
    loss, state = observe(state, ray.nodes(), {("expert-e3-r0", actor_id): node_id, ...})
    loss.dead_nodes  # nodes that died since the last snapshot (Alive False, or gone from the table)
    loss.lost        # actor keys on any dead node, each reported once

Actors are identified by a key the caller chooses (name plus incarnation: a restored actor under the same name is a
new key, so it is reported again only if its new node dies too). A key whose node is unknown (None) is never lost.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class NodeWatchState:
    alive: frozenset[str] = frozenset()  # nodes seen alive in some snapshot
    dead: frozenset[str] = frozenset()  # nodes seen dead (or seen alive, then gone from the table)
    reported: frozenset[Hashable] = frozenset()  # actor keys already reported lost (and still placed)


@dataclass(frozen=True)
class NodeLoss:
    dead_nodes: tuple[str, ...] = ()  # died since the previous snapshot (sorted)
    lost: tuple[Hashable, ...] = ()  # actor keys on a dead node, not reported before (in the order given)

    def __bool__(self) -> bool:
        return bool(self.dead_nodes or self.lost)


def observe(state: NodeWatchState, snapshot: Sequence[Mapping], placements: Mapping[Hashable, str | None]
            ) -> tuple[NodeLoss, NodeWatchState]:
    """snapshot: `ray.nodes()` entries ({"NodeID", "Alive", ...}); placements: actor key -> the node it runs on
    (None: not known yet). -> (what changed, the next state).

    A node counts as dead when the snapshot says Alive False, or when an earlier snapshot had it alive and this one
    lists it no more (Ray drops dead nodes from its table after a while). The first snapshot's dead nodes count too:
    an actor still placed on one is lost, however long ago the node died."""
    listed = {n["NodeID"] for n in snapshot}
    alive = {n["NodeID"] for n in snapshot if n.get("Alive")}
    dead = {n["NodeID"] for n in snapshot if not n.get("Alive")} | (set(state.alive) - listed)
    dead |= set(state.dead)  # a node id never comes back to life in Ray (a restarted node gets a new id)
    new_dead = tuple(sorted(dead - set(state.dead)))
    lost = tuple(key for key, node in placements.items()
                 if node is not None and node in dead and key not in state.reported)
    # Forget reported keys that are no longer placed (a restore replaced them), so the state does not grow.
    reported = frozenset(k for k in (set(state.reported) | set(lost)) if k in placements)
    return NodeLoss(new_dead, lost), NodeWatchState(frozenset(set(state.alive) | alive), frozenset(dead), reported)


def actors_on(nodes: Sequence[str] | set[str], actor_nodes: Mapping[str, str | None]) -> list[str]:
    """The actors (name -> node) that run on one of `nodes`, sorted."""
    nodes = set(nodes)
    return sorted(name for name, node in actor_nodes.items() if node is not None and node in nodes)
