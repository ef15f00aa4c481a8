"""The actor side of the gRPC transport: a small threaded gRPC server inside an expert actor.

An actor starts it only when a router asks for its address (`ExpertActor.grpc_address`), so actors used over Ray
calls pay nothing. Each Forward call runs the actor's own `forward` (same code path as a Ray call, trace included)
on one of the server's threads; the actor's Ray methods keep working alongside.

It listens on the node's cluster address only and answers only callers that send the cluster secret
(experts/transport_secret.py) as `SECRET_METADATA_KEY` call metadata; any other call gets UNAUTHENTICATED before
anything is decoded. The comparison takes constant time, so the answer's timing does not leak the secret.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent import futures

import grpc

from ..protos import expert_transport_pb2 as pb
from ..protos import expert_transport_pb2_grpc as pb_grpc
from . import wire
from .arrays import HostTensor
from .token_compare import secret_matches

# Prefill batches of a large model exceed gRPC's 4 MiB default by far; the router is the only client.
MESSAGE_OPTIONS = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]

SECRET_METADATA_KEY = "x-expertmesh-cluster-secret"  # gRPC metadata keys are lower case

Forward = Callable[..., HostTensor]  # forward(layer, experts, counts, x: HostTensor, trace=, prefetch=) -> [rows, H]


def call_metadata(secret: str) -> tuple[tuple[str, str], ...]:
    """The metadata a router sends with every call."""
    return ((SECRET_METADATA_KEY, secret),)


class _RequireSecret(grpc.ServerInterceptor):
    """Refuses, with UNAUTHENTICATED, every call (any method, known or not) that lacks the cluster secret."""

    def __init__(self, secret: str):
        if not secret:
            raise ValueError("secret: the expert transport needs a non-empty cluster secret")
        self._secret = secret.encode()

    def intercept_service(self, continuation, handler_call_details):
        sent = dict(handler_call_details.invocation_metadata or ()).get(SECRET_METADATA_KEY, "")
        if secret_matches(sent, self._secret):
            return continuation(handler_call_details)
        return _REFUSE


def _refuse(request, context: grpc.ServicerContext):
    context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong cluster secret")


_REFUSE = grpc.unary_unary_rpc_method_handler(_refuse)


class _Servicer(pb_grpc.ExpertTransportServicer):
    def __init__(self, forward: Forward):
        self.forward = forward

    def Forward(self, request: pb.ExpertBatch, context: grpc.ServicerContext) -> pb.ExpertOutput:  # noqa: N802
        try:
            y = wire.forward_batch(self.forward, request)
        except Exception as exc:  # the router retries elsewhere; say what failed
            context.abort(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")
        return pb.ExpertOutput(y=wire.encode_host(y))


class ExpertGrpcServer:
    """Serves `forward` on host:<free port> (host: the node's cluster IP, never 0.0.0.0) to callers that send
    `secret`; `address` is what routers dial."""

    def __init__(self, forward: Forward, host: str, secret: str, threads: int = 4):
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="expert-grpc"),
                                  interceptors=[_RequireSecret(secret)], options=MESSAGE_OPTIONS)
        pb_grpc.add_ExpertTransportServicer_to_server(_Servicer(forward), self.server)
        bind_host = f"[{host}]" if ":" in host else host
        port = self.server.add_insecure_port(f"{bind_host}:0")
        if port == 0:
            raise RuntimeError(f"could not bind a gRPC port on {host}")
        self.server.start()
        self.address = f"{bind_host}:{port}"

    def stop(self, grace: float | None = None) -> None:
        self.server.stop(grace)
