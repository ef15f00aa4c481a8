"""The expert pool: plans where expert actors go, starts them, waits until every one has loaded, stops them.

A pool is described by a picklable `PoolSpec` (cluster/pool_spec.py: model folder, dtype, actor name -> shards), so
routers in other processes (Serve replicas) can reach the same actors by name with `connect_actors`.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import replace

import ray
from tqdm import tqdm

from ..cluster.actor_slots import ActorSlot, NodeResources, plan_actor_slots
from ..cluster.expert_actors import start_expert_actor
from ..cluster.naming import NAMESPACE, expert_actor_name
from ..cluster.pool_spec import PoolSpec
from ..cluster.table_store import clear_table
from ..experts.config import MoEModelConfig
from ..experts.devices import REFUSAL_FIELD, find_refusal
from ..experts.errors import ConfigError
from ..experts.weights import Shard

# Above this many experts per layer the default pool is one actor per device (GPU, or node on a CPU-only cluster)
# hosting a slice of every layer's experts, not one actor (one process, one torch) per logical expert.
MANY_EXPERTS = 16


def default_actor_groups(cfg: MoEModelConfig, replicas_per_expert: int,
                         devices: int | None = None) -> dict[str, list[Shard]]:
    """The default pool: actor name -> shards, replicas of a group listed consecutively so the placement spreads
    them over different GPUs and nodes.

    Up to MANY_EXPERTS experts per layer (or devices None): group g = logical expert g, hosting that expert in every
    MoE layer (`expert-e{g}-r{r}`). Beyond: `devices` groups (the cluster's GPUs, or its nodes when it has none),
    group g hosting the g-th contiguous slice of the experts in every MoE layer; still `expert-e{g}-r{r}`, so
    replicas_per_expert means replicas of each slice."""
    if devices is None or cfg.num_experts <= MANY_EXPERTS:
        return _groups(cfg, replicas_per_expert, [[expert] for expert in range(cfg.num_experts)])
    return device_actor_groups(cfg, replicas_per_expert, devices)


def device_actor_groups(cfg: MoEModelConfig, replicas_per_expert: int, devices: int) -> dict[str, list[Shard]]:
    """The per-device layout at any expert count: `devices` groups, group g hosting the g-th contiguous slice of the
    experts in every MoE layer (`expert-e{g}-r{r}`): one call per actor per layer instead of one per expert hit."""
    return _groups(cfg, replicas_per_expert, expert_slices(cfg.num_experts, devices))


def _groups(cfg: MoEModelConfig, replicas_per_expert: int, slices: list[list[int]]) -> dict[str, list[Shard]]:
    return {
        expert_actor_name(group, replica): [(layer, expert) for layer in cfg.moe_layers for expert in experts]
        for group, experts in enumerate(slices)
        for replica in range(replicas_per_expert)
    }


def expert_slices(num_experts: int, parts: int) -> list[list[int]]:
    """range(num_experts) in min(parts, num_experts) contiguous, near-equal slices."""
    parts = max(1, min(parts, num_experts))
    bounds = [round(i * num_experts / parts) for i in range(parts + 1)]
    return [list(range(bounds[i], bounds[i + 1])) for i in range(parts)]


def cluster_device_count(nodes: list[NodeResources]) -> int:
    """What the many-expert layout puts one actor on: every GPU, or every node of a CPU-only cluster."""
    gpus = sum(n.num_gpus for n in nodes)
    return gpus if gpus else len(nodes)


def device_actor_slots(names: list[str], nodes: list[NodeResources],
                       num_cpus_per_actor: float | None) -> list[ActorSlot]:
    """Slots for the many-expert layout: spread like any pool (replicas on different devices), but without
    num_cpus_per_actor each actor asks for its node's CPUs less one (left to the router, Ray and the OS), shared
    among the actors placed there - not at most one: an actor hosting a slice of every layer computes grouped
    matmuls on as many threads as it is given. (Giving it every core backfires: a torch thread pool that must
    share its cores with another busy process waits at every parallel region; measured 20x slower here.)"""
    slots = plan_actor_slots(names, nodes, num_cpus_per_actor)
    if num_cpus_per_actor is not None:
        return slots
    cpus = {n.node_id: n.num_cpus for n in nodes}
    per_node: dict[str, int] = {}
    for slot in slots:
        per_node[slot.node_id] = per_node.get(slot.node_id, 0) + 1

    def share(node: str) -> float:
        return math.floor(round(max(1.0, cpus[node] - 1) / per_node[node] * 100, 6)) / 100

    return [replace(slot, num_cpus=max(slot.num_cpus, share(slot.node_id))) for slot in slots]


def cluster_nodes() -> list[NodeResources]:
    return [
        NodeResources(n["NodeID"], n["Resources"].get("CPU", 0.0), int(n["Resources"].get("GPU", 0)))
        for n in ray.nodes() if n["Alive"]
    ]


def connect_actors(spec: PoolSpec) -> dict[str, ray.actor.ActorHandle]:
    """Handles to a running pool's actors, looked up by name (from any driver or Serve replica)."""
    return {name: ray.get_actor(name, namespace=NAMESPACE) for name in spec.actor_shards}


class ExpertPool:
    def __init__(self, spec: PoolSpec, num_cpus_per_actor: float | None = None, start_timeout_s: float = 180.0,
                 detached: bool = False, reuse: bool = False, slots: list[ActorSlot] | None = None):
        """detached: actors outlive this process (Serve-config deployments, where the builder exits).
        reuse: adopt actors that already run under these names instead of refusing to start."""
        self.spec = spec
        self.start_timeout_s = start_timeout_s
        self.detached = detached
        self.reuse = reuse
        if not reuse:
            clear_table()  # a fresh pool: a routing table an earlier deployment published on this cluster is stale
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
                ray.get_actor(slot.name, namespace=NAMESPACE)
            except ValueError:
                continue
            raise RuntimeError(
                f"actor '{slot.name}' already exists in namespace '{NAMESPACE}': another expertmesh is serving "
                "on this Ray cluster; stop it first"
            )
        for slot in self.slots:
            self.actors[slot.name] = start_expert_actor(slot, self.spec, detached=self.detached, reuse=self.reuse)
        self._wait_ready()

    def _wait_ready(self) -> None:
        pending = {handle.ready.remote(): name for name, handle in self.actors.items()}
        deadline = time.monotonic() + self.start_timeout_s
        bar = tqdm(total=len(pending), desc="expert actors ready", unit="actor", leave=False,
                   disable=not sys.stderr.isatty())
        try:
            while pending:
                done, _ = ray.wait(list(pending), num_returns=len(pending),
                                   timeout=max(0.0, deadline - time.monotonic()))
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
                ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)
            except ValueError:
                pass
        self.actors = {}
