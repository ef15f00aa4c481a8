"""The `rdt` transport: expert rows and outputs travel as tensors through Ray Direct Transport (RDT) with NIXL, Ray's
one-sided tensor transport, and only the call itself (layer, experts, counts, two object refs) through Ray's RPC.

    router: rows → send slab; ray.put ──[box]──► actor.forward_rdt: reads the rows out of the router's memory
    router: reads the output out        ◄──(box)── compute; ray.put(out): the output stays in the actor's memory
            of the actor's memory into its read slab    (Ray's NIXL pool) until the router has read it
Both reads are one-sided NIXL reads made by the reading process on its own thread with a timeout, into memory it
registered once (experts/rdt_box.py: a per-call registration makes every peer reconnect). The refs travel in an
`RdtBox` (with shape and dtype, so the reader picks its landing range first), so Ray never starts its own receive
task for them: that would run in the actor's `_ray_system` concurrency group, which a compiled graph's loop holds
while it is up (measured: every call then waited until the controller found the actors hung and killed them).

On a CPU NIXL moves host memory over UCX (shared memory / TCP on one node); on GPUs UCX moves device memory (CUDA
IPC on a node, RDMA across nodes): the same calls. Why NIXL and not the collective transports (GLOO, NCCL) or
compiled-graph NCCL channels: in Ray 2.60 a collective transport needs both ends to be actors of one group (an
embedded router is the driver), an actor sits in one group per backend, and when a transfer fails Ray kills *both*
ends and destroys the group, so one expert's death would kill the router (tests/integration/test_rdt_limits.py pins
this; docs/concepts/transports.md: Device to device). NIXL needs no group, lets the driver put and get, and aborts a
failed transfer instead of killing anyone.

Failover is Ray's own, as on `refs`: a call to a dead actor fails with RayActorError; an output whose actor died
after computing it fails to read with RayDirectTransportError, which is turned into RayActorError when Ray says the
actor is dead (dispatch marks it dead and re-sends), else into ExpertUnreachable (a failed call, retried
elsewhere); a hung actor's call times out within the step (the user timeout of every get). No group to rebuild: a
restored replica is a new handle in `actors`, the next call goes to it.

Rows on a GPU router stay on its GPU (`takes_device_rows`): dispatch moves only the routing to the host and gathers
each call's rows on the device (experts/device_rule.py: gather_rows); they are copied into the router's device send
slab and read by the actor straight into its own device memory; outputs are read back into the router's device read
slab, then combined there. A host router (a CPU, or a dispatch that staged the rows) puts and reads host memory.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import ray
import torch

from ...experts.arrays import HostTensor, to_tensor
from ...experts.device_rule import HOST
from ...experts.rdt_box import rdt_box_rows, rdt_read
from .grpc import liveness_error

log = logging.getLogger(__name__)

WARMUP_TIMEOUT_S = 120.0
NIXL_MISSING = ("transport: 'rdt' moves tensors with NIXL (Ray Direct Transport's one-sided transport), which is not "
                "installed here: pip install 'expertmesh[rdt]' (or nixl) on the router's and every expert node")


def rdt_available() -> bool:
    """Whether this process can use the `rdt` transport (NIXL's Python package, as Ray imports it)."""
    try:
        from nixl._api import nixl_agent  # noqa: F401 - the import Ray's NIXL transport makes
    except ImportError:
        return False
    return True


@dataclass
class RdtCall:
    """One submitted call: the actor's result ref (it resolves to the output's RdtBox), and what frees the rows'
    range of the send slab once the call is over (the actor may read it until then)."""

    actor: str
    result: ray.ObjectRef
    give_back: Callable[[], None] = field(default=lambda: None)
    device: torch.device = HOST  # where the output is read to: where the rows came from


class RdtTransport:
    takes_prefetch = True  # hints ride with the call (ExpertActor.forward_rdt's `prefetch=`)
    takes_device_rows = True  # a GPU router's rows go as they are, outputs come back onto its device

    def __init__(self, actors: dict[str, ray.actor.ActorHandle]):
        if not rdt_available():
            raise ValueError(NIXL_MISSING)
        self.actors = actors  # NameReviver swaps restored replicas in here
        self.failed_reads = 0  # outputs that could not be read (their actor died after computing them)

    def warm_up(self, timeout: float = WARMUP_TIMEOUT_S, device: torch.device | None = None) -> None:
        """Start NIXL's agent and register the slabs here and in every actor (seconds each under load), reading once
        each way, so the first step runs at steady-state speed. device: the router's; a GPU router's probe goes
        from and back to its GPU, so the device slabs it will use are registered before any actor reads from them.
        An actor that fails here fails its first real call the same way."""
        on = device if device is not None and device.type != "cpu" else HOST
        probe, give_back = rdt_box_rows(torch.zeros(1, 1, device=on))
        names = list(self.actors)
        calls = [self.actors[n].rdt_echo.remote(probe) for n in names]
        deadline = time.monotonic() + timeout
        for name, call in zip(names, calls):
            result = self._read(RdtCall(name, call, device=on), deadline)
            if isinstance(result, BaseException):
                log.warning("rdt warm-up of %s failed: %s: %s", name, type(result).__name__, result)
        give_back()

    def submit(self, actor: str, layer: int, experts: list[int], counts: list[int], x: HostTensor | torch.Tensor,
               trace: dict[str, str] | None = None, prefetch: list | None = None) -> RdtCall:
        """x: the call's [n, H] rows, host bytes or (a GPU router's) device rows; the output is read back to
        the same place."""
        rows = x if isinstance(x, torch.Tensor) else to_tensor(x)  # [n, H]
        device = HOST if rows.device.type == "cpu" else rows.device
        boxed, give_back = rdt_box_rows(rows)  # copied into the send slab (an empty tensor travels itself)
        extra: dict = {}
        if trace is not None:
            extra["trace"] = trace
        if prefetch is not None:
            extra["prefetch"] = prefetch
        try:
            result = self.actors[actor].forward_rdt.remote(layer, experts, counts, boxed, **extra)
        except BaseException:
            give_back()
            raise
        return RdtCall(actor, result, give_back, device)

    def gather_settled(self, handles: list[RdtCall], timeout: float) -> list[torch.Tensor | BaseException]:
        try:
            return self._gather(handles, timeout)
        finally:
            for handle in handles:  # every call is over (done, failed or given up): its rows' range is free
                handle.give_back()

    def _gather(self, handles: list[RdtCall], timeout: float) -> list[torch.Tensor | BaseException]:
        deadline = time.monotonic() + timeout
        calls = [h.result for h in handles]
        ready, _ = ray.wait(calls, num_returns=len(calls), timeout=timeout)
        if len(ready) == len(calls) and len({h.device for h in handles}) <= 1:
            try:
                # The common case: every call succeeded; start every read at once and wait for them together.
                device = handles[0].device if handles else HOST
                return rdt_read(ray.get(calls), device, max(0.0, deadline - time.monotonic()))  # [n_i, H]
            except Exception:  # some call or read failed: sort out which, one by one
                pass
        finished = set(ready)
        results: list[torch.Tensor | BaseException] = []
        for handle in handles:
            if handle.result not in finished:
                results.append(TimeoutError(f"expert call did not finish within {timeout}s"))
                continue
            results.append(self._read(handle, deadline))
        return results

    def _read(self, handle: RdtCall, deadline: float) -> torch.Tensor | BaseException:
        """The call's output, read out of its actor's memory, or the error the call or the read failed with."""
        try:
            out = ray.get(handle.result)
        except Exception as exc:  # the actor died, its node went away, or its code raised: Ray's own error
            return exc
        try:
            (value,) = rdt_read([out], handle.device, max(0.0, deadline - time.monotonic()))  # [n, H]
            return value
        except ray.exceptions.GetTimeoutError:
            return TimeoutError(f"reading {handle.actor}'s output did not finish in time")
        except ray.exceptions.RayActorError as dead:
            return dead
        except Exception as exc:  # RayDirectTransportError: the source may have died after computing
            self.failed_reads += 1
            return liveness_error(self.actors[handle.actor], handle.actor, "rdt", f"reading its output: {exc}")
