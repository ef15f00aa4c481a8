"""Pick the expert transport by name (router_service/transports/base.py lists the names) and release it."""

from __future__ import annotations

import ray
import torch

from .base import Transport, check_transport
from .compiled import CompiledGraphTransport
from .grpc import GrpcTransport
from .rdt import RdtTransport
from .refs import RayRefTransport
from .socket import SocketTransport


def make_transport(name: str, actors: dict[str, ray.actor.ActorHandle], build_timeout_s: float = 120.0,
                   device: torch.device | None = None) -> Transport:
    """A transport over `actors` (kept by reference: NameReviver swaps restored replicas into it), warmed up so the
    first step runs at steady-state speed (a compiled graph that is not up within build_timeout_s keeps building
    in the background while plain Ray calls serve). device: the router's (rdt warms up the memory its rows and
    outputs will use there)."""
    check_transport(name)
    if name == "grpc":
        transport = GrpcTransport(actors)
        transport.connect_all()
        return transport
    if name == "socket":
        transport = SocketTransport(actors)
        transport.connect_all()
        return transport
    if name == "compiled":
        transport = CompiledGraphTransport(actors)
        transport.wait_built(build_timeout_s)
        return transport
    if name == "rdt":
        transport = RdtTransport(actors)  # refuses, naming the field, where NIXL is not installed
        transport.warm_up(build_timeout_s, device)
        return transport
    return RayRefTransport(actors)


def close_transport(transport: Transport) -> None:
    close = getattr(transport, "close", None)
    if close is not None:
        close()
