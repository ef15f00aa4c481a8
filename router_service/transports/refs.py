"""The `refs` transport: `RayRefTransport` sends every call of a layer as a Ray actor call (arguments and results
travel as object refs) and waits for all of them together. `NameReviver` finds restored replicas by name for every
transport (they all keep their handles in the same `actors` dict).
"""

from __future__ import annotations

import time

import ray
import torch

from ...experts.arrays import HostTensor, to_tensor
from .base import ABANDON_POLL_S, ActorNodeLost, LostActors, Transport

_MAX_TRACKED = 4096  # calls submitted but never gathered (a step that failed) are forgotten past this many


class RayRefTransport:
    takes_prefetch = True  # prefetch hints ride with a call (ExpertActor.forward's `prefetch=`)

    def __init__(self, actors: dict[str, ray.actor.ActorHandle], lost: LostActors | None = None):
        """lost: actors on dead nodes (router_service/node_watch.py); calls to them are given up on while waiting.
        None: wait for Ray to fail them."""
        self.actors = actors
        self.lost = lost
        self._callee: dict[ray.ObjectRef, tuple[str, str]] = {}  # call -> (actor name, actor id hex), with `lost`

    def submit(self, actor: str, layer: int, experts: list[int], counts: list[int], x: HostTensor,
               trace: dict[str, str] | None = None, prefetch: list | None = None) -> ray.ObjectRef:
        handle = self.actors[actor]
        if trace is None and prefetch is None:
            ref = handle.forward.remote(layer, experts, counts, x)
        else:
            extra = {} if prefetch is None else {"prefetch": prefetch}
            ref = handle.forward.remote(layer, experts, counts, x, trace=trace, **extra)
        if self.lost is not None:
            if len(self._callee) >= _MAX_TRACKED:
                self._callee.clear()
            self._callee[ref] = (actor, handle._actor_id.hex())
        return ref

    def _wait(self, handles: list[ray.ObjectRef], timeout: float) -> tuple[set, dict]:
        """Wait until every call is done, `timeout` passed, or the rest are calls to actors on dead nodes. ->
        (the finished calls, abandoned call -> ActorNodeLost)."""
        callees = [self._callee.pop(ref, None) for ref in handles] if self.lost is not None else []
        if self.lost is None:
            ready, _ = ray.wait(handles, num_returns=len(handles), timeout=timeout)
            return set(ready), {}
        callee = dict(zip(handles, callees))
        deadline = time.monotonic() + timeout
        finished: set = set()
        abandoned: dict = {}
        waiting = list(handles)
        while waiting:
            left = deadline - time.monotonic()
            ready, waiting = ray.wait(waiting, num_returns=len(waiting), timeout=max(0.0, min(left, ABANDON_POLL_S)))
            finished.update(ready)
            if not waiting or left <= ABANDON_POLL_S:
                break
            if self.lost:  # the node watch found a dead node: give up on the calls to actors that were on it
                for ref in waiting:
                    name, actor_id = callee.get(ref) or ("", "")
                    if actor_id in self.lost:
                        abandoned[ref] = ActorNodeLost(f"{name}: its node died (Ray's node table), call abandoned")
                waiting = [ref for ref in waiting if ref not in abandoned]
        return finished, abandoned

    def gather_settled(self, handles: list[ray.ObjectRef], timeout: float) -> list[torch.Tensor | BaseException]:
        finished, abandoned = self._wait(handles, timeout)
        if len(finished) == len(handles):
            try:
                # One get for the whole layer when nothing failed (the common case): cheaper than one per call.
                return [to_tensor(value) for value in ray.get(handles)]
            except Exception:  # some call failed: sort out which, one by one
                pass
        results: list[torch.Tensor | BaseException] = []
        for ref in handles:
            if ref in abandoned:
                results.append(abandoned[ref])
                continue
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
