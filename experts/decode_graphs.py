"""CUDA graphs for the router's dense decode step, one set per (batch-size bucket, history-blocks bucket).

Why: at decode, a router step is hundreds of small kernels per layer (norms, projections, RoPE, the KV-cache write and
gather, attention, the gate's softmax and top-k) whose launch costs exceed their run time at small batches; vLLM's
main decode lever is replaying them as CUDA graphs. An MoE layer's expert round leaves the device (the routing
crosses to the host once per layer, experts/device_rule.py), so a step is captured piecewise:
- segment 0: embedding, rotary tables, and every layer's dense part up to the first MoE layer's gate;
- segment j: MoE layer j-1's combine (shared expert, residual) and the dense part up to MoE layer j's gate;
- the last segment also runs the final norm and the lm_head.
Between segments the expert round runs as in eager mode, on the real rows only.

Shapes are static per graph. B decoding sequences run as the smallest batch bucket ≥ B: padding rows write their
K/V to a scratch block no sequence owns, and are cut off before the expert round. Histories are gathered through a
block table padded to a power of two blocks and masked, as eager pads to the longest. So a step's padded shapes
differ from eager's: on a GPU a padded batch's matmuls may round differently (cuBLAS picks kernels by shape), so
graphs match eager within the dtype's tolerance, and a router matches the in-process reference bit for bit when both
run with the same `cuda_graphs` setting. On the fake-CUDA double (CPU kernels) graphs equal eager bit for bit
where padding leaves each product's kernel unchanged (≥ 4 rows on both sides, experts/reproducible.py), and within
float rounding where it does not.

A step takes the graphs when every sequence decodes one token after some history, there are at most the largest
bucket of them, and the model's dense step keeps no state outside the paged pool (`model_reason`). Anything else
(prefill, chunked prefill beside decode, a capacity factor) runs eagerly. A graph is captured the first time its
bucket is met (one eager warm-up run, a capture, then replays); a capture that fails logs why, and that bucket
stays eager.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace

import torch
import torch.nn.functional as F

from .attention_core import StepLayout
from .block_allocator import blocks_for
from .gating import Routing
from .step_group import StepGroup

log = logging.getLogger(__name__)

DEFAULT_BATCH_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
CUDA_GRAPH_SETTINGS = ("auto", "on", "off")


# ---- pure policy ---------------------------------------------------------------------------------------------------

def graph_buckets(max_batch: int) -> tuple[int, ...]:
    """The batch buckets up to max_batch: the default ladder below it, then max_batch itself."""
    assert max_batch >= 1, max_batch
    return tuple(b for b in DEFAULT_BATCH_BUCKETS if b < max_batch) + (max_batch,)


def batch_bucket(batch: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket ≥ batch (buckets ascending), or None when the batch is larger than every bucket."""
    for b in buckets:
        if b >= batch:
            return b
    return None


def blocks_bucket(blocks: int, limit: int) -> int:
    """History blocks [1, limit] -> the power of two ≥ blocks, at most `limit` (a sequence's most blocks): at most
    twice the keys eager attends, log2(limit) graphs per batch bucket."""
    assert 1 <= blocks <= limit, (blocks, limit)
    return min(1 << (blocks - 1).bit_length(), limit)


def model_reason(cfg, capacity_factor: float | None) -> str | None:
    """Why this model's decode step cannot be graphed, or None when it can."""
    if capacity_factor is not None:
        return "a capacity factor (which tokens overflow is decided on the host)"
    if any(cfg.is_linear_layer(i) for i in range(cfg.num_layers)):
        return "linear-attention layers (their recurrent state update runs once per step, not per replay)"
    if cfg.shortcut_moe:
        return "LongCat's shortcut MoE (its expert round spans two sublayers)"
    return None


def step_bucket(lengths: Sequence[int], starts: Sequence[int], buckets: Sequence[int]) -> int | None:
    """The batch bucket of a pure decode step (every sequence adds one token after some history), else None."""
    if not lengths or any(n != 1 for n in lengths) or any(s < 1 for s in starts):
        return None
    return batch_bucket(len(lengths), buckets)


def rows(routing: Routing, n: int) -> Routing:
    """The routing of the first n tokens (every per-token field cut to [:n]), copied out of graph memory: the next
    replay overwrites the captured tensors, and a routing may be kept after the step (load statistics)."""
    return replace(routing, **_routing_tensors(routing, lambda t: t[:n].clone()))


