"""What the grpc and socket transports share: one connection per expert actor incarnation to a server inside the
actor, dialled lazily at the address the actor hands out when first asked.

Handles are looked up in `actors`, the dict NameReviver swaps restored replicas into; a handle whose actor id
changed means a new incarnation (a restore has a new port), so the transport asks it for its address and dials
again.
"""

from __future__ import annotations

from typing import Any

import ray


class ActorConnections:
    # The ExpertActor method that starts the actor's server on first call and returns its "host:port".
    address_method: str = ""

    def __init__(self, actors: dict[str, ray.actor.ActorHandle], address_timeout_s: float = 60.0):
        self.actors = actors
        self.address_timeout_s = address_timeout_s
        self.connections: dict[str, Any] = {}  # actor name -> the transport's connection (has `actor_id`)

    def connect_all(self) -> None:
        """Open every actor's server and connection now, so the first step does not pay for it."""
        names = [n for n in self.actors if self._stale(n)]
        refs = [getattr(self.actors[n], self.address_method).remote() for n in names]
        for name, address in zip(names, ray.get(refs, timeout=self.address_timeout_s)):
            self._dial(name, address)

    def _stale(self, name: str) -> bool:
        conn = self.connections.get(name)
        return conn is None or conn.actor_id != self.actors[name]._actor_id

    def _connection(self, name: str) -> Any:
        if self._stale(name):
            address = ray.get(getattr(self.actors[name], self.address_method).remote(),
                              timeout=self.address_timeout_s)
            return self._dial(name, address)
        return self.connections[name]

    def _dial(self, name: str, address: str) -> Any:
        """Connect to `name`'s server at `address` (replacing any older connection) and keep it."""
        raise NotImplementedError
