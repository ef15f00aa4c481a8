"""A latency model of expertmesh's decode step, and the per-step choice of two micro-batches (ping-pong overlap).
Pure arithmetic: no torch, no Ray (constants in cluster/cost_profiles.py, the CPU fit in cluster/cost_calibration.py).

Per MoE layer, for a step of T new tokens over sequences with C cached positions each:

  router dense   attention + norms + gate (+ shared experts) on the router's device: roofline(FLOP, weight + KV
                 bytes) + eager ops x launch overhead, or at decode on a GPU one CUDA graph replay per MoE layer
                 (experts/decode_graphs.py) + the few copies that stay eager
  plan           the router's host work: a + b x slots + c x calls (fitted on this CPU), / host speed
  transport      first call's round trip + issue cost per further call + device waits + rows' bytes (through the
                 host: PCIe down, host copies, PCIe up; or device to device over NVLink)
  expert         the busiest expert device: roofline(FLOP of its rows, bytes of the shards it reads) + ops; on the
                 CPU: (hit shards' weight bytes / read rate + the experts' FLOP / FLOP per CPU-second) / the cores
                 they get
  combine        weighted sum of the returned rows on the router's device
Layers without experts run their dense MLP on the router; the lm_head runs once per step. tokens/s = T / step.

Overlap (experts/modeling.py, MegaScale-Infer's ping-pong, arXiv:2504.02263): two micro-batches of T/2 take turns,
so one's expert round runs while the router computes the other. Per layer the step then takes
max(2 R, R + X, 2 E) for half-batch router work R, round X and expert occupancy E, against R' + X' for the whole
batch: it pays when the fixed costs of a half (latency, weight reads) leave something of min(dense, round) to hide.
When router and experts share the same cores (the CPU), nothing runs side by side: it never pays.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace

from .cost_profiles import (
    DENSE_OPS_PER_LAYER,
    GRAPH_MAX_BATCH,
    GRAPHED_EAGER_OPS_PER_MOE_LAYER,
    OPS_PER_EXPERT_CALL,
    OPS_PER_SHARD,
    PLAN_FIXED_S,
    PLAN_PER_CALL_S,
    PLAN_PER_SLOT_S,
    HardwareProfile,
    ModelShape,
    TransportProfile,
)

OVERLAP_MARGIN = 0.05  # overlap must save 5 % of the plain step: the model is not exact enough to chase less
GIB = 1 << 30
RESERVE_BYTES = 2 * GIB  # per GPU: CUDA context, allocator slack (cluster/memory_plan.py RUNTIME_RESERVE_BYTES)
EXPERT_BYTES = {"bf16": 2.0, "int8": 1.0, "int4": 0.5}


@dataclass(frozen=True)
class Layout:
    """Where the experts run: `devices` expert devices, one actor each (the per-device layout) or one per expert."""

    devices: int
    actors: int
    expert_bytes: float = 2.0  # bytes per expert weight (bf16 2, int8 1, int4 0.5)
    act_bytes: float = 2.0  # bytes per activation / dense weight element (bf16)
    shared_device: bool = False  # router and experts on one GPU: their kernels take turns on it


@dataclass(frozen=True)
class StepShape:
    sequences: int
    tokens: int  # new tokens in the step (decode: one per sequence)
    context: int  # cached positions per sequence (mean)

    def half(self) -> StepShape:
        return StepShape(max(1, self.sequences // 2), max(1, self.tokens // 2), self.context)


@dataclass(frozen=True)
class Profile:
    """Everything a prediction needs besides the step."""

    model: ModelShape
    hardware: HardwareProfile
    transport: TransportProfile
    layout: Layout


@dataclass(frozen=True)
class LayerTime:
    """One MoE layer's components, seconds."""

    router_dense: float
    plan: float
    transport: float
    expert: float
    combine: float

    @property
    def router_side(self) -> float:
        return self.router_dense + self.plan + self.combine

    @property
    def total(self) -> float:
        return self.router_dense + self.plan + self.transport + self.expert + self.combine


@dataclass
class StepPrediction:
    tokens: int
    moe_layer: LayerTime  # per MoE layer, the whole batch
    moe_layer_s: float  # what a MoE layer takes, overlapped or not
    dense_layer_s: float  # a layer without experts
    head_s: float
    step_s: float
    tokens_per_s: float
    overlap: bool
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        d = asdict(self)
        d["moe_layer"] = {k: round(v * 1e6, 1) for k, v in asdict(self.moe_layer).items()}  # us
        d["moe_layer"]["total"] = round(self.moe_layer.total * 1e6, 1)
        for k in ("moe_layer_s", "dense_layer_s", "head_s", "step_s"):
            d[k] = round(d[k], 6)
        d["tokens_per_s"] = round(self.tokens_per_s, 1)
        return d


# ---- FLOP and bytes ------------------------------------------------------------------------------------------


def expected_hit(experts: int, top_k: int, tokens: float) -> float:
    """Expected distinct experts hit when `tokens` tokens each pick top_k of `experts` uniformly."""
    return experts * (1.0 - (1.0 - top_k / experts) ** tokens)