@dataclass(frozen=True)
class GraphSettings:
    """Which decode steps are graphed: batch sizes are padded up to these buckets (larger batches run eagerly)."""

    buckets: tuple[int, ...] = DEFAULT_BATCH_BUCKETS

    def __post_init__(self) -> None:
        if not self.buckets or any(b < 1 for b in self.buckets) or list(self.buckets) != sorted(set(self.buckets)):
            raise ValueError(f"cuda_graph_buckets: must be ascending distinct batch sizes ≥ 1, got {self.buckets}")


# ---- the graphs ------------------------------------------------------------------------------------------------------

@dataclass
class _Outputs:
    """What a segment leaves for the expert round and the next segment, in static tensors shared by every graph of
    one batch size (a graph copies its results in at its end): memory O(batch × (hidden + vocab)) per batch
    bucket, not per graph and MoE layer (kept per graph, DeepSeek-V3's 58 MoE layers × 3 [256, 7168] bf16 tensors
    would take 640 MiB per bucket). Allocated from the first warm-up's shapes, outside any capture."""

    # x, h and identity are what segment j writes and segment j+1 reads: two of each, segment j writing [j % 2], so
    # a segment never overwrites its own inputs (its warm-up, then its capture, then its replay must all read
    # the same inputs).
    x: tuple[torch.Tensor, torch.Tensor]  # [b, H] residual stream after the segment
    h: tuple[torch.Tensor, torch.Tensor]  # [b, H] the MoE layer's normed input (its shared expert and combine)
    expert_in: torch.Tensor  # [b, H] what the expert round takes (Llama 4: h scaled by the router score)
    mlp: torch.Tensor  # [b, H] the expert round's output, copied in before the next segment
    routing: dict[str, torch.Tensor]  # the routing's per-token tensors ([b, k], [b, E], ...)
    identity: tuple[torch.Tensor, torch.Tensor] | None  # [b] float32 identity-expert weight, or None
    logits: torch.Tensor | None  # [b, V] float32 (allocated at the first warm-up of the last segment)


@dataclass
class _Bucket:
    """One (batch, history blocks) shape: its static inputs, its graphs, the layout its attention reads."""

    batch: int
    blocks: int
    inputs: torch.Tensor  # [4b + b*nb] int64 on the device: meta, then table (views below), one copy up
    meta: torch.Tensor  # [4, b] token ids, positions, cache slots, history lengths
    table: torch.Tensor  # [b, nb] block table
    staging: torch.Tensor  # [4b + b*nb] int64 on the host (pinned on CUDA): the step's inputs
    layout: StepLayout
    graphs: list = field(default_factory=list)  # torch.cuda.CUDAGraph per segment, in order
    routings: list = field(default_factory=list)  # per MoE layer: its Routing over the static tensors
    group: object = None  # the StepGroup the segments share (rotary tables, layout)
    failed: str | None = None  # why capture failed: the bucket then runs eagerly


