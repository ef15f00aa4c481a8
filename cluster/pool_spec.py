"""What an expert pool runs: the checkpoint, the dtype and which shards each named actor hosts. No Ray here, so the
pool (router_service/expert_pool.py), the controller and routers in other processes (Serve replicas) share one typed
description; it is a frozen dataclass, so Ray pickles it to the controller as is."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from .naming import DEFAULT_MESH_ID, MeshNames
from .routing_table import Shard


@dataclass(frozen=True)
class PoolSpec:
    model_dir: str
    dtype: str
    actor_shards: dict[str, list[Shard]]  # actor name -> shards it hosts
    tracing: dict | None = None  # TracingConfig fields for the actors (experts/telemetry.py); None = off
    revision: str | None = None  # with a Hub repo id as model_dir (experts/model_source.py)
    memory_gb: float | None = None  # each actor's device budget for expert weights (experts.memory_gb); None: all
    eviction: str = "layer-cycle"  # experts.eviction: the order an actor's device tier gives shards back in
    quant: str = "none"  # experts.quant: routed experts stored as "none" (the dtype), "int8" or "int4"
    gpu_without_cuda: str = "refuse"  # devices.gpu_without_cuda: an actor given a GPU torch cannot see refuses
    # mesh.id: the namespace, controller and stored keys of this pool (cluster/naming.py: MeshNames), carried to the
    # controller and router replicas so restores and new routers find this mesh's names
    mesh_id: str = DEFAULT_MESH_ID

    @property
    def names(self) -> MeshNames:
        return MeshNames.of(self.mesh_id)

    def with_actor_shards(self, actor_shards: Mapping[str, Iterable[Iterable[int]]]) -> PoolSpec:
        """The same pool with another placement; shards may come as JSON lists ([layer, expert]), they are kept as
        (layer, expert) tuples."""
        shards = {name: [(int(layer), int(expert)) for layer, expert in hosted]
                  for name, hosted in actor_shards.items()}
        return replace(self, actor_shards=shards)
