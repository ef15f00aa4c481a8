"""The decoder of the supported MoE families, in one readable file, with the routed experts behind an interface.

`MoEDecoder` runs embeddings, attention (per-family layers, experts/attention.py) over a paged KV cache
(experts/kv_cache.py; the math in experts/attention_core.py), norms, gates and the dense/shared MLPs. The routed
experts of each MoE layer are an `ExpertBackend`: in process for the reference model, Ray actors for the router.
Same dense code on both paths, so a difference between them can only come from the experts' dispatch.

Sequences are flattened into one token axis ([T, H]) for every matmul and every expert call; only the attention core
pads (decode rows together, prefill rows together, one call each), so sequences of different lengths (and positions)
share a step. `forward(..., logits=)` says which rows need the lm_head: every position (Score), the last (generation),
or none (a prompt chunk that is not the prompt's end).

Overlap (`overlap=True`, README: Transports / Overlap): a step of ≥ 2 sequences is split into two micro-batches
(contiguous halves by sequence, balanced by tokens) that take turns, so one's expert round is in flight while the
other runs its dense part (ping-pong). Each sequence's math is the same, only matmul batch sizes change.
`overlap` may also be a callable (lengths, starts) -> bool asked every step (router.overlap "auto": the latency
model's choice, cluster/overlap_policy.py), so a step splits only where the split pays.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch
import torch.nn.functional as F

from .attention import AttentionLayer, build_attention
from .attention_core import attend
from .config import MoEModelConfig
from .decode_graphs import DecodeGraphs, GraphSettings, model_reason
from .dense_weights import DenseWeights
from .device_rule import tensor_on, to_device
from .ffn import activation, gated_mlp
from .gating import DROPPED, Routing, concat_routings, route_for_model, split_identity
from .kv_cache import KVCache, KVCacheSettings, PagedKVPool
from .norms import rms_norm, rms_norm_unit_offset
from .rope import build_rope
from .step_group import StepGroup

__all__ = ["ExpertBackend", "KVCache", "MoEDecoder", "StepTrace", "rms_norm"]


class ExpertBackend(Protocol):
    def run(self, layer: int, hidden: torch.Tensor, routing: Routing) -> torch.Tensor:
        """hidden: [T, H], routing over k slots -> sum_k weight * expert_k(hidden): [T, H]."""
        ...

    def effective_routing(self, layer: int, routing: Routing) -> Routing:
        """The routing the last `run` (or `wait`) of this layer actually served (differs only when it degraded)."""
        ...

    # Optional, looked up with getattr/hasattr:
    #   begin_step() / end_step(): called around every forward (a routing-table switch happens only between them);
    #   submit(layer, hidden, routing) -> pending and wait(pending) -> [T, H]: `run` in two halves, so the decoder
    #   can overlap an expert round with other work (overlap=True needs them).


@dataclass
class StepTrace:
    """What one forward routed, per MoE layer: kept for stats and tests (e.g. 'calls == experts hit')."""

    routings: dict[int, Routing] = field(default_factory=dict)


class MoEDecoder:
    def __init__(
        self,
        cfg: MoEModelConfig,
        weights: DenseWeights,
        experts: ExpertBackend,
        capacity_factor: float | None = None,
        overlap: bool | Callable[[Sequence[int], Sequence[int]], bool] = False,
        kv_cache: KVCacheSettings | None = None,
        cuda_graphs: GraphSettings | None = None,
    ):
        """kv_cache: block size and budget of the paged KV cache, allocated here on the device of the weights.
        overlap: True / False, or a per-step choice (lengths, starts) -> bool.
        cuda_graphs: replay decode steps as CUDA graphs (experts/decode_graphs.py); None: eager. Needs a CUDA
        device and a model whose decode step can be graphed (decode_graphs.model_reason)."""
        if overlap and capacity_factor is not None:
            # Capacity is per expert call: splitting a step into micro-batches would change which tokens overflow.
            raise ValueError("overlap: cannot be combined with capacity_factor (capacity is per step)")
        self.cfg = cfg
        self.w = weights
        self.experts = experts
        self.capacity_factor = capacity_factor
        self.overlap = overlap  # ping-pong two micro-batches when the step (and the policy) and the backend allow it
        self.act = activation(cfg.hidden_act)
        # Qwen3-Next / Qwen3.5 store their RMSNorm weights as offsets from 1
        self._norm_fn = rms_norm_unit_offset if cfg.norm_unit_offset else rms_norm
        # Everything the decoder makes per step (positions, RoPE tables, masks) lives where its weights do.
        self.rope = build_rope(cfg, device=self.device)
        self.attention: list[AttentionLayer] = [
            build_attention(cfg, i, layer.attention) for i, layer in enumerate(weights.layers)
        ]
        self.last_trace = StepTrace()
        # Called as step_observer(trace, lengths, caches) after every forward (load statistics); None = off.
        self.step_observer = None
        # Stage clock (router_service/step_profile.py StageClock): the router sets it; gating and lm_head time.
        self.profile = None
        # The config names the model in the prefix-cache keys (with dtype, block size, cache layout): a pool is this
        # decoder's alone, so this only guards against a pool ever being shared.
        self.kv_pool = PagedKVPool.plan(self.cache_specs(), self.dtype, self.device, cfg.max_position_embeddings,
                                        kv_cache or KVCacheSettings(), identity=cfg, state_shapes=self.state_shapes())
        self.graphs: DecodeGraphs | None = None
        if cuda_graphs is not None:
            if self.device.type != "cuda":
                raise ValueError(f"cuda_graphs: the decoder is on {self.device}, CUDA graphs need a CUDA device")
            reason = model_reason(cfg, capacity_factor)
            if reason is not None:
                raise ValueError(f"cuda_graphs: this model's decode step cannot be graphed: {reason}")
            self.graphs = DecodeGraphs(self, cuda_graphs)

    @property
    def dtype(self) -> torch.dtype:
        return self.w.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.w.embed.device

    def cache_specs(self) -> list[dict[str, tuple[int, ...]]]:
        """Per layer, what one token stores in the KV cache (its attention layer's cache_spec)."""
        return [dict(attn.cache_spec) for attn in self.attention]

    def state_shapes(self) -> list[dict[str, tuple[int, ...]]]:
        """Per layer, the per-sequence state of a linear-attention layer (experts/state_cache.py); {} elsewhere."""
        return [self.cfg.gated_delta.state_shapes() if self.cfg.is_linear_layer(i) else {}
                for i in range(self.cfg.num_layers)]

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The family's RMSNorm of x [..., H] with `weight` [H]."""
        return self._norm_fn(x, weight, self.cfg.rms_norm_eps)

    def new_cache(self) -> KVCache:
        """An empty sequence in the paged pool; it takes blocks as tokens arrive and gives them back on `free()`
        (or when dropped)."""
        return self.kv_pool.new_sequence()

    @torch.inference_mode()
    def forward(self, tokens: list[torch.Tensor], caches: list[KVCache] | None = None,
                logits: str | list[str] = "all") -> list[torch.Tensor]:
        """tokens: per sequence, its new token ids [S_i]; caches (updated in place) hold what came before, and
        take the blocks the new tokens need (OutOfBlocks when the pool has none: the batcher reserves first).
        None: each sequence is a whole prompt attended within this call, nothing is kept.
        logits: per sequence (or one for all) which rows to run the lm_head on: "all" -> [S_i, V], "last" ->
        [1, V], "none" -> [0, V]. Float32."""
        wanted = [logits] * len(tokens) if isinstance(logits, str) else list(logits)
        assert len(wanted) == len(tokens) and set(wanted) <= {"all", "last", "none"}, wanted
        lengths = [int(t.numel()) for t in tokens]
        starts = [c.length for c in caches] if caches is not None else [0] * len(tokens)
        if caches is not None:
            for cache, n in zip(caches, lengths):
                cache.reserve(n)
        ids = torch.cat([t.reshape(-1) for t in tokens])  # [T]; token ids come from the host (or are on device)
        begin, end = getattr(self.experts, "begin_step", None), getattr(self.experts, "end_step", None)
        if begin is not None:
            begin(lengths)
        try:
            split = self._split(lengths) if self._can_overlap(lengths, starts) else None
            # A pure decode step within the graphs' buckets replays them (experts/decode_graphs.py); None: eager
            graphed = self._graphed(ids, lengths, starts, caches) if split is None else None
            if graphed is not None:
                routings, out = graphed  # out: [B, V] float32, one row per sequence
                trace = StepTrace(routings=routings)
            elif split is None:
                step = self._embed(ids, lengths, starts, caches)
                trace = self._run_layers(step)
                x = step.x
            else:
                step = self._embed(ids, lengths, starts, caches)
                groups = [step.part(0, split), step.part(split, len(lengths))]
                trace = self._run_layers_overlapped(groups)
                x = torch.cat([g.x for g in groups])  # [T, H], original token order
        finally:
            if end is not None:
                end()
        if caches is not None:
            for cache, n in zip(caches, lengths):
                cache.length += n
        self.last_trace = trace
        if self.step_observer is not None:
            self.step_observer(trace, lengths, caches if caches is not None else [_Fresh(n) for n in lengths])
        if graphed is not None:
            return [out[i:i + 1] if w != "none" else out[i:i] for i, w in enumerate(wanted)]
        return self._logits(x, lengths, wanted)

    def _graphed(self, ids: torch.Tensor, lengths: list[int], starts: list[int], caches: list[KVCache] | None
                 ) -> tuple[dict[int, Routing], torch.Tensor] | None:
        if self.graphs is None or caches is None:
            return None
        key = self.graphs.bucket_for(lengths, starts)
        return None if key is None else self.graphs.step(key, ids, caches, starts)

    def _embed(self, ids: torch.Tensor, lengths: list[int], starts: list[int], caches: list[KVCache] | None
               ) -> StepGroup:
        """The step as one group: embeddings of ids [T] (host or device) and the rotary tables of its positions."""
        device = self.device
        ids = to_device(ids, device) if ids.device.type == "cpu" else ids
        positions = tensor_on([p for s, n in zip(starts, lengths) for p in range(s, s + n)],
                              torch.int64, device)  # [T]; one tensor, not one per sequence
        cos, sin = self.rope.tables(positions, self.dtype)  # [T, R] each
        x = F.embedding(ids, self.w.embed)  # [T, H]
        return StepGroup(x, cos, sin, positions, lengths, starts, caches)

    def _logits(self, x: torch.Tensor, lengths: list[int], wanted: list[str]) -> list[torch.Tensor]:
        """Final norm and lm_head on the rows `wanted` asks for only (x [T, H]); per sequence [rows_i, V]."""
        started = time.perf_counter()
        if all(w == "all" for w in wanted):
            counts = lengths
        else:
            picked, counts, offset = [], [], 0
            for n, w in zip(lengths, wanted):
                take = range(offset, offset + n) if w == "all" else [offset + n - 1] if w == "last" else []
                picked.extend(take)
                counts.append(len(take))
                offset += n
            x = x[tensor_on(picked, torch.int64, x.device)]  # [R, H]
        x = self.norm(x, self.w.final_norm)
        out = F.linear(x, self.w.lm_head).float()  # [R, V]
        if self.profile is not None:
            self.profile.since("model.lm_head", started)
        return list(out.split(counts))

    # ---- layer schedules ---------------------------------------------------------------------------------------

    def _can_overlap(self, lengths: list[int], starts: list[int]) -> bool:
        if not self.overlap or self.capacity_factor is not None or not hasattr(self.experts, "submit"):
            return False
        return bool(self.overlap(lengths, starts)) if callable(self.overlap) else True

    @staticmethod
    def _split(lengths: list[int]) -> int | None:
        """Where to cut the sequences into two contiguous micro-batches with token counts as equal as possible;
        None for a single sequence (nothing to overlap)."""
        if len(lengths) < 2:
            return None
        total, before, best, best_gap = sum(lengths), 0, 1, None
        for cut in range(1, len(lengths)):
            before += lengths[cut - 1]
            gap = abs(total - 2 * before)
            if best_gap is None or gap < best_gap:
                best, best_gap = cut, gap
        return best

    def _run_layers(self, g: StepGroup) -> StepTrace:
        """Every layer in order over one group, each expert round waited for at once; LongCat's shortcut round is
        submitted at its sublayer and waited for only after the next sublayer's attention and dense MLP, the work
        the shortcut connection was designed to hide the expert round behind."""
        trace = StepTrace()
        defer = self.cfg.shortcut_moe and hasattr(self.experts, "submit")

        def collect() -> None:
            self._collect(g, trace.routings.__setitem__)

        for i, layer in enumerate(self.w.layers):
            routed = self._dense(i, layer, g, collect)
            if routed is None:
                continue
            h, routing, identity = routed
            if defer:
                g.pending = (i, h, routing, identity, self.experts.submit(i, *self._expert_input(h, routing)))
                continue
            mlp = self.experts.run(i, *self._expert_input(h, routing))  # [T, H]
            # The backend may have served a different routing (degraded around a lost expert): trace that one.
            trace.routings[i] = self.experts.effective_routing(i, routing)
            self._add_moe(g, layer, h, mlp, identity)
        return trace

    def _run_layers_overlapped(self, groups: list[StepGroup]) -> StepTrace:
        """Ping-pong: at layer i, group A finishes layer i-1 (waits for its expert round), runs its dense part of
        layer i and submits its round; then B does the same. So B's dense work runs while A's round is in flight,
        and A's next dense work while B's is."""
        parts: dict[int, list[Routing | None]] = {}

        def recorder(n: int) -> Callable[[int, Routing], None]:
            return lambda i, routing: parts.setdefault(i, [None, None]).__setitem__(n, routing)

        for i, layer in enumerate(self.w.layers):
            for n, g in enumerate(groups):
                # LongCat: a shortcut round is collected inside the next sublayer, after its dense MLP
                if g.pending is not None and not self.cfg.shortcut_moe:
                    self._collect(g, recorder(n))
                routed = self._dense(i, layer, g, lambda g=g, n=n: self._collect(g, recorder(n)))
                if routed is not None:
                    h, routing, identity = routed
                    g.pending = (i, h, routing, identity, self.experts.submit(i, *self._expert_input(h, routing)))
        for n, g in enumerate(groups):
            if g.pending is not None:
                self._collect(g, recorder(n))
        # One routing per layer for the whole step, tokens in the original order (A's then B's).
        return StepTrace(routings={i: concat_routings(p) for i, p in sorted(parts.items())})

    def _collect(self, g: StepGroup, record: Callable[[int, Routing], None]) -> None:
        """Wait for group g's pending expert round and finish that layer for it (shared expert, residual);
        record(layer, routing) keeps the routing the backend served for the step's trace."""
        i, h, routing, identity, pending = g.pending
        g.pending = None
        mlp = self.experts.wait(pending)  # [T_g, H]
        record(i, self.experts.effective_routing(i, routing))
        self._add_moe(g, self.w.layers[i], h, mlp, identity)

    def _add_moe(self, g: StepGroup, layer, h: torch.Tensor, mlp: torch.Tensor, identity: torch.Tensor | None) -> None:
        """Finish an MoE layer for group g: routed experts (mlp [T_g, H]) + identity experts + shared expert into
        the residual, or (LongCat's shortcut MoE) held until the next sublayer's dense MLP is in."""
        if identity is not None:  # LongCat's identity experts: added after the real ones, as transformers does
            mlp = mlp + (h.float() * identity[:, None]).to(h.dtype)  # [T_g, H]
        out = self._with_shared(layer, h, mlp)
        if self.cfg.shortcut_moe:
            g.shortcut = out
        else:
            g.x = g.x + out

    def _dense(self, i: int, layer, g: StepGroup, collect: Callable[[], None] | None = None
               ) -> tuple[torch.Tensor, Routing, torch.Tensor | None] | None:
        """Group g's dense part of layer i: attention, and either the dense MLP (a layer without experts: done,
        returns None) or the gate -> (h [T_g, H], routing, identity) for the expert round; identity [T_g] float32:
        LongCat's summed identity-expert weight per token (those slots are DROPPED in the routing: no actor serves
        them), else None. LongCat's MoE sublayer also runs its dense MLP; the sublayer after it adds the MoE
        output (g.shortcut) after its own MLP, as transformers' LongcatFlashDecoderLayer does; a round still in
        flight (g.pending) is collected right then, by `collect`."""
        cfg = self.cfg
        h = self.norm(g.x, layer.input_norm)  # [T_g, H]
        g.x = g.x + self._attention(i, h, g)
        h = self.norm(g.x, layer.post_attention_norm)
        if layer.router is None:
            g.x = g.x + gated_mlp(h, layer.dense_mlp, self.act)
            if cfg.shortcut_moe and g.pending is not None:
                collect()  # sets g.shortcut
            if g.shortcut is not None:  # residual + mlp + shortcut, in that order
                g.x, g.shortcut = g.x + g.shortcut, None
            return None
        gating = time.perf_counter()
        routing = route_for_model(cfg, self._gate_logits(layer, h), layer.router_correction_bias, self.capacity_factor)
        identity = None
        if cfg.zero_experts:
            routing, identity = split_identity(routing, cfg.num_experts)
        if self.profile is not None:
            self.profile.since("model.gating", gating)
        if cfg.shortcut_moe:  # the MoE runs beside this sublayer's dense MLP, on the same h
            g.x = g.x + gated_mlp(h, layer.dense_mlp, self.act)
        return h, routing, identity

    @staticmethod
    def _expert_input(h: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, Routing]:
        """What the expert round takes: h [T, H] and the routing, or (Llama 4) h scaled by each token's router score
        (top-1: [T, 1]) in the model dtype, as transformers scales it, and the routing without that scale."""
        if routing.input_scales is None:
            return h, routing
        return h * routing.input_scales.to(h.dtype), replace(routing, input_scales=None)  # [T, H]

    def _gate_logits(self, layer, h: torch.Tensor) -> torch.Tensor:
        """h [T, H] -> router logits [T, E] of `layer` (LayerWeights)."""
        # DeepSeek/GLM routers score in float32 (their gate weight is kept float32), as transformers does.
        # The others run in the gate weight's dtype: the model's, or float32 where the loader keeps the gate so
        # (ERNIE, Hunyuan), as transformers does.
        in_gate_dtype = ("softmax", "topk_softmax", "softmax_biased", "sigmoid_input")  # the last: Llama 4
        if self.cfg.router_kind in in_gate_dtype or self.cfg.router_in_model_dtype:
            return F.linear(h.to(layer.router.dtype), layer.router, layer.router_bias)  # [T, E]; gpt-oss: bias
        return F.linear(h.float(), layer.router.float())  # [T, E]

    def predict_experts(self, i: int, h: torch.Tensor) -> torch.Tensor:
        """The experts [T, k] layer i's router would pick for hidden states h [T, H] (no capacity cap): pre-gating
        for prefetch (router_service/prefetch.py), which feeds it the previous layer's h."""
        layer = self.w.layers[i]
        experts = route_for_model(self.cfg, self._gate_logits(layer, h), layer.router_correction_bias).experts
        if self.cfg.zero_experts:  # identity experts have no actor to prefetch
            experts = torch.where(experts >= self.cfg.num_experts, torch.full_like(experts, DROPPED), experts)
        return experts  # [T, k]

    def predict_expert_probs(self, i: int, h: torch.Tensor) -> torch.Tensor:
        """[T, E]: the softmax of layer i's router logits for hidden states h [T, H], the confidence of a pre-gating
        prediction (router_service/prefetch_policy.py; for sigmoid routers a score, not the routing weight)."""
        probs = torch.softmax(self._gate_logits(self.w.layers[i], h).float(), dim=-1)  # [T, E (+ identity)]
        return probs[:, : self.cfg.num_experts]  # [T, E]

    def _with_shared(self, layer, h: torch.Tensor, mlp: torch.Tensor) -> torch.Tensor:
        """The routed experts' output plus the (gated) shared expert where the layer has one. h, mlp: [T, H]."""
        if layer.shared_expert is None:
            return mlp
        if layer.shared_expert_gate is None:  # DeepSeek / GLM-4.5: shared experts without a gate
            return mlp + gated_mlp(h, layer.shared_expert, self.act)
        gate = torch.sigmoid(F.linear(h, layer.shared_expert_gate))  # [T, 1]
        return mlp + gate * gated_mlp(h, layer.shared_expert, self.act)

    def _attention(self, layer: int, h: torch.Tensor, g: StepGroup) -> torch.Tensor:
        """Layer `layer`'s attention for group g: project, write the new tokens to the paged cache, attend (decode
        rows in one call, prefill rows in another; attention_core.attend). h: [T_g, H]."""
        attn = self.attention[layer]
        if getattr(attn, "is_linear", False):  # Gated DeltaNet: each sequence's state, no KV history
            if g.caches is None:
                return attn.forward(h, g.lengths, None, None)
            states = self.kv_pool.states.views(layer, [c.state_slot for c in g.caches])
            return attn.forward(h, g.lengths, states["conv"], states["recurrent"])
        select = None
        if getattr(attn, "wants_positions", False):  # Llama 4: a query scale by position on its NoPE layers
            q, new = attn.project(h, g.cos, g.sin, g.positions)
        elif getattr(attn, "sparse_index", False):  # DSA: the indexer's top-k narrows each query's keys
            q, new, select = attn.project(h, g.cos, g.sin)
        else:
            q, new = attn.project(h, g.cos, g.sin)  # [T_g, nh, Dqk], {name: [T_g, *shape]}
        out = attend(g.layout, layer, q, new, attn.keys_values, attn.scale, attn.window, attn.sinks,
                     attn.chunk, select)  # [T_g, nh*Dv]
        return attn.output(out)  # [T_g, H]


class _Fresh:
    """Stands for a sequence's cache in the step observer's call when the forward kept none (each sequence is a
    whole prompt, started this step)."""

    def __init__(self, length: int):
        self.length = length