def router_layer_params(m: ModelShape, moe: bool) -> int:
    """Weights the router reads for one layer: attention + the gate and shared experts, or the dense MLP."""
    if moe:
        shared = 3 * m.hidden_size * m.shared_expert_intermediate_size
        return m.attention_params + m.hidden_size * m.num_experts + shared
    return m.attention_params + 3 * m.hidden_size * m.dense_intermediate_size


def router_layer_flops(m: ModelShape, tokens: int, context: int, moe: bool) -> float:
    """Matmuls (2 FLOP per weight per token) + attention over the cache (2 per cached element per head dim)."""
    return 2.0 * router_layer_params(m, moe) * tokens + 2.0 * tokens * (context + 1) * m.attention_width


def head_flops(m: ModelShape, tokens: int) -> float:
    return 2.0 * m.vocab_size * m.hidden_size * tokens


def dense_step_flops(m: ModelShape, tokens: int, context: int) -> float:
    """Everything the router computes in a step: every layer's dense part and the lm_head."""
    return (m.moe_layer_count * router_layer_flops(m, tokens, context, True)
            + m.dense_layer_count * router_layer_flops(m, tokens, context, False) + head_flops(m, tokens))


def expert_layer_flops(m: ModelShape, tokens: int) -> float:
    """The routed experts of one layer: gate, up and down for each (token, expert) slot."""
    return 2.0 * m.shard_params * tokens * m.top_k


# ---- components ----------------------------------------------------------------------------------------------


def expert_cpu_s(p: Profile, tokens: int, hit: float) -> float:
    """CPU only: the CPU-seconds of one layer's expert calls, summed over actors: each hit shard's weights streamed
    once (a fixed cost per call, which dominates at small batches) + the slots' FLOP."""
    m, hw = p.model, p.hardware
    weights = hit * m.shard_params * p.layout.expert_bytes
    reads = weights / hw.expert_read_bw if math.isfinite(hw.expert_read_bw) else 0.0
    return reads + expert_layer_flops(m, tokens) / hw.expert_flops_per_cpu_s


def graphed(p: Profile, step: StepShape) -> bool:
    """Whether the router replays this step as CUDA graphs: a pure decode step within the buckets, on a device
    whose profile has graphs (router.cuda_graphs auto on a GPU)."""
    return (p.hardware.graph_launch_s is not None and step.tokens == step.sequences
            and step.sequences <= GRAPH_MAX_BATCH)


def router_dense_s(p: Profile, step: StepShape, moe: bool = True) -> float:
    """One layer's dense part on the router. Graphed, an MoE layer's segment costs one replay plus the copies that
    stay eager, and a layer without experts runs inside the next segment's graph (no launch of its own)."""
    m, hw = p.model, p.hardware
    weights = router_layer_params(m, moe) * p.layout.act_bytes
    kv = step.sequences * step.context * m.kv_elems_per_token * p.layout.act_bytes  # every cached row read once
    if graphed(p, step):
        launch = hw.graph_launch_s + GRAPHED_EAGER_OPS_PER_MOE_LAYER * hw.op_overhead_s if moe else 0.0
    else:
        launch = DENSE_OPS_PER_LAYER * hw.op_overhead_s
    return hw.roofline_s(router_layer_flops(m, step.tokens, step.context, moe), weights + kv) + launch


def _calls(p: Profile, step: StepShape) -> tuple[float, float]:
    """(expected expert calls per round, expected shards hit)."""
    m, lay = p.model, p.layout
    hit = expected_hit(m.num_experts, m.top_k, step.tokens)
    if lay.actors >= m.num_experts:  # one actor per expert: a call per hit expert
        return hit, hit
    return lay.actors * (1.0 - (1.0 - 1.0 / lay.actors) ** hit), hit


def moe_layer_time(p: Profile, step: StepShape) -> LayerTime:
    m, hw, tr, lay = p.model, p.hardware, p.transport, p.layout
    calls, hit = _calls(p, step)
    slots = step.tokens * m.top_k
    plan = (PLAN_FIXED_S + PLAN_PER_SLOT_S * slots + PLAN_PER_CALL_S * calls) / hw.host_speed
    # Rows on the wire: a token goes once to each device holding one of its experts.
    per_token_devices = min(m.top_k, lay.devices * (1.0 - (1.0 - 1.0 / lay.devices) ** m.top_k))
    wire = step.tokens * per_token_devices * m.hidden_size * lay.act_bytes  # bytes each way
    if tr.device_direct:
        data = 2 * wire / hw.device_link_bw
    else:
        data = 2 * wire * (2 / hw.host_link_bw + tr.host_copies / hw.host_copy_bw)
    transport = tr.call_s + max(0.0, calls - 1) * tr.issue_s + tr.syncs * hw.sync_s + data
    if not hw.concurrent:  # the CPU: the actors' compute shares the cores
        expert = expert_cpu_s(p, step.tokens, hit) / hw.cpu_parallelism
    else:  # the busiest device: its share of the hit shards and of the rows
        shards = max(1.0, hit / max(1.0, calls))
        rows = slots / max(1.0, calls)
        expert = hw.roofline_s(2.0 * m.shard_params * rows, shards * m.shard_params * lay.expert_bytes) \
            + (OPS_PER_EXPERT_CALL + OPS_PER_SHARD * shards) * hw.op_overhead_s
    combine = hw.roofline_s(2.0 * slots * m.hidden_size, 2 * slots * m.hidden_size * lay.act_bytes) \
        + 2 * calls * hw.op_overhead_s
    return LayerTime(router_dense_s(p, step), plan, transport, expert, combine)


