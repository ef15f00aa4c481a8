"""Start-up's memory check of the expert pool on GPU nodes: probe each GPU node's memory (or take
`experts.gpu_memory_gb`), check the planned slots by bytes (cluster/gpu_memory.py), and when they do not fit either
ask Ray's autoscaler for the GPUs that are missing and wait (with progress) or stop with one line — before any actor
loads a byte.
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
from ..cluster.memory_plan import GIB, model_memory
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
    from ray.experimental import internal_kv

    try:
        return internal_kv._internal_kv_get(AUTOSCALER_STATUS_KEY) is not None
    except Exception:  # noqa: BLE001
        return False


def fit_gpu_memory(config: MeshConfig, reader: CheckpointReader, groups: dict[str, list[Shard]],
                   slots: list[ActorSlot] | None) -> list[ActorSlot] | None:
    """The slots to start (recomputed when the autoscaler added GPUs), after checking they fit by bytes. CPU-only
    clusters, and GPU nodes whose memory is unknown (no override, nvidia-smi absent), are not checked."""
    nodes = cluster_nodes()
    if not any(n.num_gpus for n in nodes):
        return slots
    settings = config.experts

    def plan(current_nodes: list[NodeResources]) -> list[ActorSlot]:
        return slots if slots is not None else plan_actor_slots(list(groups), current_nodes,
                                                                settings.num_cpus_per_actor)

    planned = plan(nodes)
    memory = _gpu_memory(settings.gpu_memory_gb, nodes)
    if not memory:
        log.warning("GPU memory of the cluster's nodes is unknown (no nvidia-smi): the pool is placed by count only;"
                    " give --gpu-memory-gb to check it by bytes")
        return planned
    dtype = resolve_dtype(config.model.dtype, read_checkpoint_dtype(reader.model_dir), on_gpu=True)
    actor_bytes = actor_bytes_of(groups, model_memory(reader.config, dtype).shard_bytes)
    if settings.memory_gb is not None:  # memory tiers: an actor holds at most its budget on its GPU (README: Offload)
        actor_bytes = {name: min(size, int(settings.memory_gb * GIB)) for name, size in actor_bytes.items()}
    utilization = settings.gpu_memory_utilization
    overfull = overfull_gpus(planned, actor_bytes, memory, utilization)
    if not overfull:
        if not transition_room(planned, actor_bytes, memory, utilization):
            log.warning("the expert pool fits, but no GPU has room to load a replacement actor beside a serving one: "
                        "live remaps, rebalancing and restores onto survivors will need more GPUs (or fewer shards "
                        "per actor)")
        return planned
    gpu_bytes = min(memory.values())
    try:
        need = gpus_needed(actor_bytes, gpu_bytes, utilization, min_distinct_gpus(groups))
    except ValueError as exc:
        raise ConfigError("experts", str(exc)) from None
    have = sum(n.num_gpus for n in nodes)
    line = shortfall_line(need, have, gpu_bytes, overfull)
    if need <= have:
        raise ConfigError("experts", f"{line}; the layout packs them unevenly: give a placement "
                                     f"(`expertmesh plan`) or fewer shards per actor")
    if not autoscaler_running() or settings.gpu_wait_s <= 0:
        raise ConfigError("experts", line)
    return _wait_for_gpus(need, line, settings.gpu_wait_s, plan, actor_bytes, settings.gpu_memory_gb, utilization)


def _gpu_memory(override_gb: float | None, nodes: list[NodeResources]) -> dict[str, int]:
    if override_gb is not None:
        return {n.node_id: int(override_gb * GIB) for n in nodes if n.num_gpus > 0}
    return probe_gpu_memory(nodes)


def _wait_for_gpus(need: int, line: str, wait_s: float, plan, actor_bytes: dict[str, int],
                   override_gb: float | None, utilization: float) -> list[ActorSlot]:
    """Ask the autoscaler for `need` GPUs in all and wait until the slots fit (or wait_s passes)."""
    from ray.autoscaler.sdk import request_resources

    log.warning("%s: asking the autoscaler for %d GPUs and waiting up to %.0f s", line, need, wait_s)
    request_resources(bundles=[{"GPU": 1}] * need)
    deadline = time.monotonic() + wait_s
    last_report = 0.0
    while True:
        nodes = cluster_nodes()
        have = sum(n.num_gpus for n in nodes)
        if have >= need:
            planned = plan(nodes)
            memory = _gpu_memory(override_gb, nodes)
            if not overfull_gpus(planned, actor_bytes, memory, utilization):
                log.warning("the cluster has %d GPUs now: starting the expert pool", have)
                return planned
        if time.monotonic() > deadline:
            raise ConfigError("experts", f"{line}; the autoscaler did not add them within {wait_s:.0f} s "
                                         f"(experts.gpu_wait_s)")
        if time.monotonic() - last_report > 10:
            log.warning("waiting for GPUs: %d of %d", have, need)
            last_report = time.monotonic()
        time.sleep(1.0)
