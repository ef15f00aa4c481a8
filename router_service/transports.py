"""Pick the expert transport by name ("refs" | "grpc" | "compiled"); every one returns the same results.

  refs      one Ray actor call per actor per layer (arguments and results as object refs); the default
  grpc      one unary gRPC call per actor per layer to a server inside each expert actor
  compiled  one Ray Compiled Graph execution per layer over every actor (shared-memory channels), falling back
            to refs while it (re)builds or after an actor died
"""

from __future__ import annotations

import ray

from .compiled_transport import CompiledGraphTransport
from .grpc_transport import GrpcTransport
from .transport import RayRefTransport, Transport

TRANSPORTS = ("refs", "grpc", "compiled")


def check_transport(name: str) -> str:
    if name not in TRANSPORTS:
        raise ValueError(f"transport: must be one of {TRANSPORTS}, got {name!r}")
    return name


def make_transport(name: str, actors: dict[str, ray.actor.ActorHandle], build_timeout_s: float = 120.0) -> Transport:
    """A transport over `actors` (kept by reference: NameReviver swaps restored replicas into it), warmed up so the
    first step runs at steady-state speed (a compiled graph that is not up within build_timeout_s keeps building
    in the background while plain Ray calls serve)."""
    check_transport(name)
    if name == "grpc":
        transport = GrpcTransport(actors)
        transport.connect_all()
        return transport
    if name == "compiled":
        transport = CompiledGraphTransport(actors)
        transport.wait_built(build_timeout_s)
        return transport
    return RayRefTransport(actors)


def close_transport(transport: Transport) -> None:
    close = getattr(transport, "close", None)
    if close is not None:
        close()
