"""The failover section of the configuration tree (router_service/config.py): retries, timeouts, the no-replica
policy and overload shedding. Apart from dispatch.py / shedding.py (which import torch and re-export these names) so
that reading and checking a configuration imports no torch."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

NO_REPLICA_POLICIES = ("wait", "degrade")


@dataclass(frozen=True)
class ShedConfig:
    enabled: bool = False
    replica_tokens_per_step: int = 64  # capacity of one expert replica: token slots per expert round
    threshold: float = 0.95  # utilisation above which a shard starts counting toward shedding
    window_s: float = 5.0  # ... held this long before it sheds
    off_threshold: float = 0.8  # utilisation below which a shedding shard starts counting toward stopping
    off_window_s: float = 5.0  # ... held this long before it stops
    max_share: float = 0.5  # at most this share of a shard's slots per round is moved

    def validate(self) -> ShedConfig:
        if self.replica_tokens_per_step < 1:
            raise ValueError(f"replica_tokens_per_step: must be ≥ 1, got {self.replica_tokens_per_step}")
        if not (self.threshold > 0 and math.isfinite(self.threshold)):
            raise ValueError(f"threshold: must be a positive finite number, got {self.threshold}")
        if not 0 <= self.off_threshold <= self.threshold:
            raise ValueError(f"off_threshold: must be in [0, threshold={self.threshold}], got {self.off_threshold}")
        for name in ("window_s", "off_window_s"):
            if not (getattr(self, name) >= 0 and math.isfinite(getattr(self, name))):
                raise ValueError(f"{name}: must be a finite number ≥ 0, got {getattr(self, name)}")
        if not 0 < self.max_share <= 1:
            raise ValueError(f"max_share: must be in (0, 1], got {self.max_share}")
        return self


@dataclass(frozen=True)
class FailoverConfig:
    no_replica_policy: str = "wait"  # "wait" | "degrade"
    call_timeout_s: float = 30.0  # an expert call slower than this counts as failed and is retried elsewhere
    wait_timeout_s: float = 30.0  # with "wait": how long a step holds tokens for a shard with no live replica
    revive_interval_s: float = 0.5  # how often to look a dead replica up again by name
    # How often the router reads Ray's node table (router_service/node_watch.py): replicas on a node Ray calls dead
    # are dead to the router at once and its calls in flight to them fail and are retried. 0: off.
    node_poll_s: float = 0.5
    # Overload shedding (router_service/shedding.py): an overloaded shard's excess tokens go to the next-best expert.
    shed: ShedConfig = field(default_factory=ShedConfig)

    def validate(self) -> FailoverConfig:
        if self.no_replica_policy not in NO_REPLICA_POLICIES:
            raise ValueError(f"no_replica_policy: must be one of {NO_REPLICA_POLICIES}, got {self.no_replica_policy!r}")
        for name in ("call_timeout_s", "wait_timeout_s", "revive_interval_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be > 0")
        if not (isinstance(self.node_poll_s, (int, float)) and 0 <= self.node_poll_s < math.inf):
            raise ValueError(f"node_poll_s: must be a finite number >= 0 (0: off), got {self.node_poll_s!r}")
        return self
