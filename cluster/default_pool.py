"""The default expert pool's layout, pure: which actor hosts which shards, and the slots (node, CPUs, GPUs) they
ask for.

One actor per logical expert up to MANY_EXPERTS experts per layer (`expert-e{E}-r{R}`, names drills and tests rely
on); beyond that, or where those actors would share cores, one actor per device (GPU, or node without GPUs) hosting
a contiguous slice of every layer's experts. Takes the cluster as a list of NodeResources and never asks Ray, so it
is tested without a cluster; router_service/pool_layout.py feeds it the live nodes and router_service/expert_pool.py
starts what it plans (both re-export these names).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING

from .actor_slots import ActorSlot, NodeResources, plan_actor_slots
from .naming import expert_actor_name
from .routing_table import Shard

if TYPE_CHECKING:  # only its fields are read; the cluster layer does not import the model's modules at run time
    from ..experts.config import MoEModelConfig

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


def default_layout(cfg: MoEModelConfig, replicas_per_expert: int, nodes: list[NodeResources],
                   layout: str = "auto") -> str:
    """"per-expert" or "per-device" for the default pool. auto: one process per expert only when the model has at
    most MANY_EXPERTS experts per layer and each of those actors gets a GPU (GPU cluster) or a core (CPU cluster,
    one core left to the router) of its own. Otherwise per-expert actors share cores: on a 2-core machine 8
    actors + the router made every decode layer a round of up to 8 Ray calls, each actor woken on a busy core
    (measured: 30 ms a step at one stream against 17 ms with one actor per node;
    docs/benchmarks/results/bench/serve_overhead)."""
    if layout != "auto":
        return layout
    actors = cfg.num_experts * replicas_per_expert
    gpus = sum(n.num_gpus for n in nodes)
    room = gpus if gpus else sum(n.num_cpus for n in nodes) - 1
    return "per-expert" if cfg.num_experts <= MANY_EXPERTS and room >= actors else "per-device"
