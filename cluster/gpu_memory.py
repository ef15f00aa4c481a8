"""Does an expert pool's layout fit its GPUs' memory? Pure arithmetic over actor slots (cluster/actor_slots.py) and
bytes per actor (cluster/memory_plan.py's accounting), no Ray.

Ray places actors by GPU *fraction*, not bytes: two 21 GiB actors sharing a 24 GiB A10G start fine and then run out
of memory loading. So before any actor starts, the pool's slots are checked against each GPU's memory (probed on
its node, or given): per GPU, the bytes of the actors planned onto it must stay within memory x utilization minus
the runtime reserve. When they do not, the start-up asks the autoscaler for the GPUs that are missing (and waits),
or stops with one line saying how many GPUs of what memory are missing.
"""

from __future__ import annotations

from collections.abc import Mapping

from .actor_slots import ActorSlot
from .memory_plan import GIB, RUNTIME_RESERVE_BYTES

GpuKey = tuple[str, int]  # (node id, GPU index on that node)


def gpu_loads(slots: list[ActorSlot], actor_bytes: Mapping[str, int]) -> dict[GpuKey, int]:
    """Bytes planned onto each GPU (actors without a GPU are not counted)."""
    loads: dict[GpuKey, int] = {}
    for slot in slots:
        if slot.num_gpus > 0 and slot.gpu_slot is not None:
            key = (slot.node_id, slot.gpu_slot)
            loads[key] = loads.get(key, 0) + actor_bytes.get(slot.name, 0)
    return loads


def usable_bytes(gpu_bytes: int, utilization: float) -> int:
    return int(gpu_bytes * utilization) - RUNTIME_RESERVE_BYTES


def overfull_gpus(slots: list[ActorSlot], actor_bytes: Mapping[str, int], gpu_bytes: Mapping[str, int],
                  utilization: float) -> list[tuple[GpuKey, int, int]]:
    """(GPU, planned bytes, usable bytes) of every GPU whose planned actors do not fit; nodes whose GPU memory is
    unknown (not in gpu_bytes) are skipped."""
    out = []
    for key, load in sorted(gpu_loads(slots, actor_bytes).items()):
        node = key[0]
        if node in gpu_bytes and load > usable_bytes(gpu_bytes[node], utilization):
            out.append((key, load, usable_bytes(gpu_bytes[node], utilization)))
    return out


def transition_room(slots: list[ActorSlot], actor_bytes: Mapping[str, int], gpu_bytes: Mapping[str, int],
                    utilization: float) -> bool:
    """Whether some GPU can load the largest actor beside what it already holds: what a live remap (a new actor
    version loading before the old one drains) and a restore onto a survivor need. Unknown memory counts as no."""
    largest = max(actor_bytes.values(), default=0)
    loads = gpu_loads(slots, actor_bytes)
    for (node, _), load in loads.items():
        if node in gpu_bytes and usable_bytes(gpu_bytes[node], utilization) - load >= largest:
            return True
    return False


def gpus_needed(actor_bytes: Mapping[str, int], gpu_bytes: int, utilization: float, min_gpus: int = 1) -> int:
    """GPUs of `gpu_bytes` that hold these actors packed by bytes (first-fit decreasing; an actor never spans GPUs).
    Raises ValueError when one actor alone does not fit a GPU."""
    usable = usable_bytes(gpu_bytes, utilization)
    bins: list[int] = []
    for size in sorted(actor_bytes.values(), reverse=True):
        if size > usable:
            raise ValueError(f"one expert actor needs {size / GIB:.1f} GiB; a GPU of {gpu_bytes / GIB:.1f} GiB holds "
                             f"{usable / GIB:.1f} GiB at utilization {utilization} (use more actors with fewer shards "
                             f"each, a larger GPU, or a smaller dtype)")
        for i, used in enumerate(bins):
            if used + size <= usable:
                bins[i] += size
                break
        else:
            bins.append(size)
    return max(len(bins), min_gpus)


def shortfall_line(need: int, have: int, gpu_bytes: int, overfull: list[tuple[GpuKey, int, int]],
                   kept_for_routers: int = 0) -> str:
    """The one line a start-up prints (or logs while it waits for the autoscaler). have: GPUs the experts may use,
    i.e. without the ones kept for router replicas (cluster/router_gpus.py), which the line names apart."""
    worst = max(overfull, key=lambda o: o[1] - o[2]) if overfull else None
    detail = "" if worst is None else (f"; e.g. GPU {worst[0][1]} of node {worst[0][0][:12]} would hold "
                                       f"{worst[1] / GIB:.1f} GiB of {worst[2] / GIB:.1f} usable")
    kept = f" besides the {kept_for_routers} kept for router replicas" if kept_for_routers else ""
    return (f"the expert actors need {need} GPUs of {gpu_bytes / GIB:.0f} GiB by memory, the cluster has {have}"
            f"{kept}: {max(0, need - have)} missing{detail}")


def actor_bytes_of(actor_shards: Mapping[str, list], shard_bytes: int) -> dict[str, int]:
    """Bytes each actor holds: its shards x the bytes of one (layer, expert) at the serving dtype."""
    return {name: len(shards) * shard_bytes for name, shards in actor_shards.items()}


def min_distinct_gpus(actor_shards: Mapping[str, list]) -> int:
    """Replicas of a shard sit on different GPUs: at least as many GPUs as a shard has replicas."""
    count: dict[tuple, int] = {}
    for shards in actor_shards.values():
        for shard in shards:
            key = tuple(shard)
            count[key] = count.get(key, 0) + 1
    return max(count.values(), default=1)

