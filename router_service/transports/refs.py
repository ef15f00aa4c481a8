"""The `refs` transport: `RayRefTransport` sends every call of a layer as a Ray actor call (arguments and results
travel as object refs) and waits for all of them together. `NameReviver` finds restored replicas by name for every
transport (they all keep their handles in the same `actors` dict).
"""

from __future__ import annotations

import ray
import torch

from ...experts.arrays import HostTensor, to_tensor
from .base import Transport


class RayRefTransport:
    takes_prefetch = True  # prefetch hints ride with a call (ExpertActor.forward's `prefetch=`)

    def __init__(self, actors: dict[str, ray.actor.ActorHandle]):
        self.actors = actors

    def submit(self, actor: str, layer: int, experts: list[int], counts: list[int], x: HostTensor,
               trace: dict[str, str] | None = None, prefetch: list | None = None) -> ray.ObjectRef:
        if trace is None and prefetch is None:
            return self.actors[actor].forward.remote(layer, experts, counts, x)
        extra = {} if prefetch is None else {"prefetch": prefetch}
        return self.actors[actor].forward.remote(layer, experts, counts, x, trace=trace, **extra)

    def gather_settled(self, handles: list[ray.ObjectRef], timeout: float) -> list[torch.Tensor | BaseException]:
        ready, _ = ray.wait(handles, num_returns=len(handles), timeout=timeout)
        if len(ready) == len(handles):
            try:
                # One get for the whole layer when nothing failed (the common case): cheaper than one per call.
                return [to_tensor(value) for value in ray.get(handles)]
            except Exception:  # some call failed: sort out which, one by one
                pass
        finished = set(ready)
        results: list[torch.Tensor | BaseException] = []
        for ref in handles:
            if ref not in finished:
                results.append(TimeoutError(f"expert call did not finish within {timeout}s"))
                continue
            try:
                results.append(to_tensor(ray.get(ref)))
            except Exception as exc:  # the actor died, its node went away, or its code raised
                results.append(exc)
        return results


class NameReviver:
    """Finds replicas that came back under their old name (restored by the controller) without blocking a step:
    it sends each a `ready` ping and swaps the handle in once the ping returns (restored actors warm up before
    answering it)."""

    def __init__(self, transport: Transport, namespace: str):
        self.transport = transport
        self.namespace = namespace
        self.pings: dict[str, tuple[ray.actor.ActorHandle, ray.ObjectRef]] = {}

    def __call__(self, dead: set[str]) -> set[str]:
        back: set[str] = set()
        for name in dead:
            if name in self.pings:
                handle, ref = self.pings[name]
                ready, _ = ray.wait([ref], timeout=0)
                if not ready:
                    continue
                del self.pings[name]
                try:
                    ray.get(ref)
                except Exception:  # that incarnation died too; look it up again next time
                    continue
                self.transport.actors[name] = handle
                back.add(name)
                continue
            try:
                handle = ray.get_actor(name, namespace=self.namespace)
            except ValueError:
                continue  # not restored yet
            self.pings[name] = (handle, handle.ready.remote())
        return back
