"""Gated DeltaNet (Qwen3-Next / Qwen3.5 linear-attention layers): the math as pure functions, and the layer.

Per value head, a recurrent matrix S [dk, dv] replaces the KV history. For token t with (L2-normalised) key k_t,
query q_t (also scaled by dk^-0.5), value v_t, decay g_t <= 0 and write strength beta_t in (0, 1):
    S <- exp(g_t) * S;   S <- S + k_t (beta_t * (v_t - S^T k_t))^T;   o_t = S^T q_t
(the delta rule: only what S does not already predict for k_t is written). `recurrent_step` runs that one token at a
time (decode); `chunked` computes the same over chunks of 64 tokens with a triangular solve per chunk (prefill), as
transformers' torch_chunk_gated_delta_rule does, from any starting state, so a prompt fed in pieces gives the same
result as fed whole. q, k and v come out of a depthwise causal conv1d (kernel K, SiLU) whose state is the last K-1
inputs of the sequence (`causal_conv`).

Each key head serves num_v_heads // num_k_heads consecutive value heads (q and k repeated). The recurrent state and
the delta-rule arithmetic are float32 whatever the model dtype (as transformers); the conv state is in the model
dtype. Everything here is per sequence or per batch of sequences at the same step; the state lives in the caller's
state cache (experts/state_cache.py) or, for a cacheless forward, starts at zero and is dropped.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .config import MoEModelConfig
from .device_rule import tensor_on
from .ffn import activation

# The delta rule's arithmetic and state dtype (transformers: float32 whatever the model's); a module constant so a
# test can run the same code in float64 and see that chunk boundaries change nothing beyond float32 rounding.
MATH_DTYPE = torch.float32
CHUNK = 64  # transformers' chunk_size: where the chunked form splits (results do not depend on it beyond rounding)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x² + eps) over the last dim (FLA's and transformers' l2norm)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def causal_conv(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, act
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv1d continuing from `state`. x: [B, C, S] new inputs; state: [B, C, K-1] the previous
    K-1 inputs (zeros at a sequence's start); weight: [C, K]. -> (act(conv) [B, C, S], new state [B, C, K-1])."""
    k = weight.shape[-1]
    full = torch.cat([state.to(x.dtype), x], dim=-1)  # [B, C, K-1+S]
    out = F.conv1d(full.to(weight.dtype), weight.unsqueeze(1), groups=weight.shape[0])  # [B, C, S]
    return act(out).to(x.dtype), full[..., full.shape[-1] - (k - 1):]


def _prepare(q, k, v, g, beta, num_v_heads: int):
    """[B, S, nk|nv, D] inputs -> float32 [B, nv, S, D] (q, k repeated over their value heads, L2-normalised, q
    scaled by D^-0.5) and g, beta [B, nv, S]."""
    rep = num_v_heads // q.shape[2]
    if rep > 1:
        q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
    q, k, v, beta, g = (t.transpose(1, 2).to(MATH_DTYPE, memory_format=torch.contiguous_format)
                        for t in (q, k, v, beta, g))
    q, k = l2norm(q), l2norm(k)
    return q * q.shape[-1] ** -0.5, k, v, g, beta


