"""The decoder of the supported MoE families, in one readable file, with the routed experts behind an interface.

`MoEDecoder` runs embeddings, attention (RoPE, GQA, optional q/k norm, sliding window) with a per-sequence KV cache,
norms, gates and the dense/shared MLPs. The routed experts of each MoE layer are an `ExpertBackend`: in process for
the reference model, Ray actors for the router. Same dense code on both paths, so a difference between them can
only come from the experts' dispatch.

Sequences are flattened into one token axis ([T, H]) for every matmul and every expert call; only the attention core
runs per sequence, so sequences of different lengths (and positions) share a step without padding.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

from .config import MoEModelConfig
from .ffn import activation, gated_mlp
from .gating import Routing, route
from .weights import AttentionWeights, DenseWeights


class ExpertBackend(Protocol):
    def run(self, layer: int, hidden: torch.Tensor, routing: Routing) -> torch.Tensor:
        """hidden: [T, H], routing over k slots -> sum_k weight * expert_k(hidden): [T, H]."""
        ...

    def effective_routing(self, layer: int, routing: Routing) -> Routing:
        """The routing the last `run` of this layer actually served (differs only when it had to degrade)."""
        ...


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
    ):
        self.cfg = cfg
        self.w = weights
        self.experts = experts
        self.capacity_factor = capacity_factor
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

        trace = StepTrace()
        x = F.embedding(ids, self.w.embed)  # [T, H]
        for i, layer in enumerate(self.w.layers):
            h = rms_norm(x, layer.input_norm, cfg.rms_norm_eps)
            x = x + self._attention(i, layer.attention, h, cos, sin, lengths, starts, caches)
            h = rms_norm(x, layer.post_attention_norm, cfg.rms_norm_eps)
            if layer.router is not None:
                routing = route(F.linear(h, layer.router), cfg.top_k, cfg.norm_topk_prob, self.capacity_factor)
                mlp = self.experts.run(i, h, routing)
                # The backend may have served a different routing (degraded around a lost expert): trace that one.
                trace.routings[i] = self.experts.effective_routing(i, routing)
                if layer.shared_expert is not None:
                    gate = torch.sigmoid(F.linear(h, layer.shared_expert_gate))  # [T, 1]
                    mlp = mlp + gate * gated_mlp(h, layer.shared_expert, self.act)
            else:
                mlp = gated_mlp(h, layer.dense_mlp, self.act)
            x = x + mlp
        for cache, n in zip(caches, lengths):
            cache.length += n
        self.last_trace = trace
        if self.step_observer is not None:
            self.step_observer(trace, lengths, caches)
        x = rms_norm(x, self.w.final_norm, cfg.rms_norm_eps)
        logits = F.linear(x, self.w.lm_head).float()  # [T, V]
        return list(logits.split(lengths))

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
