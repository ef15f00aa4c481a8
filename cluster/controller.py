"""The controller: a named, detached, restartable Ray actor that keeps every expert replica alive.

It checks each expected expert actor every `check_interval_s` (is the name registered, does it answer a ping) and
restores a lost one: a new actor under the same name, weights reloaded from the checkpoint, a warm-up forward
inside the actor before it reports ready. Routers find the restored replica by name, so the data plane never
waits for the controller; while the controller is down or restarting, routers keep serving on what they have.

A restarted controller rebuilds its state from what is alive (each expert actor knows its generation) and from a
small record in Ray's GCS key-value store (epoch, drained replicas), not from scratch.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from dataclasses import asdict, dataclass

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from .naming import NAMESPACE
from .placement import ActorSlot

log = logging.getLogger(__name__)
CONTROLLER_NAME = "controller"
_KV_KEY = b"expertmesh/controller"


@dataclass(frozen=True)
class ControllerConfig:
    check_interval_s: float = 0.5
    ping_timeout_s: float = 5.0
    restore_timeout_s: float = 300.0
    restore: bool = True  # False: only watch and report (for drills of the wait/degrade policies)

    def validate(self) -> ControllerConfig:
        assert self.check_interval_s > 0 and self.ping_timeout_s > 0 and self.restore_timeout_s > 0
        return self


def _kv_get() -> dict:
    from ray.experimental import internal_kv

    raw = internal_kv._internal_kv_get(_KV_KEY)
    return json.loads(raw) if raw else {}


def _kv_put(record: dict) -> None:
    from ray.experimental import internal_kv

    internal_kv._internal_kv_put(_KV_KEY, json.dumps(record).encode(), overwrite=True)


class Controller:
    """Runs as an async Ray actor (see `start_controller`)."""

    def __init__(self, spec: dict, slots: list[dict], config: dict | None = None):
        self.spec = spec  # PoolSpec as a dict: model_dir, dtype, actor_shards
        self.slots = {s["name"]: ActorSlot(**s) for s in slots}
        self.config = ControllerConfig(**(config or {})).validate()
        saved = _kv_get()
        self.epoch = int(saved.get("epoch", 0))
        self.drained: set[str] = set(saved.get("drained", []))
        self.generations: dict[str, int] = {}
        self.nodes: dict[str, str] = {}  # actor -> node id it was last seen on
        self.restoring: set[str] = set()
        self.events: list[dict] = []
        self.started_at = time.time()
        self.restarted = bool(saved)  # a previous incarnation left a record
        self._first_pass = threading.Event()
        # The watch starts here, on a thread with its own event loop, so that every incarnation watches, including
        # one Ray restarted after a crash (nobody calls a method on it then).
        threading.Thread(target=lambda: asyncio.run(self._watch()), name="controller-watch", daemon=True).start()

    # ---- lifecycle ---------------------------------------------------------------------------------------------

    async def start(self) -> dict:
        """Wait until the first pass over the actors is done (idempotent); returns the state."""
        await asyncio.get_running_loop().run_in_executor(None, self._first_pass.wait, 60)
        return await self.get_state()

    async def _watch(self) -> None:
        while True:
            try:
                await self._check_all()
            except Exception:  # the watcher must outlive any one bad pass
                log.exception("controller pass failed")
            self._first_pass.set()
            await asyncio.sleep(self.config.check_interval_s)

    def _expected(self) -> list[str]:
        return [name for name in self.spec["actor_shards"] if name not in self.drained]

    async def _check_all(self) -> None:
        names = [n for n in self._expected() if n not in self.restoring]
        results = await asyncio.gather(*(self._probe(n) for n in names))
        for name, info in zip(names, results):
            if info is not None:
                self.generations[name] = info["generation"]
                self.nodes[name] = info["node_id"]
                continue
            self._event("lost", name)
            if self.config.restore:
                self.restoring.add(name)
                asyncio.get_running_loop().create_task(self._restore(name))

    async def _probe(self, name: str) -> dict | None:
        try:
            handle = ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:
            return None
        try:
            return await asyncio.wait_for(handle.info.remote(), self.config.ping_timeout_s)
        except Exception:
            # Hung or dying: make sure it is gone so the name is free for its replacement.
            try:
                ray.kill(handle, no_restart=True)
            except Exception:
                pass
            return None

    async def _restore(self, name: str) -> None:
        from ..experts.actor import ExpertActor

        started = time.time()
        try:
            slot = self.slots[name]
            node = self._node_for(slot)
            generation = self.generations.get(name, 0) + 1
            handle = ray.remote(ExpertActor).options(
                name=name, namespace=NAMESPACE, lifetime="detached", num_cpus=slot.num_cpus,
                # soft: if that node turns out to be gone (ray.nodes() can still call it alive for a few seconds
                # after it died), Ray places the replacement on any node with room instead of failing it.
                num_gpus=slot.num_gpus, scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=True),
            ).remote(name, self.spec["model_dir"], [tuple(s) for s in self.spec["actor_shards"][name]],
                     self.spec["dtype"], generation)
            info = await asyncio.wait_for(handle.info.remote(), self.config.restore_timeout_s)  # after warm-up
            self.generations[name] = generation
            self.nodes[name] = info["node_id"]
            self.epoch += 1
            self._persist()
            self._event("restored", name, seconds=round(time.time() - started, 3), node_id=info["node_id"],
                        generation=generation)
        except Exception as exc:
            self._event("restore_failed", name, error=f"{type(exc).__name__}: {exc}"[:500])
        finally:
            self.restoring.discard(name)

    def _node_for(self, slot: ActorSlot) -> str:
        """The slot's own node while it is alive; otherwise the live node (with GPUs, if the slot wants one)
        hosting the fewest of our actors."""
        alive = [n for n in ray.nodes() if n["Alive"]]
        if any(n["NodeID"] == slot.node_id for n in alive):
            return slot.node_id
        fits = [n for n in alive if (n["Resources"].get("GPU", 0) > 0) == (slot.num_gpus > 0)
                and n["Resources"].get("CPU", 0) >= slot.num_cpus] or alive
        load = {n["NodeID"]: sum(1 for v in self.nodes.values() if v == n["NodeID"]) for n in fits}
        return min(load, key=lambda node: (load[node], node))

    def _event(self, kind: str, actor: str, **detail) -> None:
        self.events.append({"t": time.time(), "kind": kind, "actor": actor, **detail})
        del self.events[:-1000]

    def _persist(self) -> None:
        _kv_put({"epoch": self.epoch, "drained": sorted(self.drained)})

    # ---- API (admin and routers) ---------------------------------------------------------------------------

    async def get_state(self) -> dict:
        return {
            "epoch": self.epoch,
            "actors": {name: {"node_id": self.nodes.get(name), "generation": self.generations.get(name, 0),
                              "restoring": name in self.restoring, "slot": asdict(self.slots[name])}
                       for name in self._expected()},
            "drained": sorted(self.drained),
            "events": list(self.events),
            "restarted": self.restarted,
            "started_at": self.started_at,
        }

    async def kill_replica(self, name: str) -> bool:
        try:
            ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)
        except ValueError:
            return False
        self._event("killed", name)
        return True

    async def drain_replica(self, name: str, grace_s: float = 5.0) -> bool:
        """Stop restoring `name`, let routers stop using it, then stop it after `grace_s` for in-flight calls."""
        if name not in self.spec["actor_shards"] or name in self.drained:
            return False
        self.drained.add(name)
        self.epoch += 1
        self._persist()
        self._event("draining", name)

        def stop_later() -> None:
            time.sleep(grace_s)
            try:
                ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)
            except ValueError:
                pass
            self._event("drained", name)

        threading.Thread(target=stop_later, daemon=True).start()
        return True


def start_controller(spec: dict, slots: list[ActorSlot], config: ControllerConfig | None = None,
                     fresh: bool = True) -> ray.actor.ActorHandle:
    """Create (or find) the controller actor and start it watching. fresh=True clears a record left by an
    earlier deployment on this cluster."""
    if fresh:
        _kv_put({})
    try:
        handle = ray.get_actor(CONTROLLER_NAME, namespace=NAMESPACE)
    except ValueError:
        handle = ray.remote(Controller).options(
            name=CONTROLLER_NAME, namespace=NAMESPACE, lifetime="detached", max_restarts=-1,
            max_concurrency=64, num_cpus=0,
        ).remote(spec, [asdict(s) for s in slots], asdict(config or ControllerConfig()))
    ray.get(handle.start.remote())
    return handle
