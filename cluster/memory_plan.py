"""Does a model fit a cluster, and how many GPUs of what memory does it need? Pure arithmetic over the checkpoint's
tensor shapes (experts/weights.py's name map, so every family and its quantised formats count as served: weights
are dequantised to the serving dtype on load), no Ray.

Accounting (the same as the planned layout's, cluster/shard_placement.py `Topology.from_memory`):
  - A shard = one (layer, expert): its gate/up/down at the serving dtype. An expert GPU hosts one actor holding
    `slots` shards of *every* MoE layer (the planned layout), so it needs slots x layers x shard bytes.
  - Usable GPU memory = memory x gpu_memory_utilization, minus a runtime reserve (CUDA context, allocator slack,
    activations of one call), minus — for live remap — one layer-slot of headroom so a shard set can load beside the
    one it replaces before that one drains.
  - Replicas of a shard sit on different GPUs: at least `replicas` expert GPUs.
  - Router replicas keep whole GPUs the experts never share (cluster/router_gpus.py, the rule start-up places by):
    `router_gpus` per replica, fractions packed floor(1/g) to a GPU, on the expert nodes' type or on nodes of their
    own (`router_node`). A replica needs dense weights + its KV cache budget + the runtime reserve within its share.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..experts.config import MoEModelConfig

GIB = 1 << 30
RUNTIME_RESERVE_BYTES = 2 * GIB  # CUDA context + allocator slack + one call's activations, per GPU

# nvidia-smi's memory of each GPU (MiB, as the driver reports it; "24 GB" cards have a little less).
GPU_MEMORY_MIB = {
    "A10G": 23_028, "L4": 23_034, "L40S": 46_068, "A100-40GB": 40_960, "A100-80GB": 81_920,
    "H100": 81_559, "H200": 143_771, "B200": 183_359,
}
# Cloud instance types: (GPU type, GPUs per node).
NODE_TYPES = {
    "aws:g5.12xlarge": ("A10G", 4), "aws:g5.48xlarge": ("A10G", 8), "aws:g6e.xlarge": ("L40S", 1),
    "aws:g6e.12xlarge": ("L40S", 4), "aws:g6e.48xlarge": ("L40S", 8), "aws:p4d.24xlarge": ("A100-40GB", 8),
    "aws:p4de.24xlarge": ("A100-80GB", 8), "aws:p5.48xlarge": ("H100", 8), "aws:p5en.48xlarge": ("H200", 8),
    "gcp:g2-standard-12": ("L4", 1), "gcp:g2-standard-48": ("L4", 4), "gcp:g2-standard-96": ("L4", 8),
    "gcp:a2-highgpu-8g": ("A100-40GB", 8), "gcp:a2-ultragpu-8g": ("A100-80GB", 8),
    "gcp:a3-highgpu-8g": ("H100", 8), "gcp:a3-ultragpu-8g": ("H200", 8),
}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class ModelMemory:
    """What a model takes at the serving dtype."""

    dense_bytes: int  # everything the router holds (embeddings, attention, norms, gates, shared experts, lm_head)
    shard_bytes: int  # one (layer, expert)
    moe_layers: int
    experts: int
    kv_bytes_per_token: int  # all layers
    state_bytes_per_sequence: int = 0  # linear layers' conv + recurrent state (Qwen3-Next, Qwen3.5, Kimi-Linear)

    @property
    def expert_bytes(self) -> int:
        return self.shard_bytes * self.moe_layers * self.experts

    @property
    def total_bytes(self) -> int:
        return self.dense_bytes + self.expert_bytes


def model_memory(cfg: MoEModelConfig, dtype: str) -> ModelMemory:
    """Bytes of the model at `dtype`, from the tensor shapes its config implies."""
    from ..experts.weights import dense_tensor_names, expert_shard_names  # torch: only where a model is read

    size = DTYPE_BYTES[dtype]
    numel = lambda shape: math.prod(shape)  # noqa: E731
    dense = sum(numel(shape) for shape in dense_tensor_names(cfg).values())
    shard = sum(numel(shape) for shape in expert_shard_names(cfg, [(cfg.moe_layers[0], 0)]).values())
    return ModelMemory(dense * size, shard * size, len(cfg.moe_layers), cfg.num_experts,
                       kv_bytes_per_token(cfg, dtype), state_bytes_per_sequence(cfg, dtype))


def state_bytes_per_sequence(cfg: MoEModelConfig, dtype: str) -> int:
    """What one sequence's linear-attention state takes over all its linear layers (experts/state_cache.py); it is
    a fixed size whatever the sequence's length, and comes out of the router's KV cache budget."""
    if not cfg.linear_layers:
        return 0
    return len(cfg.linear_layers) * cfg.gated_delta.state_bytes(DTYPE_BYTES[dtype])


def kv_bytes_per_token(cfg: MoEModelConfig, dtype: str) -> int:
    """What one token stores in the KV cache over all layers: keys and values (GQA; MiMo-V2-Flash: per layer its own
    KV heads, values v_head_dim wide), or MLA's latent + rope key, plus the DSA indexer's key on the layers that
    run an indexer (DeepSeek-V3.2 all, GLM-5 its "full" ones). Linear-attention layers store nothing per token
    (their state is per sequence: state_bytes_per_sequence)."""
    size = DTYPE_BYTES[dtype]
    if cfg.attention_kind == "mla":  # Kimi-Linear: only its MLA layers, not its KDA ones
        attention_layers = cfg.num_layers - len(cfg.linear_layers)
        index = sum(cfg.index_head_dim for i in range(cfg.num_layers) if cfg.has_indexer(i))
        return (attention_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + index) * size
    v_dim = cfg.v_head_dim or cfg.head_dim
    return sum(cfg.kv_heads(i) * (cfg.head_dim + v_dim) for i in range(cfg.num_layers)
               if not cfg.is_linear_layer(i)) * size


def slots_per_gpu(gpu_bytes: int, shard_bytes: int, layers: int, utilization: float = 0.9,
                  reserve_bytes: int = RUNTIME_RESERVE_BYTES, remap_headroom: bool = True) -> tuple[int, bool]:
    """(shards of every MoE layer one expert GPU holds, whether one such set is left free for live remap). Without
    room for the headroom the GPU is filled (transition False). The planner's Topology.from_memory uses this too."""
    layer_slot = shard_bytes * layers
    budget = gpu_bytes * utilization - reserve_bytes
    if layer_slot <= 0:
        return 0, False
    if remap_headroom:
        slots = int((budget - layer_slot) // layer_slot)
        if slots >= 1:
            return slots, True
    return max(0, int(budget // layer_slot)), False


@dataclass(frozen=True)
class ClusterFit:
    gpu_type: str
    gpu_memory_gib: float
    usable_gib: float  # per expert GPU, for shards (after utilization, reserve and transition headroom)
    slots_per_gpu: int  # shards of every MoE layer per expert GPU
    expert_gpus: int  # GPUs the experts need at this replica count
    router_gpus: int  # whole GPUs kept for the router replicas (no expert shares them)
    gpus_per_node: int
    nodes: int  # nodes needed, routers' included (of the router node type too, when given)
    expert_gib_per_gpu: float
    router_gib: float  # dense weights + KV budget + reserve, per router replica
    router_fits: bool
    fits_available: bool | None  # against `available_gpus`, when given
    transition_room: bool  # False: no layer-slot of headroom is left; live remap must move fewer shards at once
    router_replicas: int = 1  # router replicas placed at start
    router_gpus_per_replica: float = 1.0  # router.gpus (0: routers on the CPU, nothing kept)
    router_nodes: int = 0  # nodes of the router node type (0: routers keep GPUs of the expert nodes' type)
    layout: str = ""  # which GPUs the routers keep and where the experts go, in words

    def as_dict(self) -> dict:
        return asdict(self)


def plan_fit(mem: ModelMemory, gpu_type: str, gpus_per_node: int, replicas: int = 1, routers: int = 1,
             utilization: float = 0.9, kv_cache_gib: float = 4.0, gpu_memory_gib: float | None = None,
             available_gpus: int | None = None, router_gpus: float = 1.0,
             router_node: tuple[str, str, int] | None = None) -> ClusterFit:
    """How `mem` packs onto GPUs of `gpu_type` (memory from GPU_MEMORY_MIB unless gpu_memory_gib is given), with
    `routers` router replicas of `router_gpus` GPUs each kept apart: on nodes of this type, or on nodes of their
    own, router_node = (name, GPU type, GPUs per node)."""
    from .actor_slots import NodeResources
    from .router_gpus import expert_nodes, reserve_router_gpus

    if not 0 < utilization <= 1:
        raise ValueError(f"gpu_memory_utilization: must be in (0, 1], got {utilization}")
    if replicas < 1 or routers < 0:
        raise ValueError("replicas must be >= 1 and routers >= 0")
    if router_gpus < 0 or (router_gpus > 1 and router_gpus != int(router_gpus)):
        raise ValueError(f"router_gpus: must be a fraction or a whole number >= 0, got {router_gpus}")
    memory = gpu_memory_gib * GIB if gpu_memory_gib is not None else GPU_MEMORY_MIB[gpu_type] * (1 << 20)
    budget = memory * utilization - RUNTIME_RESERVE_BYTES
    layer_slot = mem.shard_bytes * mem.moe_layers  # one expert of every MoE layer
    slots, transition_room = slots_per_gpu(int(memory), mem.shard_bytes, mem.moe_layers, utilization)
    if slots < 1:
        raise ValueError(f"one expert of every layer ({layer_slot / GIB:.1f} GiB) does not fit a {gpu_type} "
                         f"({memory / GIB:.1f} GiB at utilization {utilization})")
    slots = min(slots, mem.experts)
    expert_gpus = max(replicas, math.ceil(mem.experts * replicas / slots))
    asked = f"{routers} router replica{'s' if routers != 1 else ''} x {router_gpus:g} GPU"

    def reserve(count: int, per_node: int):
        nodes = [NodeResources(f"node-{i + 1:03d}", 0.0, per_node) for i in range(count)]
        return nodes, reserve_router_gpus(nodes, router_gpus, routers)

    if router_node is None:  # routers keep GPUs of this node type; the fewest nodes that hold both
        count = max(1, math.ceil(expert_gpus / gpus_per_node))
        while True:
            nodes, kept = reserve(count, gpus_per_node)
            free = sum(n.num_gpus for n in expert_nodes(nodes, kept))
            if not kept.unplaced and free >= expert_gpus:
                break
            if count > expert_gpus + routers * max(1, int(router_gpus)):
                raise ValueError(f"{asked} does not fit a node of {gpus_per_node} GPUs")
            count += 1
        router_nodes, total_nodes, router_memory = 0, count, memory
        where = ", ".join(f"{n} on node {int(node[5:])}" for node, n in sorted(kept.gpus.items()))
        layout = (f"{count} node{'s' if count != 1 else ''} of {gpus_per_node} GPUs: "
                  + (f"{kept.total_gpus} GPU{'s' if kept.total_gpus != 1 else ''} kept for {asked} ({where}); "
                     if kept.total_gpus else "routers on the CPU; ")
                  + f"experts on {expert_gpus} of the other {free}")
    else:
        name, router_type, router_per_node = router_node
        count = 0
        while True:
            _, kept = reserve(count, router_per_node)
            if not kept.unplaced:
                break
            if count >= routers * max(1, int(router_gpus)):
                raise ValueError(f"{asked} does not fit a {name} ({router_per_node} GPUs)")
            count += 1
        router_nodes, router_memory = count, GPU_MEMORY_MIB[router_type] * (1 << 20)
        total_nodes = count + math.ceil(expert_gpus / gpus_per_node)
        layout = ((f"router: {count} x {name} ({kept.total_gpus} GPU{'s' if kept.total_gpus != 1 else ''} kept "
                   f"for {asked}); " if kept.total_gpus else "routers on the CPU; ")
                  + f"experts: {total_nodes - count} node{'s' if total_nodes - count != 1 else ''} of "
                    f"{gpus_per_node} GPUs ({expert_gpus} GPUs)")
    router_bytes = mem.dense_bytes + kv_cache_gib * GIB + RUNTIME_RESERVE_BYTES
    share = min(1.0, router_gpus) if router_gpus > 0 else 1.0
    return ClusterFit(
        gpu_type=gpu_type, gpu_memory_gib=round(memory / GIB, 1), usable_gib=round((budget - layer_slot) / GIB, 1),
        slots_per_gpu=slots, expert_gpus=expert_gpus, router_gpus=kept.total_gpus, gpus_per_node=gpus_per_node,
        nodes=total_nodes,
        expert_gib_per_gpu=round(min(slots, math.ceil(mem.experts * replicas / expert_gpus)) * layer_slot / GIB, 1),
        router_gib=round(router_bytes / GIB, 1), router_fits=router_bytes <= router_memory * utilization * share,
        fits_available=None if available_gpus is None else expert_gpus + kept.total_gpus <= available_gpus,
        transition_room=transition_room, router_replicas=routers, router_gpus_per_replica=router_gpus,
        router_nodes=router_nodes, layout=layout,
    )


def missing_gpus_line(fit: ClusterFit, available_gpus: int) -> str:
    """The one line a start-up prints when the model does not fit the cluster it found."""
    need = fit.expert_gpus + fit.router_gpus
    return (f"the model needs {need} GPUs of {fit.gpu_memory_gib:.0f} GiB ({fit.expert_gpus} for experts at "
            f"{fit.expert_gib_per_gpu:.1f} GiB each, {fit.router_gpus} for routers at {fit.router_gib:.1f} GiB); the "
            f"cluster has {available_gpus}: {need - available_gpus} missing")


@dataclass(frozen=True)
class StoredBytes:
    """A checkpoint's bytes as stored (its safetensors headers' sizes: the checkpoint's dtype, FP8/MXFP4 packed),
    which is what a node's Hub cache holds; experts/model_source.py:stored_bytes reads them."""

    dense: int  # everything but the routed experts (FP8 scales included)
    shard: int  # one (layer, expert)
    metadata: int  # config, tokenizer files, index, and every safetensors file's header
    moe_layers: int
    experts: int

    @property
    def whole(self) -> int:
        return self.metadata + self.dense + self.shard * self.moe_layers * self.experts


def stored_bytes(reader) -> StoredBytes:
    """StoredBytes of the checkpoint a CheckpointReader opened (folder or Hub repo), from headers and file sizes."""
    from ..experts.fp8 import scale_names
    from ..experts.model_source import METADATA_FILES
    from ..experts.weights import dense_tensor_names, expert_layout, expert_shard_bytes

    cfg = reader.config
    dense = dense_tensor_names(cfg, expert_layout(cfg, reader.has), reader.has)
    if cfg.fp8_block is not None:
        dense |= scale_names(reader, dense, cfg.fp8_block)
    shards = [(layer, e) for layer in cfg.moe_layers for e in range(cfg.num_experts)]
    files = sum(path.stat().st_size for name in METADATA_FILES if (path := reader.model_dir / name).is_file())
    return StoredBytes(dense=reader.nbytes(dense), shard=expert_shard_bytes(reader, shards) // max(1, len(shards)),
                       metadata=files + reader.header_bytes(), moe_layers=len(cfg.moe_layers),
                       experts=cfg.num_experts)


def disk_per_node(stored: StoredBytes, slots_per_gpu: int, expert_gpus: int, gpus_per_node: int,
                  replicas: int = 1) -> dict[str, int]:
    """Bytes each node's Hub cache needs when every process fetches only what it reads (experts/hub_fetch.py):

      head         config, tokenizer, index and headers (the driver checks shapes; it reads no tensor)
      router_node  + the dense tensors (per node hosting a router replica)
      expert_node  + the shards of a full node of expert GPUs: each GPU hosts min(slots, experts x replicas /
                   expert GPUs) experts of every MoE layer (plan_fit's layout); replicas of one expert on one node
                   share its cached bytes, so a node never needs more than every expert once
      whole        the whole checkpoint, what whole-file downloads put on every node
    A node hosting a router and expert actors needs router_node + expert_node - head."""
    assert slots_per_gpu >= 1 and expert_gpus >= 1 and gpus_per_node >= 1 and replicas >= 1
    per_gpu = min(slots_per_gpu, math.ceil(stored.experts * replicas / expert_gpus))
    node_experts = min(stored.experts, min(gpus_per_node, expert_gpus) * per_gpu)
    return {
        "head": stored.metadata,
        "router_node": stored.metadata + stored.dense,
        "expert_node": stored.metadata + node_experts * stored.moe_layers * stored.shard,
        "whole": stored.whole,
    }
