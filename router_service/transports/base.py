"""The transport interface and the transport names; no Ray, gRPC or torch at import, so the dispatcher's planning
and the configuration checks import it freely.

  refs      one Ray actor call per actor per layer (arguments and results as object refs)
  grpc      one unary gRPC call per actor per layer to a server inside each expert actor
  socket    one framed message each way per actor per layer over a TCP connection to a server inside each expert
            actor (the gRPC transport's messages without gRPC's per-call cost)
  compiled  one Ray Compiled Graph execution per layer over every actor (shared-memory channels), falling back
            to refs while it (re)builds or after an actor died
  rdt       one Ray actor call per actor per layer whose rows and output travel as tensors through Ray Direct
            Transport with NIXL (one-sided reads of the other side's memory; device memory on GPUs)
Every one returns the same results.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # annotations only
    import torch

    from ...experts.arrays import HostTensor

# While a node watch runs (router_service/node_watch.py), transports wait for a call's answer in slices this long and
# between slices give up on calls to actors it found on a dead node.
ABANDON_POLL_S = 0.05


class ActorNodeLost(RuntimeError):
    """The actor ran on a node Ray reports dead: its call will never be answered. Dispatch counts it as the actor's
    death (router_service/replica_health.py) and sends the call's rows to another replica in the same step."""


class LostActors:
    """Actor incarnations (Ray actor ids, hex) on nodes Ray reports dead: the node watch adds, transports ask.
    Reads take no lock (the set is replaced, never changed in place), so a transport's wait loop can ask often."""

    def __init__(self):
        self._ids: frozenset[str] = frozenset()
        self._lock = threading.Lock()

    def add(self, actor_ids: Iterable[str]) -> None:
        with self._lock:
            self._ids = self._ids | frozenset(actor_ids)

    def __contains__(self, actor_id: object) -> bool:
        return actor_id in self._ids

    def __bool__(self) -> bool:
        return bool(self._ids)


TRANSPORTS = ("refs", "grpc", "socket", "compiled", "rdt")
# What router.transport accepts: a transport, or "auto" = socket on an embedded Ray (every actor on this machine, on
# loopback), refs on a cluster the mesh joined (whose nodes' ports may not be open to each other).
TRANSPORT_SETTINGS = ("auto", *TRANSPORTS)


def resolve_transport(setting: str, ray_address: str) -> str:
    """router.transport -> the transport to build. socket where it is surely reachable (every actor on this machine).
    Measured on the 2-core box: an empty round trip between two Python processes takes ~0.03 ms over a framed TCP
    connection against ~0.6-0.8 ms over gRPC; a decode step through one expert actor took 17-25 ms over grpc
    against 17-26 ms over refs when quiet, and 22-40 ms against 160-640 ms at load average 22 (refs' calls go
    through Ray's scheduler threads, which a loaded machine starves); README: Transports has the served rates."""
    if setting != "auto":
        return check_transport(setting)
    return "socket" if ray_address == "local" else "refs"


def check_transport(name: str) -> str:
    if name not in TRANSPORTS:
        raise ValueError(f"transport: must be one of {TRANSPORTS}, got {name!r}")
    return name


class Transport(Protocol):
    """Sends a shard-batch to an expert actor and gets its output back. Implementations keep the name -> actor
    handle map they call in `actors` (NameReviver and live remap swap handles in there)."""

    actors: dict[str, Any]

    def submit(self, actor: str, layer: int, experts: list[int], counts: list[int], x: HostTensor,
               trace: dict[str, str] | None = None) -> Any:
        """Start one call with rows x ([n, H] as raw bytes + dtype tag, in host memory); returns a handle for
        `gather`. trace: a W3C carrier dict (opentelemetry.propagate.inject) naming the dispatch span as parent,
        handed to ExpertActor.forward(..., trace=); None when off. A transport whose class sets `takes_prefetch =
        True` (refs, grpc, socket) also takes `prefetch=[(layer, expert), ...]`, offload hints that ride with the
        call to ExpertActor.forward(..., prefetch=); the dispatcher sends hints as calls of their own otherwise."""
        ...

    def gather_settled(self, handles: list[Any], timeout: float) -> list[torch.Tensor | BaseException]:
        """Wait for every handle (at most `timeout` seconds); per handle its output or the error it failed with
        (TimeoutError when it did not finish in time). Never raises for a failed call."""
        ...
