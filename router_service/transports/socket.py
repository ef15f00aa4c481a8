"""Expert calls over one plain TCP connection per expert actor: the gRPC transport's messages without gRPC.

Each actor serves its shards on a port it opens when first asked (`ExpertActor.socket_address`,
experts/socket_server.py). The router dials it once, both ends prove they hold the cluster secret, and from then on a
layer's call is one framed ExpertBatch written to the connection and one framed ExpertOutput read back
(`multiprocessing.connection` does the framing and the challenge). Why: an empty gRPC round trip between two Python
processes costs ~0.6-0.8 ms on the 2-core box, a framed TCP one ~0.03 ms, and a decode step makes one round per
MoE layer (README: Transports).

The actor answers a connection's requests in order, so replies are matched to calls by position: a connection
keeps its calls in flight in a FIFO (the decoder's overlap puts two micro-batches' calls on one connection).
A call that times out closes its connection (a late reply would otherwise be read as the next call's); the next
call dials again, as does the first call to a restored replica (actor_connections.py: connections are kept per actor
incarnation).

Errors are mapped as the gRPC transport maps them: a connection that is refused, reset or closed makes the
transport ask Ray whether the actor is alive (a dead one comes back as Ray's RayActorError, so dispatch marks it
dead and the reviver looks for its restore), a forward that failed inside the actor is a plain failed call.
"""

from __future__ import annotations

import socket
import time
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import ray
import torch

from ...experts import wire
from ...experts.arrays import HostTensor
from ...experts.socket_server import secure_connection
from ...experts.transport_secret import transport_secret
from ...protos import expert_transport_pb2 as pb
from .actor_connections import ActorConnections
from .base import ABANDON_POLL_S, ActorNodeLost, LostActors
from .grpc import ExpertUnreachable, liveness_error

CONNECT_TIMEOUT_S = 10.0  # dialling an actor's port (a firewalled one would otherwise hang for minutes)


@dataclass
class _Connection:
    actor_id: Any  # the incarnation this connection belongs to
    address: str
    conn: Connection
    in_flight: deque = field(default_factory=deque)  # _Call, in the order they were sent
    broken: BaseException | None = None  # set once it failed: every call still in flight fails with it


@dataclass
class _Call:
    actor: str
    connection: _Connection | None
    reply: bytes | None = None
    error: BaseException | None = None  # failed before it was sent, or its connection broke