class DecodeGraphs:
    """Captures and replays a decoder's dense decode step (see the module docstring). `decoder`: a MoEDecoder."""

    def __init__(self, decoder, settings: GraphSettings | None = None):
        self.decoder = decoder
        self.settings = settings or GraphSettings()
        self.buckets: dict[tuple[int, int], _Bucket] = {}
        self.outputs: dict[int, _Outputs] = {}  # per batch bucket
        self.scratch_block: int | None = None  # the padding rows' K/V go here; taken from the pool on first use
        self.pool = None  # the graphs' shared memory pool (torch.cuda.graph_pool_handle)
        self.replays = self.captures = 0
        self.moe_layers = [i for i, layer in enumerate(decoder.w.layers) if layer.router is not None]
        cfg = decoder.cfg
        self.max_blocks = blocks_for(cfg.max_position_embeddings, decoder.kv_pool.block_size)

    def bucket_for(self, lengths: Sequence[int], starts: Sequence[int]) -> tuple[int, int] | None:
        """(batch bucket, blocks bucket) of a step the graphs can run, or None (run it eagerly)."""
        batch = step_bucket(lengths, starts, self.settings.buckets)
        if batch is None:
            return None
        needed = max(blocks_for(s + 1, self.decoder.kv_pool.block_size) for s in starts)
        key = (batch, blocks_bucket(needed, self.max_blocks))
        entry = self.buckets.get(key)
        return None if entry is not None and entry.failed else key

    def stats(self) -> dict:
        return {"buckets": len([b for b in self.buckets.values() if not b.failed]), "captures": self.captures,
                "replays": self.replays, "failed": {f"{k[0]}x{k[1]}": b.failed for k, b in self.buckets.items()
                                                    if b.failed}}

    # ---- one step ----------------------------------------------------------------------------------------------

    def step(self, key: tuple[int, int], ids: torch.Tensor, caches: list, starts: list[int]
             ) -> tuple[dict[int, Routing], torch.Tensor] | None:
        """Run a decode step (ids [B], caches reserved for one token each) through bucket `key`'s graphs ->
        (routings per MoE layer over the B real rows, logits [B, V] float32, a copy); None when a capture failed
        (the caller runs the step eagerly: what this one wrote, K/V at the step's slots, the eager run writes
        again, and the expert rounds it ran had no effect but load statistics)."""
        entry = self.buckets.get(key)
        if entry is None:
            entry = self.buckets[key] = self._new_bucket(*key)
        self._fill(entry, ids, caches, starts)
        batch = len(caches)
        experts = self.decoder.experts
        routings: dict[int, Routing] = {}
        for j, layer in enumerate(self.moe_layers):
            if not self._run_segment(entry, j):
                return None
            out = self.outputs[entry.batch]
            served = rows(entry.routings[j], batch)
            mlp = experts.run(layer, out.expert_in[:batch], served)  # [B, H]
            routings[layer] = experts.effective_routing(layer, served)
            out.mlp[:batch].copy_(mlp)
        if not self._run_segment(entry, len(self.moe_layers)):
            return None
        return routings, self.outputs[entry.batch].logits[:batch].clone()  # the next step overwrites the static

    def _fill(self, entry: _Bucket, ids: torch.Tensor, caches: list, starts: list[int]) -> None:
        """The step's inputs into the bucket's static tensors: built as Python lists (a tensor write per value
        costs ~1 us, 6 per row), staged in one host buffer, one copy up."""
        bs = self.decoder.kv_pool.block_size
        if self.scratch_block is None:
            self.scratch_block = self.decoder.kv_pool.allocate(1)[0]
        scratch = self.scratch_block
        b, nb, real = entry.batch, entry.blocks, len(caches)
        pad = b - real
        on_host = ids.device.type == "cpu"
        token_ids = (ids.reshape(-1).tolist() if on_host else [0] * real) + [0] * pad
        positions = list(starts) + [0] * pad
        # padding rows write their K/V to the scratch block and attend that one key
        slots = [c.blocks[s // bs] * bs + s % bs for c, s in zip(caches, starts)] + [scratch * bs] * pad
        lengths = [s + 1 for s in starts] + [1] * pad
        table: list[int] = []
        for cache, start in zip(caches, starts):
            used = cache.blocks[:blocks_for(start + 1, bs)]
            table += used + used[:1] * (nb - len(used))  # padded with the row's own first block, as eager's
        table += [scratch] * (nb * pad)
        entry.staging.copy_(torch.tensor(token_ids + positions + slots + lengths + table, dtype=torch.int64))
        entry.inputs.copy_(entry.staging, non_blocking=True)
        if not on_host:  # sampled on the device: stays there
            entry.meta[0, :real].copy_(ids.reshape(-1))

    def _new_bucket(self, batch: int, blocks: int) -> _Bucket:
        dec = self.decoder
        device = dec.device
        pinned = device.type == "cuda"
        size = 4 * batch + batch * blocks
        inputs = torch.zeros(size, dtype=torch.int64, device=device)
        meta, table = inputs[:4 * batch].view(4, batch), inputs[4 * batch:].view(batch, blocks)
        staging = torch.zeros(size, dtype=torch.int64, pin_memory=pinned)
        empty = torch.zeros(0, dtype=torch.int64, device=device)
        layout = StepLayout(
            lengths=[1] * batch, starts=[1] * batch, pool=dec.kv_pool, slots=meta[2],
            decode_rows=list(range(batch)), decode_index=torch.arange(batch, device=device),
            decode_table=table, decode_kv_len=meta[3],
            prefill_rows=[], prefill_index=empty.view(0, 0), prefill_valid=empty.view(0, 0).bool(),
            prefill_flat=empty, prefill_tokens=empty, prefill_table=None, prefill_kv_len=empty)
        return _Bucket(batch, blocks, inputs, meta, table, staging, layout)

    # ---- segments ----------------------------------------------------------------------------------------------

    def _run_segment(self, entry: _Bucket, j: int) -> bool:
        """Replay segment j of the bucket, capturing it first if this is the bucket's first step. False: the
        capture failed (logged; the bucket runs eagerly from now on)."""
        if j < len(entry.graphs):
            entry.graphs[j].replay()
            self.replays += 1
            return True
        try:
            self._capture(entry, j)
        except Exception as exc:  # noqa: BLE001 - any capture failure leaves the bucket to the eager path
            entry.failed = f"{type(exc).__name__}: {exc}"
            log.warning("decode graphs: capturing batch %d x %d blocks failed at segment %d; that bucket runs "
                        "eagerly (%s)", entry.batch, entry.blocks, j, entry.failed)
            entry.graphs, entry.routings = [], []
            return False
        entry.graphs[j].replay()
        self.captures += 1
        return True

    def _capture(self, entry: _Bucket, j: int) -> None:
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        # One eager run first (on a side stream, as torch.cuda.make_graphed_callables does): lazy initialisation
        # (cuBLAS workspaces, kernel selection) must not happen inside the capture. It computes what the replay
        # then computes again, and writes the same K/V to the same slots.
        # The warm-up's masks and DSA selections must not stay cached in the layout: the capture would read those
        # eager tensors, frozen at this step's values, instead of computing its own.
        cached = dict(entry.layout._masks), dict(entry.layout.selections)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._segment(entry, j, keep=False)
        torch.cuda.current_stream().wait_stream(side)
        entry.layout._masks, entry.layout.selections = cached
        graph = torch.cuda.CUDAGraph()
        # thread_local: the router's other threads (event loop, reporters) may use CUDA while this one captures
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            self._segment(entry, j, keep=True)
        entry.graphs.append(graph)

    def _segment(self, entry: _Bucket, j: int, keep: bool) -> None:
        """Segment j's work on the bucket's static tensors (see the module docstring), its results copied into the
        batch's static outputs. keep: a capture (keep the group and the routing over the static tensors); else the
        warm-up, which also allocates the static outputs on the batch's first warm-up."""
        dec = self.decoder
        ids, positions = entry.meta[0], entry.meta[1]  # [b] each
        layers = dec.w.layers
        out = self.outputs.get(entry.batch)
        if j == 0:
            cos, sin = dec.rope.tables(positions, dec.dtype)  # [b, R] each
            g = StepGroup(F.embedding(ids, dec.w.embed), cos, sin, positions, [1] * entry.batch, [1] * entry.batch,
                       None)  # x: [b, H]
            g._layout = entry.layout
            first = 0
        else:
            g = entry.group
            read = (j - 1) % 2
            g.x = out.x[read]
            previous = self.moe_layers[j - 1]
            dec._add_moe(g, layers[previous], out.h[read], out.mlp,
                         None if out.identity is None else out.identity[read])
            first = previous + 1
        last = self.moe_layers[j] if j < len(self.moe_layers) else len(layers) - 1
        routed = None
        for i in range(first, last + 1):
            routed = dec._dense(i, layers[i], g)
        entry.group = g
        if j == len(self.moe_layers):
            logits = F.linear(dec.norm(g.x, dec.w.final_norm), dec.w.lm_head).float()  # [b, V]
            if out.logits is None:  # the batch's first warm-up of its last segment
                out.logits = torch.empty_like(logits)
            out.logits.copy_(logits)
            return
        assert routed is not None, f"layer {last} should end in a gate"
        h, routing, identity = routed
        expert_in, routing = dec._expert_input(h, routing)  # [b, H]
        if out is None:  # the batch's first warm-up
            def two(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                return torch.empty_like(t), torch.empty_like(t)

            out = self.outputs[entry.batch] = _Outputs(
                x=two(g.x), h=two(h), expert_in=torch.empty_like(expert_in), mlp=torch.zeros_like(h),
                routing=_routing_tensors(routing, torch.empty_like),
                identity=None if identity is None else two(identity), logits=None)
        write = j % 2
        out.x[write].copy_(g.x)
        out.h[write].copy_(h)
        out.expert_in.copy_(expert_in)
        for name, t in _routing_tensors(routing).items():
            out.routing[name].copy_(t)
        if identity is not None:
            out.identity[write].copy_(identity)
        if keep:
            entry.routings.append(replace(routing, **out.routing))


def _routing_tensors(routing: Routing, make=lambda t: t) -> dict[str, torch.Tensor]:
    """name -> make(tensor) for the routing's per-token tensor fields."""
    return {f.name: make(getattr(routing, f.name)) for f in fields(routing)
            if isinstance(getattr(routing, f.name), torch.Tensor)}

