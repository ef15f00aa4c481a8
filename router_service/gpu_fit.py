"""Start-up's placement checks on GPU nodes, before any actor loads a byte:

- which whole GPUs (and CPUs) the Serve router replicas keep (cluster/router_gpus.py), so the pool plans onto the
  rest and a replica asking for `router.gpus` finds room; one line when they cannot be placed;
- the memory check of the expert pool: probe each GPU node's memory (or take `experts.gpu_memory_gb`), check the
  planned slots by bytes (cluster/gpu_memory.py), and when they do not fit either ask Ray's autoscaler for the GPUs
  that are missing and wait (with progress) or stop with one line; and check a router replica's dense weights fit
  its GPU share.
"""

from __future__ import annotations

import logging
import time

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ..cluster.actor_slots import ActorSlot, NodeResources, plan_actor_slots
from ..cluster.gpu_memory import (
    actor_bytes_of,
    gpus_needed,
    min_distinct_gpus,
    overfull_gpus,
    shortfall_line,
    transition_room,
)
from ..cluster.memory_plan import GIB, RUNTIME_RESERVE_BYTES, model_memory
from ..cluster.router_gpus import (
    NO_RESERVATION,
    RouterReservation,
    expert_nodes,
    replicas_at_start,
    reservation_problem,
    reserve_router_gpus,
)
from ..cluster.routing_table import Shard
from ..experts.checkpoint import CheckpointReader
from ..experts.dtypes import read_checkpoint_dtype, resolve_dtype
from ..experts.errors import ConfigError
from .config import MeshConfig
from .expert_pool import cluster_nodes

log = logging.getLogger(__name__)
AUTOSCALER_STATUS_KEY = b"__autoscaling_status"  # the (v1) autoscaler monitor refreshes it while it runs


def probe_gpu_memory(nodes: list[NodeResources], timeout_s: float = 60.0) -> dict[str, int]:
    """node id -> bytes of its smallest GPU, from `nvidia-smi` on that node; nodes that cannot tell are left out."""

    @ray.remote(num_cpus=0)
    def total_mib() -> int | None:
        import subprocess

        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=20, check=True).stdout
            values = [int(line) for line in out.split() if line.strip().isdigit()]
            return min(values) if values else None
        except (OSError, subprocess.SubprocessError, ValueError):
            return None

    gpu_nodes = [n for n in nodes if n.num_gpus > 0]
    refs = {n.node_id: total_mib.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n.node_id, soft=False))
            .remote() for n in gpu_nodes}
    out: dict[str, int] = {}
    for node, ref in refs.items():
        try:
            mib = ray.get(ref, timeout=timeout_s)
        except Exception:  # noqa: BLE001 - a node that cannot answer is just unknown
            mib = None
        if mib:
            out[node] = mib * (1 << 20)
    return out


def autoscaler_running() -> bool:
    from ..cluster.mesh_store import raw_get  # Ray's own key, not a mesh's

    try:
        return raw_get(AUTOSCALER_STATUS_KEY) is not None
    except Exception:  # noqa: BLE001
        return False


def keep_router_gpus(config: MeshConfig, nodes: list[NodeResources],
                     prefer: tuple[str, ...] | dict = ()) -> RouterReservation:
    """The GPUs and CPUs the router replicas that must place at start keep (router.gpus x router.replicas, or the
    autoscale minimum). Raises ConfigError naming router.gpus when they cannot be placed - unless an autoscaler
    runs, which Serve's pending replicas then ask for a node - or when they would leave the experts no GPU."""
    router = config.router
    reservation = reserve_router_gpus(nodes, router.gpus, replicas_at_start(router.replicas, router.autoscale),
                                      router.replica_resources()["num_cpus"], prefer)
    problem = reservation_problem(nodes, reservation)
    if problem is None:
        if reservation.gpus:
            log.info("placement: %s; the expert pool plans onto the rest", reservation.describe())
        return reservation
    if reservation.unplaced and reservation.total_gpus < sum(n.num_gpus for n in nodes) and autoscaler_running():
        log.warning("%s; Serve's pending router replicas ask the autoscaler for a node", problem)
        return reservation
    raise ConfigError("router.gpus", problem)