def split_address(address: str) -> tuple[str, int]:
    """"host:port" or "[v6]:port" -> (host, port)."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


class SocketTransport(ActorConnections):
    address_method = "socket_address"
    takes_prefetch = True  # prefetch hints ride in ExpertBatch.prefetch

    def __init__(self, actors: dict[str, ray.actor.ActorHandle], address_timeout_s: float = 60.0,
                 secret: str | None = None, lost: LostActors | None = None):
        """secret: the cluster secret (None: read it from Ray's GCS, where the actors read theirs). lost: actors on
        dead nodes (router_service/node_watch.py): calls to them are given up on while waiting; None: wait for the
        connection to break or the call to time out."""
        super().__init__(actors, address_timeout_s)
        self.lost = lost
        self.secret = (secret if secret is not None else transport_secret()).encode()
        self.reconnects = 0  # actors dialled again (a new incarnation, or after a failure); tests check restores
        self._dialled: set[str] = set()

    def _dial(self, name: str, address: str) -> _Connection:
        self._drop(name)
        if name in self._dialled:
            self.reconnects += 1
        self._dialled.add(name)
        sock = socket.create_connection(split_address(address), timeout=CONNECT_TIMEOUT_S)
        conn = _Connection(self.actors[name]._actor_id, address, secure_connection(sock, self.secret, server=False))
        self.connections[name] = conn
        return conn

    def _drop(self, name: str) -> None:
        old = self.connections.pop(name, None)
        if old is not None:
            self._break(old, ExpertUnreachable(f"{name} at {old.address}: connection closed"))

    @staticmethod
    def _break(conn: _Connection, error: BaseException) -> None:
        """Close conn; the calls still in flight on it fail with `error` (the first one keeps its own)."""
        if conn.broken is None:
            conn.broken = error
            conn.conn.close()
        while conn.in_flight:
            call = conn.in_flight.popleft()
            call.error = call.error or error

    def submit(self, actor: str, layer: int, experts: list[int], counts: list[int], x: HostTensor,
               trace: dict[str, str] | None = None, prefetch: list | None = None) -> _Call:
        try:
            conn = self._connection(actor)  # a dead incarnation fails here with RayActorError
        except Exception as exc:
            return _Call(actor, None, error=self._liveness(actor, "(no address)", exc)
                         if isinstance(exc, OSError) else exc)
        call = _Call(actor, conn)
        try:
            conn.conn.send_bytes(wire.encode_batch(layer, experts, counts, x, trace, prefetch).SerializeToString())
        except OSError as exc:  # reset or refused: the actor's process may be gone
            self._lost(call, exc)
            return call
        conn.in_flight.append(call)
        return call

    def gather_settled(self, handles: list[_Call], timeout: float) -> list[torch.Tensor | BaseException]:
        deadline = time.monotonic() + timeout
        for name in [n for n in self.connections if n not in self.actors]:  # retired by a remap
            self._drop(name)
        results: list[torch.Tensor | BaseException] = []
        for call in handles:
            self._await(call, deadline, timeout)
            if call.error is not None:
                results.append(call.error)
                continue
            try:
                reply = pb.ExpertOutput.FromString(call.reply)
                if reply.error:
                    results.append(RuntimeError(f"expert call to {call.actor} failed: {reply.error}"))
                else:
                    results.append(wire.decode(reply.y))
            except Exception as exc:  # a malformed reply
                results.append(exc)
        return results

    def _await(self, call: _Call, deadline: float, timeout: float) -> None:
        """Read the call's connection until the call has its reply (earlier calls' replies come first) or failed."""
        conn = call.connection
        while call.reply is None and call.error is None:
            try:
                left = deadline - time.monotonic()
                sliced = self.lost is not None and left > ABANDON_POLL_S
                if not conn.conn.poll(max(0.0, min(left, ABANDON_POLL_S) if sliced else left)):
                    if sliced:
                        if self.lost and conn.actor_id.hex() in self.lost:
                            self._forget(call.actor, conn, ActorNodeLost(
                                f"{call.actor}: its node died (Ray's node table), call abandoned"))
                            return
                        continue
                    self._forget(call.actor, conn,
                                 TimeoutError(f"expert call to {call.actor} did not finish within {timeout}s"))
                    return
                data = conn.conn.recv_bytes()
            except (EOFError, OSError) as exc:  # the actor closed the connection or its process is gone
                self._lost(call, exc)
                return
            # `call` is still in in_flight (only a reply or _break takes a call out), so the FIFO is not empty.
            conn.in_flight.popleft().reply = data

    def _forget(self, actor: str, conn: _Connection, error: BaseException) -> None:
        """Give up on conn: its calls in flight fail with `error`; a late reply must not be read as the next call's."""
        self._break(conn, error)
        if self.connections.get(actor) is conn:
            self.connections.pop(actor)

    def _lost(self, call: _Call, exc: BaseException) -> None:
        """The call's connection broke: forget it, and ask Ray whether the actor itself is gone."""
        conn = call.connection
        if self.connections.get(call.actor) is conn:
            self.connections.pop(call.actor)
        error = self._liveness(call.actor, conn.address, exc)
        call.error = error
        self._break(conn, error)

    def _liveness(self, actor: str, address: str, exc: BaseException) -> BaseException:
        handle = self.actors[actor]
        if self.lost and handle._actor_id.hex() in self.lost:  # no need to ask Ray (up to LIVENESS_TIMEOUT_S)
            return ActorNodeLost(f"{actor} at {address}: its node died (Ray's node table): {exc!r}")
        return liveness_error(handle, actor, address, repr(exc))

    def close(self) -> None:
        for name in list(self.connections):
            self._drop(name)
