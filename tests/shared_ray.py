"""One local Ray (2 CPUs, the default mesh's namespace) shared by the integration modules that run meshes in this
process (`local_ray`), instead of one per module (issue 25: one Ray per test run where it is safe).

It is safe because each module hands Ray back as a fresh one would be: `release` (at each module's end) kills every
named actor left in any namespace (expert actors and controllers are named, per mesh: cluster/naming.py), deletes
every key a mesh keeps in Ray's key-value store (all under `expertmesh/`: cluster/mesh_store.py), and then checks
that every CPU is free again. When it is not (an unnamed actor or a placement group outlived its module), the Ray
is shut down and the next module starts a new one: a leftover never reaches another module.
"""

from __future__ import annotations

import time

import ray

from expertmesh.cluster.naming import NAMESPACE
from tests.clusters import init_local_ray

CPUS = 2
FREE_WAIT_S = 15  # killed actors give their CPUs back asynchronously


class SharedRay:
    def __init__(self) -> None:
        self.starts = 0  # how many Rays this session started (1 when every module handed it back clean)
        self.modules = 0  # how many modules used it

    def acquire(self) -> None:
        self.modules += 1
        if not ray.is_initialized():
            init_local_ray(num_cpus=CPUS, namespace=NAMESPACE, include_dashboard=False)
            self.starts += 1

    def release(self) -> None:
        """Leave Ray as a new one would be, or shut it down (see the module docstring)."""
        if not ray.is_initialized():
            return
        try:
            for actor in ray.util.list_named_actors(all_namespaces=True):
                try:
                    ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]), no_restart=True)
                except ValueError:
                    pass  # gone meanwhile
            from ray.experimental import internal_kv

            for key in internal_kv._internal_kv_list("expertmesh/"):
                internal_kv._internal_kv_del(key)
            deadline = time.monotonic() + FREE_WAIT_S
            while ray.available_resources().get("CPU", 0) < CPUS and time.monotonic() < deadline:
                time.sleep(0.2)
            clean = ray.available_resources().get("CPU", 0) >= CPUS
        except Exception:  # noqa: BLE001 - whatever went wrong, a fresh Ray is the safe answer
            clean = False
        if not clean:
            self.stop()

    def stop(self) -> None:
        if ray.is_initialized():
            ray.shutdown()


SHARED_RAY = SharedRay()
