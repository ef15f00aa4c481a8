"""Expert calls over gRPC: one channel per expert actor, one unary Forward per actor per layer step, all in flight.

Each actor serves its shards on a gRPC port it opens when first asked (`ExpertActor.grpc_address`); every call
carries the cluster secret (experts/transport_secret.py), without which the actor answers UNAUTHENTICATED. Channels
are kept per actor incarnation (actor_connections.py: a restored replica is dialled again at its new address).

Errors are mapped so dispatch's failover treats them like Ray's: when a channel is UNAVAILABLE (connection refused
or reset) the transport asks Ray whether the actor is alive, and a dead actor comes back as Ray's own
RayActorError (dispatch marks it dead and the reviver looks for its restore); anything else is a plain failed call
(retried on another replica, counted by the breaker).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import grpc
import ray
import torch

from ...experts import wire
from ...experts.arrays import HostTensor
from ...experts.grpc_server import MESSAGE_OPTIONS, call_metadata
from ...experts.transport_secret import transport_secret
from ...protos import expert_transport_pb2_grpc as pb_grpc
from .actor_connections import ActorConnections
from .base import ABANDON_POLL_S, ActorNodeLost, LostActors

LIVENESS_TIMEOUT_S = 5.0  # how long a liveness check through Ray may take before the actor counts as unreachable


class ExpertUnreachable(ConnectionError):
    """The actor's transport server did not answer, but Ray does not (yet) report the actor dead."""


def liveness_error(handle: ray.actor.ActorHandle, actor: str, address: str, detail: str) -> BaseException:
    """A call to `actor`'s server failed to connect: Ray's RayActorError when Ray says the actor is dead (dispatch
    marks it dead), else ExpertUnreachable (a failed call, retried elsewhere and counted by the breaker)."""
    try:
        ray.get(handle.ready.remote(), timeout=LIVENESS_TIMEOUT_S)
    except ray.exceptions.RayActorError as dead:
        return dead
    except Exception as other:
        return ExpertUnreachable(f"{actor} at {address}: {detail} ({other!r})")
    return ExpertUnreachable(f"{actor} at {address}: {detail} (actor alive)")


@dataclass
class _Connection:
    actor_id: Any  # the incarnation this channel belongs to
    address: str
    channel: grpc.Channel
    stub: pb_grpc.ExpertTransportStub


@dataclass
class _Call:
    actor: str
    connection: _Connection | None
    future: Any = None  # grpc.Future
    error: BaseException | None = None  # failed before it was sent (e.g. the actor is gone)


class GrpcTransport(ActorConnections):
    address_method = "grpc_address"
    takes_prefetch = True  # prefetch hints ride in ExpertBatch.prefetch

    def __init__(self, actors: dict[str, ray.actor.ActorHandle], address_timeout_s: float = 60.0,
                 secret: str | None = None, lost: LostActors | None = None):
        """secret: the cluster secret (None: read it from Ray's GCS, where the actors read theirs). lost: actors on
        dead nodes (router_service/node_watch.py): calls to them are given up on while waiting."""
        super().__init__(actors, address_timeout_s)
        self.lost = lost
        self.metadata = call_metadata(secret if secret is not None else transport_secret())
        self.reconnects = 0  # channels dialled again for a new incarnation (tests check restores)

    def _dial(self, name: str, address: str) -> _Connection:
        old = self.connections.pop(name, None)
        if old is not None:
            old.channel.close()
            self.reconnects += 1
        channel = grpc.insecure_channel(address, options=MESSAGE_OPTIONS)
        conn = _Connection(self.actors[name]._actor_id, address, channel, pb_grpc.ExpertTransportStub(channel))
        self.connections[name] = conn
        return conn

    def submit(self, actor: str, layer: int, experts: list[int], counts: list[int], x: HostTensor,
               trace: dict[str, str] | None = None, prefetch: list | None = None) -> _Call:
        try:
            conn = self._connection(actor)
        except Exception as exc:  # a dead incarnation fails here with RayActorError
            return _Call(actor, None, error=exc)
        request = wire.encode_batch(layer, experts, counts, x, trace, prefetch)
        return _Call(actor, conn, future=conn.stub.Forward.future(request, metadata=self.metadata))

    def gather_settled(self, handles: list[_Call], timeout: float) -> list[torch.Tensor | BaseException]:
        deadline = time.monotonic() + timeout
        for name in [n for n in self.connections if n not in self.actors]:  # retired by a remap
            self.connections.pop(name).channel.close()
        results: list[torch.Tensor | BaseException] = []
        for call in handles:
            if call.error is not None:
                results.append(call.error)
                continue
            try:
                reply = self._result(call, deadline)
                results.append(wire.decode(reply.y))
            except ActorNodeLost as exc:
                if self.connections.get(call.actor) is call.connection:
                    self.connections.pop(call.actor).channel.close()
                results.append(exc)
            except grpc.FutureTimeoutError:
                call.future.cancel()
                results.append(TimeoutError(f"expert call to {call.actor} did not finish within {timeout}s"))
            except grpc.RpcError as exc:
                results.append(self._failure(call, exc))
            except Exception as exc:  # a malformed reply
                results.append(exc)
        return results

    def _result(self, call: _Call, deadline: float) -> Any:
        """The call's reply by `deadline` (grpc.FutureTimeoutError after it); with a node watch, waited for in
        slices and given up on (ActorNodeLost, the call cancelled) once its actor is on a dead node."""
        while True:
            left = deadline - time.monotonic()
            sliced = self.lost is not None and left > ABANDON_POLL_S
            try:
                return call.future.result(timeout=max(0.0, min(left, ABANDON_POLL_S) if sliced else left))
            except grpc.FutureTimeoutError:
                if not sliced:
                    raise
                if self.lost and call.connection.actor_id.hex() in self.lost:
                    call.future.cancel()
                    raise ActorNodeLost(f"{call.actor}: its node died (Ray's node table), call abandoned") from None

    def _failure(self, call: _Call, exc: grpc.RpcError) -> BaseException:
        code = exc.code()
        if code != grpc.StatusCode.UNAVAILABLE:
            return RuntimeError(f"expert call to {call.actor} failed: {code.name}: {exc.details()}")
        # The server is gone or unreachable: ask Ray whether the actor itself is.
        if self.connections.get(call.actor) is call.connection:
            self.connections.pop(call.actor).channel.close()  # dial again next time (a restore has a new port)
        handle = self.actors[call.actor]
        if self.lost and handle._actor_id.hex() in self.lost:  # no need to ask Ray (up to LIVENESS_TIMEOUT_S)
            return ActorNodeLost(f"{call.actor}: its node died (Ray's node table): {exc.details()}")
        return liveness_error(handle, call.actor, call.connection.address, exc.details())

    def close(self) -> None:
        for conn in self.connections.values():
            conn.channel.close()
        self.connections.clear()
