"""The decoder of the supported MoE families, in one readable file, with the routed experts behind an interface.

`MoEDecoder` runs embeddings, attention (RoPE, GQA, optional q/k norm, sliding window) with a per-sequence KV cache,
norms, gates and the dense/shared MLPs. The routed experts of each MoE layer are an `ExpertBackend`: in process for
the reference model, Ray actors for the router. Same dense code on both paths, so a difference between them can
only come from the experts' dispatch.

Sequences are flattened into one token axis ([T, H]) for every matmul and every expert call; only the attention core
runs per sequence, so sequences of different lengths (and positions) share a step without padding.

Overlap (`overlap=True`, README: Transports / Overlap): a step of ≥ 2 sequences is split into two micro-batches
(contiguous halves by sequence, balanced by tokens) that take turns, so one's expert round is in flight while the
other runs its dense part (ping-pong). Each sequence's math is the same, only matmul batch sizes change.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

from .config import MoEModelConfig
from .ffn import activation, gated_mlp
from .gating import Routing, concat_routings, route
from .weights import AttentionWeights, DenseWeights


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
class KVCache:
    """Keys and values of one sequence, per layer: [S, kvh, D] (sequence-major, so a batch pads along S)."""

    keys: list[torch.Tensor | None]
    values: list[torch.Tensor | None]
    length: int = 0

    @classmethod
    def empty(cls, num_layers: int) -> KVCache:
        return cls(keys=[None] * num_layers, values=[None] * num_layers)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values) if t is not None)


@dataclass
class StepTrace:
    """What one forward routed, per MoE layer: kept for stats and tests (e.g. 'calls == experts hit')."""

    routings: dict[int, Routing] = field(default_factory=dict)


@dataclass
class _Group:
    """A micro-batch of a step: some consecutive sequences, their hidden states and rotary tables."""

    x: torch.Tensor  # [T_g, H] residual stream
    cos: torch.Tensor  # [T_g, 1, D]
    sin: torch.Tensor  # [T_g, 1, D]
    lengths: list[int]
    starts: list[int]
    caches: list[KVCache]
    pending: tuple | None = None  # (layer, h [T_g, H], routing, backend handle) of a submitted expert round

    def part(self, first: int, last: int) -> _Group:
        """Sequences first..last-1 of this group."""
        lo, hi = sum(self.lengths[:first]), sum(self.lengths[:last])
        return _Group(self.x[lo:hi], self.cos[lo:hi], self.sin[lo:hi], self.lengths[first:last],
                      self.starts[first:last], self.caches[first:last])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class MoEDecoder:
    def __init__(
        self,
        cfg: MoEModelConfig,
        weights: DenseWeights,
        experts: ExpertBackend,
        capacity_factor: float | None = None,
        overlap: bool = False,
    ):
        if overlap and capacity_factor is not None:
            # Capacity is per expert call: splitting a step into micro-batches would change which tokens overflow.
            raise ValueError("overlap: cannot be combined with capacity_factor (capacity is per step)")
        self.cfg = cfg
        self.w = weights
        self.experts = experts
        self.capacity_factor = capacity_factor
        self.overlap = overlap  # ping-pong two micro-batches when the step and the backend allow it
        self.act = activation(cfg.hidden_act)
        dim = cfg.head_dim
        self.inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))  # [D/2]
        self.last_trace = StepTrace()
        # Called as step_observer(trace, lengths, caches) after every forward (load statistics); None = off.
        self.step_observer = None

    @property
    def dtype(self) -> torch.dtype:
        return self.w.embed.dtype

    def new_cache(self) -> KVCache:
        return KVCache.empty(self.cfg.num_layers)

    @torch.inference_mode()
    def forward(self, tokens: list[torch.Tensor], caches: list[KVCache] | None = None) -> list[torch.Tensor]:
        """tokens: per sequence, its new token ids [S_i]; caches (updated in place) hold what came before.
        Returns per sequence logits [S_i, V] (float32)."""
        cfg = self.cfg
        if caches is None:
            caches = [self.new_cache() for _ in tokens]
        lengths = [int(t.numel()) for t in tokens]
        starts = [c.length for c in caches]
        ids = torch.cat([t.reshape(-1) for t in tokens])  # [T]
        positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lengths)])  # [T]
        freqs = positions[:, None].float() * self.inv_freq[None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
        cos, sin = emb.cos().to(self.dtype)[:, None, :], emb.sin().to(self.dtype)[:, None, :]  # [T, 1, D]

        x = F.embedding(ids, self.w.embed)  # [T, H]
        step = _Group(x, cos, sin, lengths, starts, caches)
        begin, end = getattr(self.experts, "begin_step", None), getattr(self.experts, "end_step", None)
        if begin is not None:
            begin()
        try:
            split = self._split(lengths) if self._can_overlap() else None
            if split is None:
                trace = self._run_layers(step)
                x = step.x
            else:
                groups = [step.part(0, split), step.part(split, len(lengths))]
                trace = self._run_layers_overlapped(groups)
                x = torch.cat([g.x for g in groups])  # [T, H], original token order
        finally:
            if end is not None:
                end()
        for cache, n in zip(caches, lengths):
            cache.length += n
        self.last_trace = trace
        if self.step_observer is not None:
            self.step_observer(trace, lengths, caches)
        x = rms_norm(x, self.w.final_norm, cfg.rms_norm_eps)
        logits = F.linear(x, self.w.lm_head).float()  # [T, V]
        return list(logits.split(lengths))

    # ---- layer schedules ---------------------------------------------------------------------------------------

    def _can_overlap(self) -> bool:
        return self.overlap and self.capacity_factor is None and hasattr(self.experts, "submit")

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

    def _run_layers(self, g: _Group) -> StepTrace:
        """Every layer in order over one group, each expert round waited for at once."""
        trace = StepTrace()
        for i, layer in enumerate(self.w.layers):
            routed = self._dense(i, layer, g)
            if routed is None:
                continue
            h, routing = routed
            mlp = self.experts.run(i, h, routing)  # [T, H]
            # The backend may have served a different routing (degraded around a lost expert): trace that one.
            trace.routings[i] = self.experts.effective_routing(i, routing)
            g.x = g.x + self._with_shared(layer, h, mlp)
        return trace

    def _run_layers_overlapped(self, groups: list[_Group]) -> StepTrace:
        """Ping-pong: at layer i, group A finishes layer i-1 (waits for its expert round), runs its dense part of
        layer i and submits its round; then B does the same. So B's dense work runs while A's round is in flight,
        and A's next dense work while B's is."""
        parts: dict[int, list[Routing | None]] = {}
        for i, layer in enumerate(self.w.layers):
            for n, g in enumerate(groups):
                if g.pending is not None:
                    self._collect(g, n, parts)
                routed = self._dense(i, layer, g)
                if routed is not None:
                    h, routing = routed
                    g.pending = (i, h, routing, self.experts.submit(i, h, routing))
        for n, g in enumerate(groups):
            if g.pending is not None:
                self._collect(g, n, parts)
        # One routing per layer for the whole step, tokens in the original order (A's then B's).
        return StepTrace(routings={i: concat_routings(p) for i, p in sorted(parts.items())})

    def _collect(self, g: _Group, n: int, parts: dict[int, list[Routing | None]]) -> None:
        """Wait for group g's pending expert round and finish that layer for it (shared expert, residual)."""
        i, h, routing, pending = g.pending
        g.pending = None
        mlp = self.experts.wait(pending)  # [T_g, H]
        parts.setdefault(i, [None, None])[n] = self.experts.effective_routing(i, routing)
        g.x = g.x + self._with_shared(self.w.layers[i], h, mlp)

    def _dense(self, i: int, layer, g: _Group) -> tuple[torch.Tensor, Routing] | None:
        """Group g's dense part of layer i: attention, and either the dense MLP (a layer without experts: done,
        returns None) or the gate -> (h [T_g, H], routing) for the expert round."""
        cfg = self.cfg
        h = rms_norm(g.x, layer.input_norm, cfg.rms_norm_eps)  # [T_g, H]
        g.x = g.x + self._attention(i, layer.attention, h, g.cos, g.sin, g.lengths, g.starts, g.caches)
        h = rms_norm(g.x, layer.post_attention_norm, cfg.rms_norm_eps)
        if layer.router is None:
            g.x = g.x + gated_mlp(h, layer.dense_mlp, self.act)
            return None
        return h, route(F.linear(h, layer.router), cfg.top_k, cfg.norm_topk_prob, self.capacity_factor)

    def _with_shared(self, layer, h: torch.Tensor, mlp: torch.Tensor) -> torch.Tensor:
        """The routed experts' output plus the (gated) shared expert where the layer has one. h, mlp: [T, H]."""
        if layer.shared_expert is None:
            return mlp
        gate = torch.sigmoid(F.linear(h, layer.shared_expert_gate))  # [T, 1]
        return mlp + gate * gated_mlp(h, layer.shared_expert, self.act)

    def _attention(
        self,
        layer: int,
        w: AttentionWeights,
        h: torch.Tensor,  # [T, H]
        cos: torch.Tensor,
        sin: torch.Tensor,
        lengths: list[int],
        starts: list[int],
        caches: list[KVCache],
    ) -> torch.Tensor:
        cfg = self.cfg
        q = F.linear(h, w.q, w.q_bias)  # [T, nh*D]
        k = F.linear(h, w.k, w.k_bias)  # [T, kvh*D]
        v = F.linear(h, w.v, w.v_bias)  # [T, kvh*D]
        if w.q_norm is not None:
            q = rms_norm(q, w.q_norm, cfg.rms_norm_eps)
            k = rms_norm(k, w.k_norm, cfg.rms_norm_eps)
        if cfg.clip_qkv is not None:
            q, k, v = (t.clamp(-cfg.clip_qkv, cfg.clip_qkv) for t in (q, k, v))
        q = q.view(-1, cfg.num_heads, cfg.head_dim)  # [T, nh, D]
        k = k.view(-1, cfg.num_kv_heads, cfg.head_dim)  # [T, kvh, D]
        v = v.view(-1, cfg.num_kv_heads, cfg.head_dim)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        window = cfg.sliding_window if layer in cfg.sliding_layers else None
        gqa = cfg.num_heads != cfg.num_kv_heads

        outs: list[torch.Tensor | None] = [None] * len(lengths)
        decode_rows: list[int] = []  # sequences adding exactly one token: attended together in one call
        for i, (q_s, k_s, v_s, start, cache) in enumerate(zip(
            q.split(lengths), k.split(lengths), v.split(lengths), starts, caches
        )):
            keys, values = _append(cache, layer, k_s, v_s)  # [S+start, kvh, D]
            if q_s.shape[0] == 1 and window is None:
                decode_rows.append(i)
                continue
            mask = _attention_mask(q_s.shape[0], start, window)
            out = F.scaled_dot_product_attention(
                q_s.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),  # [nh, S, D], [kvh, L, D]
                attn_mask=mask, is_causal=mask is None and start == 0 and q_s.shape[0] > 1, enable_gqa=gqa,
            )  # [nh, S, D]
            outs[i] = out.transpose(0, 1).reshape(q_s.shape[0], -1)
        if decode_rows:
            for i, out in zip(decode_rows, self._batched_decode_attention(q, lengths, caches, layer, decode_rows)):
                outs[i] = out
        return F.linear(torch.cat(outs), w.o)  # [T, H]

    def _batched_decode_attention(
        self, q: torch.Tensor, lengths: list[int], caches: list[KVCache], layer: int, rows: list[int]
    ) -> list[torch.Tensor]:
        """One attention call for every sequence that adds a single token: pad their histories to the longest and
        mask the padding. Per-sequence calls cost ~0.2 ms each in Python and dominate decode steps at batch 32."""
        cfg = self.cfg
        offsets = torch.tensor([0, *lengths]).cumsum(0)
        q_rows = q[offsets[rows]]  # [B, nh, D]: each row's only query
        keys = torch.nn.utils.rnn.pad_sequence([caches[i].keys[layer] for i in rows], batch_first=True)
        values = torch.nn.utils.rnn.pad_sequence([caches[i].values[layer] for i in rows], batch_first=True)
        history = torch.tensor([caches[i].keys[layer].shape[0] for i in rows])  # [B]
        mask = torch.arange(keys.shape[1])[None, :] < history[:, None]  # [B, L]: True = a real position
        out = F.scaled_dot_product_attention(
            q_rows[:, :, None, :],  # [B, nh, 1, D]
            keys.transpose(1, 2), values.transpose(1, 2),  # [B, kvh, L, D]
            attn_mask=mask[:, None, None, :], enable_gqa=cfg.num_heads != cfg.num_kv_heads,
        )  # [B, nh, 1, D]
        return list(out.reshape(len(rows), 1, -1).unbind(0))  # B x [1, nh*D]


def _append(cache: KVCache, layer: int, k_new: torch.Tensor, v_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Add this step's keys/values ([S, kvh, D]) to the cache; returns the whole history."""
    if cache.keys[layer] is not None:
        k_new = torch.cat([cache.keys[layer], k_new])
        v_new = torch.cat([cache.values[layer], v_new])
    cache.keys[layer], cache.values[layer] = k_new, v_new
    return k_new, v_new


def _attention_mask(num_new: int, start: int, window: int | None) -> torch.Tensor | None:
    """Boolean [S, start+S] mask (True = attend), or None when plain causal (or no) masking is exact."""
    if window is None and (start == 0 or num_new == 1):
        return None  # is_causal covers a fresh prefill; a single new token attends to everything before it
    q_pos = torch.arange(start, start + num_new)[:, None]
    k_pos = torch.arange(start + num_new)[None, :]
    mask = k_pos <= q_pos
    if window is not None:
        mask &= (q_pos - k_pos) < window
    return mask
