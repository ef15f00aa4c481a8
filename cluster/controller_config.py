"""The controller's settings (a section of the configuration tree, router_service/config.py). Ray-free."""

from __future__ import annotations

from dataclasses import dataclass

from .controller_placement import CONTROLLER_PLACEMENTS
from .elastic_config import ElasticConfig


@dataclass(frozen=True)
class ControllerConfig:
    enabled: bool = True  # False: no controller (no restores, no Admin kill/drain, no elasticity)
    restore: bool = True  # False: only watch and report (for drills of the wait/degrade policies)
    check_interval_s: float = 0.5
    ping_timeout_s: float = 5.0
    # Probes in a row an actor Ray still lists may leave unanswered (each ping_timeout_s) before it counts as lost and
    # is killed and restored. An expert actor answers its probe after the calls queued before it, so one slow answer
    # from a busy actor on a loaded node is not a death (with 1, one stalled pass restarts every busy expert at
    # once). An actor Ray no longer lists is lost at once; a node's death is seen by the node watch.
    probe_misses: int = 2
    restore_timeout_s: float = 1800.0  # a restored actor loads its weights again (on a new node: fetches them too)
    drain_timeout_s: float = 60.0  # a remap stops replaced replicas when every router switched, or after this
    router_ttl_s: float = 10.0  # a router silent this long (scaled in, died) is not waited for
    # A lost actor the survivors have no room for at its normal share gets a stand-in with a smaller share; under
    # this many CPUs each, the lost actors merge into fewer stand-ins (cluster/lost_restore.py).
    stand_in_min_cpus: float = 0.1
    return_check_s: float = 2.0  # how often to look for room to move displaced actors back (a node joined)
    # Where the controller actor runs (cluster/controller_placement.py): head | no-experts | any; and the CPUs it
    # reserves there (0: none; the drill's head node has 1 CPU).
    placement: str = "head"
    num_cpus: float = 0.0
    # How often the controller reads Ray's node table: actors on a node Ray calls dead are restored at once, not
    # after their probes time out (cluster/node_loss.py). 0: off (probes only).
    node_poll_s: float = 0.5
    # How long a planned placement counts against its node's free room at most (cluster/placement_claims.py): it
    # ends sooner when Ray's free table shows the actor, when it is up, fails or is retired. Long enough for Ray to
    # schedule an actor and report its node's new free room (about a second; several on a loaded machine); a claim
    # Ray never shows (the actor landed elsewhere) makes its node look fuller than it is for this long.
    claim_ttl_s: float = 10.0
    # How long a restore may wait with Ray placing it on no node before the controller kills it and plans it again by
    # the free table (cluster/restore_flow.py). A lost actor restarts on its own node without checking free room (its
    # share comes back there), but when Ray had already handed that share to another plan's actor the restart waits
    # in Ray's queue for good (CI chaos drill: a fraction-killed actor never came back within the 60 s settle, with
    # restore_timeout_s at 30 min). Longer than a worker process takes to start on a loaded node.
    restore_unplaced_s: float = 15.0
    elastic: ElasticConfig | None = None  # rebalancing / autoscaling from load (README: Elasticity); None: off

    def validate(self) -> ControllerConfig:
        for name in ("check_interval_s", "ping_timeout_s", "restore_timeout_s", "drain_timeout_s", "router_ttl_s",
                     "stand_in_min_cpus", "return_check_s", "claim_ttl_s", "restore_unplaced_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")
        # A claim that never expires could keep a node looking full for good; an unplaced restore never re-planned
        # waits for good.
        for name in ("claim_ttl_s", "restore_unplaced_s"):
            if getattr(self, name) == float("inf"):
                raise ValueError(f"{name}: must be finite, got {getattr(self, name)}")
        if isinstance(self.probe_misses, bool) or not isinstance(self.probe_misses, int) or self.probe_misses < 1:
            raise ValueError(f"probe_misses: must be an integer >= 1, got {self.probe_misses!r}")
        if self.placement not in CONTROLLER_PLACEMENTS:
            raise ValueError(f"placement: must be one of {CONTROLLER_PLACEMENTS}, got {self.placement!r}")
        for name in ("num_cpus", "node_poll_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < float("inf")):
                raise ValueError(f"{name}: must be a finite number >= 0, got {value!r}")
        if self.elastic is not None and not self.enabled:
            raise ValueError("enabled: elasticity (elastic) runs in the controller; it cannot be off")
        return self