def recurrent_step(q, k, v, g, beta, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per sequence (decode). q, k: [B, 1, nk, dk]; v: [B, 1, nv, dv]; g, beta: [B, 1, nv]; state:
    [B, nv, dk, dv] float32. -> (o [B, 1, nv, dv] in v's dtype, new state)."""
    dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, v.shape[2])  # [B, nv, 1, d], [B, nv, 1]
    s = state.to(MATH_DTYPE) * g[:, :, 0].exp()[..., None, None]  # [B, nv, dk, dv]
    out, s = delta_update(s, q[:, :, 0], k[:, :, 0], v[:, :, 0], beta[:, :, 0])  # [B, nv, dv]
    return out[:, None].to(dtype), s


def delta_update(s: torch.Tensor, q_t: torch.Tensor, k_t: torch.Tensor, v_t: torch.Tensor, beta_t: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """One token's delta-rule write and read on an already decayed state (shared with Kimi's KDA, whose decay is
    per key channel). s: [B, h, dk, dv]; q_t, k_t: [B, h, dk]; v_t: [B, h, dv]; beta_t: [B, h].
    -> (o [B, h, dv], new state)."""
    predicted = (s * k_t.unsqueeze(-1)).sum(dim=-2)  # [B, h, dv]
    delta = (v_t - predicted) * beta_t.unsqueeze(-1)
    s = s + k_t.unsqueeze(-1) * delta.unsqueeze(-2)
    return (s * q_t.unsqueeze(-1)).sum(dim=-2), s


def chunked(q, k, v, g, beta, state: torch.Tensor, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """A run of tokens (prefill, or a prompt chunk), continuing from `state`. q, k: [B, S, nk, dk]; v: [B, S, nv,
    dv]; g, beta: [B, S, nv]; state [B, nv, dk, dv] float32. -> (o [B, S, nv, dv] in v's dtype, new state).
    Transformers' chunk algorithm step for step: within a chunk a UT transform (triangular solve) folds the delta
    updates into matmuls; chunks are scanned in order."""
    dtype = v.dtype
    seq = q.shape[1]
    q, k, v, g, beta = _prepare(q, k, v, g, beta, v.shape[2])  # [B, nv, S, d]
    pad = (chunk - seq % chunk) % chunk
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    beta, g = (F.pad(t, (0, pad)) for t in (beta, g))
    b, h = q.shape[:2]
    v_beta, k_beta = v * beta.unsqueeze(-1), k * beta.unsqueeze(-1)
    q, k, k_beta, v_beta = (t.reshape(b, h, -1, chunk, t.shape[-1]) for t in (q, k, k_beta, v_beta))  # [B,nv,N,C,d]
    g = g.reshape(b, h, -1, chunk)  # [B, nv, N, C]
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    cum = g.cumsum(dim=3)  # log of the decay from the chunk's start to each position
    pair = (cum.unsqueeze(4) - cum.unsqueeze(3)).masked_fill(upper, float("-inf")).exp()  # [B, nv, N, C, C]
    ut = (k_beta @ k.transpose(-1, -2)) * pair
    intra = (q @ k.transpose(-1, -2)) * pair
    decayed_k_beta = k_beta * cum.exp().unsqueeze(-1)
    new_values = torch.linalg.solve_triangular(ut, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(ut, decayed_k_beta, upper=False, unitriangular=True)
    q = q * cum.exp().unsqueeze(-1)
    k = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()[..., None, None]  # [B, nv, N, 1, 1]
    return scan_chunks(q, k, intra, new_values, k_cumdecay, chunk_decay, state, seq, dtype)


def scan_chunks(q: torch.Tensor, k: torch.Tensor, intra: torch.Tensor, new_values: torch.Tensor,
                k_cumdecay: torch.Tensor, chunk_decay: torch.Tensor, state: torch.Tensor, seq: int,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunks in order, carrying the state (shared with Kimi's KDA). Per chunk n: q, k [B, h, N, C, dk] already
    scaled by the decay from the chunk's start / to its end; intra [B, h, N, C, C] the in-chunk query-key weights;
    new_values, k_cumdecay [B, h, N, C, dv|dk] the UT-transformed values and decayed keys; chunk_decay [B, h, N, 1|dk,
    1] the whole chunk's decay of the state; state [B, h, dk, dv]. -> (o [B, S, h, dv] in `dtype`, new state)."""
    s = state.to(new_values)
    out = torch.zeros_like(new_values)
    for i in range(q.shape[2]):
        v_new = new_values[:, :, i] - k_cumdecay[:, :, i] @ s
        out[:, :, i] = q[:, :, i] @ s + intra[:, :, i] @ v_new
        s = s * chunk_decay[:, :, i] + k[:, :, i].transpose(-1, -2) @ v_new
    out = out.reshape(*out.shape[:2], -1, out.shape[-1])[:, :, :seq]  # [B, h, S, dv]
    return out.transpose(1, 2).to(dtype, memory_format=torch.contiguous_format), s


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3NextRMSNormGated: w * rms_norm(x) (cast back to x's dtype), times silu(gate) in float32. x, gate:
    [..., dv]; weight [dv]."""
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * x32.to(dtype) * F.silu(gate.float())).to(dtype)


class GatedDeltaNet:
    """A Gated DeltaNet layer over a step's flattened tokens (sequences of any lengths side by side), reading and
    writing each sequence's conv and recurrent state in a state cache. Sequences feeding one token (decode) share one
    batched recurrent step; longer runs (prefill, prompt chunks) go through `chunked` one sequence at a time.
    Kimi's KDA (experts/kda.py) is this layer with its own `_inputs`, `_output` and delta-rule forms."""

    is_linear = True
    cache_spec: dict = {}  # nothing in the paged KV cache
    # The delta rule's two forms (Kimi's KDA swaps in its per-channel-decay ones); staticmethod: plain functions.
    recurrent_step = staticmethod(recurrent_step)
    chunked = staticmethod(chunked)

    def __init__(self, cfg: MoEModelConfig, w):
        self.w = w  # experts/weights_qwen3_next.py GatedDeltaWeights
        self.d = cfg.gated_delta
        self.eps = cfg.rms_norm_eps
        self.act = activation(cfg.hidden_act)

    def forward(self, h: torch.Tensor, lengths: list[int], conv: list[torch.Tensor] | None,
                recurrent: list[torch.Tensor] | None) -> torch.Tensor:
        """h [T, H] (sequence i's lengths[i] rows after sequence i-1's); conv / recurrent: per sequence its state
        tensors ([C, K-1], [nv, dk, dv]) updated in place, or None (each sequence starts from zero, nothing kept).
        -> [T, H]."""
        mixed, z, beta, g = self._inputs(h)
        outs: list[torch.Tensor | None] = [None] * len(lengths)
        starts = [sum(lengths[:i]) for i in range(len(lengths))]
        decode = [i for i, n in enumerate(lengths) if n == 1]
        if decode:
            rows = tensor_on([starts[i] for i in decode], torch.int64, h.device)  # [B]
            outs_d = self._run([mixed[rows][:, :, None]], [g[rows][:, None]], [beta[rows][:, None]],
                               [i for i in decode], conv, recurrent, batched=True)
            for i, o in zip(decode, outs_d):
                outs[i] = o
        for i, n in enumerate(lengths):
            if n != 1:
                s = slice(starts[i], starts[i] + n)
                outs[i] = self._run([mixed[s].t()[None]], [g[s][None]], [beta[s][None]], [i], conv, recurrent,
                                    batched=False)[0]
        core = torch.cat(outs)  # [T, nv, dv]
        return self._output(core, z)

    def _inputs(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """h [T, H] -> (conv inputs [T, C], output gate [T, nv, dv], beta [T, nv], decay log g [T, nv] float32)."""
        d, w = self.d, self.w
        mixed = F.linear(h, w.qkv)  # [T, C]
        z = F.linear(h, w.z).view(-1, d.num_v_heads, d.v_head_dim)  # [T, nv, dv]
        beta = F.linear(h, w.b).sigmoid()  # [T, nv]
        g = -w.A_log.float().exp() * F.softplus(F.linear(h, w.a).float() + w.dt_bias)  # [T, nv] float32
        return mixed, z, beta, g

    def _output(self, core: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """core [T, nv, dv], gate [T, nv, dv] -> [T, H]."""
        core = gated_rms_norm(core, gate, self.w.norm, self.eps).reshape(core.shape[0], -1)  # [T, nv*dv]
        return F.linear(core, self.w.out)  # [T, H]

    def _run(self, mixed: list[torch.Tensor], g: list[torch.Tensor], beta: list[torch.Tensor], seqs: list[int],
             conv: list[torch.Tensor] | None, recurrent: list[torch.Tensor] | None, batched: bool
             ) -> list[torch.Tensor]:
        """Conv + delta rule for `seqs`: batched (one token each: mixed [B, C, 1]) or one sequence ([1, C, S]).
        -> per sequence its core output [S_i, nv, dv]."""
        d = self.d
        x, g_, beta_ = mixed[0], g[0], beta[0]  # [B, C, S], [B, S, nv], [B, S, nv]
        bsz, channels = x.shape[0], x.shape[1]
        if conv is None:
            conv_in = x.new_zeros(bsz, channels, d.conv_kernel - 1)
            rec_in = x.new_zeros(bsz, d.num_v_heads, d.k_head_dim, d.v_head_dim, dtype=MATH_DTYPE)
        else:
            conv_in = torch.stack([conv[i] for i in seqs])  # [B, C, K-1]
            rec_in = torch.stack([recurrent[i] for i in seqs])  # [B, nv, dk, dv]
        x, conv_out = causal_conv(x, conv_in, self.w.conv, self.act)  # [B, C, S]
        x = x.transpose(1, 2)  # [B, S, C]
        q, k, v = x.split([d.key_dim, d.key_dim, d.value_dim], dim=-1)
        q = q.reshape(bsz, -1, d.num_k_heads, d.k_head_dim)
        k = k.reshape(bsz, -1, d.num_k_heads, d.k_head_dim)
        v = v.reshape(bsz, -1, d.num_v_heads, d.v_head_dim)
        step = self.recurrent_step if batched else self.chunked
        out, rec_out = step(q, k, v, g_, beta_, rec_in)  # [B, S, nv, dv], [B, nv, dk, dv]
        if conv is not None:
            for j, i in enumerate(seqs):
                conv[i].copy_(conv_out[j])
                recurrent[i].copy_(rec_out[j])
        return list(out.unbind(0)) if batched else [out[0]]