def overlapped_layer_s(p: Profile, step: StepShape) -> float:
    """One MoE layer with the step split in two micro-batches taking turns (experts/modeling.py ping-pong). The
    halves run eagerly: the decoder graphs only whole, unsplit decode steps."""
    p = replace(p, hardware=replace(p.hardware, graph_launch_s=None))
    h = moe_layer_time(p, step.half())
    if not p.hardware.concurrent:
        return 2 * h.total  # shared cores: the halves run one after the other, each paying its fixed costs
    router = h.router_side + max(0.0, _calls(p, step.half())[0] - 1) * p.transport.issue_s
    rest = h.total - router
    if p.layout.shared_device:  # one GPU runs both: only the transport's latency can hide
        return max(2 * (h.router_dense + h.expert + h.combine) + 2 * h.plan, router + rest)
    return max(2 * router, router + rest, 2 * h.expert)


def should_overlap(step: StepShape, profile: Profile) -> bool:
    """Two micro-batches pay when the overlapped layer saves OVERLAP_MARGIN of the plain one. Never for one
    sequence (nothing to split) nor where router and experts share cores."""
    if step.sequences < 2 or not profile.hardware.concurrent:
        return False
    plain = moe_layer_time(profile, step).total
    return overlapped_layer_s(profile, step) < plain * (1 - OVERLAP_MARGIN)


def head_s(p: Profile, step: StepShape) -> float:
    hw, m = p.hardware, p.model
    launch = hw.graph_launch_s if graphed(p, step) else 4 * hw.op_overhead_s  # graphed: the last segment's replay
    return hw.roofline_s(head_flops(m, step.tokens), m.vocab_size * m.hidden_size * p.layout.act_bytes) + launch


def predict_step(p: Profile, step: StepShape, overlap: bool | str = "auto") -> StepPrediction:
    """The decode step's time and tokens/s; overlap True / False / "auto" (should_overlap decides)."""
    m = p.model
    layer = moe_layer_time(p, step)
    use = should_overlap(step, p) if overlap == "auto" else bool(overlap) and step.sequences >= 2
    moe_s = overlapped_layer_s(p, step) if use else layer.total
    dense_s = router_dense_s(p, step, moe=False) if m.dense_layer_count else 0.0
    head = head_s(p, step)
    total = m.moe_layer_count * moe_s + m.dense_layer_count * dense_s + head
    return StepPrediction(step.tokens, layer, moe_s, dense_s, head, total, step.tokens / total, use)


# ---- a GPU node -------------------------------------------------------------------------------------------------


def expert_total_bytes(m: ModelShape, expert_bytes: float) -> float:
    return m.moe_layer_count * m.num_experts * m.shard_params * expert_bytes


def router_bytes(m: ModelShape, sequences: int, context: int, act_bytes: float = 2.0) -> float:
    """Dense weights (all layers, embedding, lm_head) + the step's KV cache."""
    weights = (m.moe_layer_count * router_layer_params(m, True) + m.dense_layer_count * router_layer_params(m, False)
               + 2 * m.vocab_size * m.hidden_size)
    kv = sequences * context * m.kv_elems_per_token * m.num_layers
    return (weights + kv) * act_bytes


def node_layout(m: ModelShape, hw: HardwareProfile, gpus: int, sequences: int, context: int,
                utilization: float = 0.9) -> tuple[Layout | None, str]:
    """The lightest-to-serve layout that fits `gpus` GPUs: one router GPU, one expert actor per other GPU (one GPU:
    both on it), experts in bf16, else int8, else int4 (README: Quantised experts). (None, why) when nothing fits."""
    usable = hw.memory_gib * GIB * utilization - RESERVE_BYTES
    if gpus == 1:  # router and the one expert actor share the GPU
        for name, b in EXPERT_BYTES.items():
            if router_bytes(m, sequences, context) + expert_total_bytes(m, b) <= usable:
                return Layout(devices=1, actors=1, expert_bytes=b, shared_device=True), f"one GPU, experts {name}"
        return None, "router and experts do not fit one GPU even in int4"
    devices = gpus - 1
    if router_bytes(m, sequences, context) > usable:
        return None, f"router weights + KV ({router_bytes(m, sequences, context) / GIB:.0f} GiB) exceed one GPU"
    for name, b in EXPERT_BYTES.items():
        if expert_total_bytes(m, b) / devices <= usable:
            return Layout(devices=devices, actors=devices, expert_bytes=b), f"experts {name}"
    need = expert_total_bytes(m, EXPERT_BYTES["int4"]) / usable
    return None, f"experts do not fit {devices} GPUs even in int4 (need {math.ceil(need)})"
