"""The expert pool: plans where expert actors go, starts them, waits until every one has loaded, stops them.

A pool is described by a picklable `PoolSpec` (cluster/pool_spec.py: model folder, dtype, actor name -> shards), so
routers in other processes (Serve replicas) can reach the same actors by name with `connect_actors`.
"""

from __future__ import annotations

import sys
import time

import ray
from tqdm import tqdm

from ..cluster.actor_slots import ActorSlot, NodeResources, plan_actor_slots
from ..cluster.default_pool import (  # noqa: F401  (re-exported: the pure layout helpers moved there)
    MANY_EXPERTS,
    cluster_device_count,
    default_actor_groups,
    device_actor_groups,
    device_actor_slots,
    expert_slices,
)
from ..cluster.expert_actors import start_expert_actor
from ..cluster.pool_spec import PoolSpec
from ..cluster.table_store import clear_table
from ..experts.devices import REFUSAL_FIELD, find_refusal
from ..experts.errors import ConfigError

NOTE_EVERY_S = 15.0  # start-up progress lines when stderr is not a terminal


def cluster_nodes() -> list[NodeResources]:
    return [
        NodeResources(n["NodeID"], n["Resources"].get("CPU", 0.0), int(n["Resources"].get("GPU", 0)))
        for n in ray.nodes() if n["Alive"]
    ]


def connect_actors(spec: PoolSpec) -> dict[str, ray.actor.ActorHandle]:
    """Handles to a running pool's actors, looked up by name (from any driver or Serve replica)."""
    return {name: ray.get_actor(name, namespace=spec.names.namespace) for name in spec.actor_shards}


class ExpertPool:
    def __init__(self, spec: PoolSpec, num_cpus_per_actor: float | None = None, start_timeout_s: float = 180.0,
                 detached: bool = False, reuse: bool = False, slots: list[ActorSlot] | None = None):
        """detached: actors outlive this process (Serve-config deployments, where the builder exits).
        reuse: adopt actors that already run under these names instead of refusing to start."""
        self.spec = spec
        self.start_timeout_s = start_timeout_s
        self.detached = detached
        self.reuse = reuse
        # slots: a planned layout's (router_service/pool_layout.py); otherwise spread the actors over the cluster.
        self.slots: list[ActorSlot] = slots or plan_actor_slots(list(spec.actor_shards), cluster_nodes(),
                                                                num_cpus_per_actor)
        self.actors: dict[str, ray.actor.ActorHandle] = {}
        self._spawn()

    def _spawn(self) -> None:
        for slot in self.slots:
            if self.reuse:
                break
            try:
                ray.get_actor(slot.name, namespace=self.spec.names.namespace)
            except ValueError:
                continue
            raise RuntimeError(
                f"actor '{slot.name}' already exists in namespace '{self.spec.names.namespace}': another expertmesh "
                f"with mesh id '{self.spec.mesh_id}' is serving on this Ray cluster; stop it first, or give this one "
                "another mesh.id (--mesh-id)"
            )
        if not self.reuse:
            # A fresh pool: a routing table an earlier deployment of this mesh published on this cluster is stale.
            # Cleared only now, so a start refused above leaves a running mesh of the same id its table.
            clear_table(self.spec.mesh_id)
        for slot in self.slots:
            self.actors[slot.name] = start_expert_actor(slot, self.spec, detached=self.detached, reuse=self.reuse)
        self._wait_ready()

    def _wait_ready(self) -> None:
        pending = {handle.ready.remote(): name for name, handle in self.actors.items()}
        deadline = time.monotonic() + self.start_timeout_s
        bar = tqdm(total=len(pending), desc="expert actors ready", unit="actor", leave=False,
                   disable=not sys.stderr.isatty())
        started = last_note = time.monotonic()
        try:
            while pending:
                # Without a terminal (a log file, a drill's or Serve's child) the bar is off: say how far the start is
                # every NOTE_EVERY_S instead, so a slow start of many actors is not minutes of silence.
                done, _ = ray.wait(list(pending), num_returns=len(pending),
                                   timeout=max(0.0, min(deadline, time.monotonic() + NOTE_EVERY_S) - time.monotonic()))
                if bar.disable and time.monotonic() - last_note >= NOTE_EVERY_S and pending.keys() - set(done):
                    last_note = time.monotonic()
                    print(f"expertmesh: expert actors ready {len(self.actors) - len(pending) + len(done)}/"
                          f"{len(self.actors)} after {last_note - started:.0f} s", file=sys.stderr, flush=True)
                for ref in done:
                    pending.pop(ref)
                    try:
                        ray.get(ref)  # raises the actor's own error
                    except ray.exceptions.RayError as exc:
                        # An actor given a GPU torch cannot see: its one line, not Ray's traceback around it.
                        if (line := find_refusal(str(exc))) is not None:
                            raise ConfigError(REFUSAL_FIELD, line) from None
                        raise
                    bar.update(1)
                if pending and time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"expert actors not ready after {self.start_timeout_s:.0f}s: "
                        f"{sorted(pending.values())} (not enough CPU/GPU in the cluster?)"
                    )
        except BaseException:
            self.shutdown()
            raise
        finally:
            bar.close()

    def info(self) -> list[dict]:
        return ray.get([h.info.remote() for h in self.actors.values()])

    def shutdown(self) -> None:
        """Stop every actor of the pool, including replacements the controller started under the same names."""
        for name, handle in self.actors.items():
            ray.kill(handle, no_restart=True)
            try:
                ray.kill(ray.get_actor(name, namespace=self.spec.names.namespace), no_restart=True)
            except ValueError:
                pass
        self.actors = {}