def fit_gpu_memory(config: MeshConfig, reader: CheckpointReader, groups: dict[str, list[Shard]],
                   slots: list[ActorSlot] | None, reservation: RouterReservation = NO_RESERVATION
                   ) -> tuple[list[ActorSlot], RouterReservation]:
    """The slots to start (recomputed when the autoscaler added GPUs) and the router reservation they plan around,
    after checking they fit by bytes. slots None: spread the actors over the nodes less the reservation. CPU-only
    clusters, and GPU nodes whose memory is unknown (no override, nvidia-smi absent), are not checked by bytes."""
    nodes = cluster_nodes()
    settings = config.experts

    def plan(current_nodes: list[NodeResources], kept: RouterReservation) -> list[ActorSlot]:
        return slots if slots is not None else plan_actor_slots(list(groups), expert_nodes(current_nodes, kept),
                                                                settings.num_cpus_per_actor)

    planned = plan(nodes, reservation)
    if not any(n.num_gpus for n in nodes):
        return planned, reservation
    memory = _gpu_memory(settings.gpu_memory_gb, nodes)
    if not memory:
        log.warning("GPU memory of the cluster's nodes is unknown (no nvidia-smi): the pool is placed by count only;"
                    " give --gpu-memory-gb to check it by bytes")
        return planned, reservation
    dtype = resolve_dtype(config.model.dtype, read_checkpoint_dtype(reader.model_dir), on_gpu=True)
    sizes = model_memory(reader.config, dtype)
    _check_router_fits(config, reservation, memory, sizes.dense_bytes)
    actor_bytes = actor_bytes_of(groups, sizes.shard_bytes)
    if settings.memory_gb is not None:  # memory tiers: an actor holds at most its budget on its GPU (README: Offload)
        actor_bytes = {name: min(size, int(settings.memory_gb * GIB)) for name, size in actor_bytes.items()}
    utilization = settings.gpu_memory_utilization
    overfull = overfull_gpus(planned, actor_bytes, memory, utilization)
    if not overfull:
        if not transition_room(planned, actor_bytes, memory, utilization):
            log.warning("the expert pool fits, but no GPU has room to load a replacement actor beside a serving one: "
                        "live remaps, rebalancing and restores onto survivors will need more GPUs (or fewer shards "
                        "per actor)")
        return planned, reservation
    gpu_bytes = min(memory.values())
    try:
        need = gpus_needed(actor_bytes, gpu_bytes, utilization, min_distinct_gpus(groups))
    except ValueError as exc:
        raise ConfigError("experts", str(exc)) from None
    have = sum(n.num_gpus for n in expert_nodes(nodes, reservation))
    line = shortfall_line(need, have, gpu_bytes, overfull, reservation.total_gpus)
    if need <= have:
        raise ConfigError("experts", f"{line}; the layout packs them unevenly: give a placement "
                                     f"(`expertmesh plan`) or fewer shards per actor")
    if not autoscaler_running() or settings.gpu_wait_s <= 0:
        raise ConfigError("experts", line)
    return _wait_for_gpus(config, need, line, plan, actor_bytes, reservation)


def _check_router_fits(config: MeshConfig, reservation: RouterReservation, memory: dict[str, int],
                       dense_bytes: int) -> None:
    """A router replica's dense weights (at the serving dtype) and the runtime reserve fit its share of a kept GPU
    at router.gpu_memory_utilization (its KV cache then takes what is left, README: Paged KV cache)."""
    router = config.router
    known = [memory[node] for node in reservation.gpus if node in memory]
    if not known:
        return
    share = min(known) * min(1.0, router.gpus) * router.gpu_memory_utilization
    need = dense_bytes + RUNTIME_RESERVE_BYTES
    if need > share:
        raise ConfigError("router.gpus", f"a router replica needs {need / GIB:.1f} GiB on its GPU (dense weights "
                                         f"{dense_bytes / GIB:.1f} GiB + {RUNTIME_RESERVE_BYTES / GIB:.0f} GiB "
                                         f"runtime reserve); its share of a {min(known) / GIB:.1f} GiB GPU is "
                                         f"{share / GIB:.1f} GiB at router.gpus {router.gpus:g} x "
                                         f"router.gpu_memory_utilization {router.gpu_memory_utilization}")


def _gpu_memory(override_gb: float | None, nodes: list[NodeResources]) -> dict[str, int]:
    if override_gb is not None:
        return {n.node_id: int(override_gb * GIB) for n in nodes if n.num_gpus > 0}
    return probe_gpu_memory(nodes)


def _wait_for_gpus(config: MeshConfig, need: int, line: str, plan, actor_bytes: dict[str, int],
                   reservation: RouterReservation) -> tuple[list[ActorSlot], RouterReservation]:
    """Ask the autoscaler for `need` GPUs for experts plus the ones kept for router replicas, and wait until the
    slots fit (or experts.gpu_wait_s passes). The reservation stays on its nodes as nodes join."""
    from ray.autoscaler.sdk import request_resources

    settings = config.experts
    wait_s = settings.gpu_wait_s
    log.warning("%s: asking the autoscaler for %d GPUs and waiting up to %.0f s", line,
                need + reservation.total_gpus, wait_s)
    request_resources(bundles=[{"GPU": 1}] * (need + reservation.total_gpus))
    deadline = time.monotonic() + wait_s
    last_report = 0.0
    while True:
        nodes = cluster_nodes()
        if reservation.replicas:
            reservation = reserve_router_gpus(nodes, reservation.gpus_per_replica, reservation.replicas,
                                              config.router.replica_resources()["num_cpus"], reservation.gpus)
        have = sum(n.num_gpus for n in expert_nodes(nodes, reservation))
        if have >= need:
            planned = plan(nodes, reservation)
            memory = _gpu_memory(settings.gpu_memory_gb, nodes)
            if not overfull_gpus(planned, actor_bytes, memory, settings.gpu_memory_utilization):
                log.warning("the cluster has %d GPUs for experts now: starting the expert pool", have)
                return planned, reservation
        if time.monotonic() > deadline:
            raise ConfigError("experts", f"{line}; the autoscaler did not add them within {wait_s:.0f} s "
                                         f"(experts.gpu_wait_s)")
        if time.monotonic() - last_report > 10:
            log.warning("waiting for GPUs: %d of %d for experts", have, need)
            last_report = time.monotonic()
        time.sleep(1.0)
