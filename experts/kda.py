"""Kimi Delta Attention (Kimi-Linear's linear-attention layers, transformers' KimiLinearDeltaAttention): the math as
pure functions, and the layer.

The gated delta rule of experts/gated_delta.py with the decay per key channel instead of per head: for head h and
token t, S [dk, dv] is decayed row by row, S <- diag(exp(g_t)) S with g_t [dk] <= 0, then written and read as there
(`delta_update`). g_t = -exp(A_log[h]) * softplus(f_b(f_a(x_t)) + dt_bias): a low-rank forget gate (rank dk),
softplus computed as transformers does (x above 20 kept as is, else log(1 + exp(x))). There are as many key as value
heads (no grouping); q and k are L2-normalised as FLA's kernel does (x / sqrt(sum x² + eps), not x * rsqrt(..): the
last bits differ) and q scaled by dk^-0.5. q, k and v each pass a depthwise causal conv1d (kernel K, SiLU; separate
`q_conv1d` / `k_conv1d` / `v_conv1d` on disk, one conv over their concatenated channels here, the same thing for a
depthwise conv) whose state is the last K-1 inputs. The output is RMS-normalised per head in float32, times its
weight and sigmoid of a low-rank output gate g_b(g_a(x)), cast back, then o_proj.

`chunked` follows transformers' chunk_kimi_delta_attention (64-token chunks, a triangular solve per chunk) from any
starting state, building each chunk's per-channel decay weights [C, C, dk] one chunk at a time so memory stays at one
chunk's; the scan over chunks is gated_delta.scan_chunks. The state lives in the state cache
(experts/state_cache.py) as the Gated DeltaNet's does (its conv inputs at the model dtype, recurrent matrix float32).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import gated_delta
from .config import MoEModelConfig
from .gated_delta import CHUNK, GatedDeltaNet, delta_update, scan_chunks


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """FLA's l2norm as transformers' KDA writes it: x / sqrt(sum x² + eps) over the last dim."""
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def forget_gate(f: torch.Tensor, dt_bias: torch.Tensor, A_log: torch.Tensor, head_dim: int) -> torch.Tensor:
    """f [T, h*dk] (f_b(f_a(x)) in the model dtype), dt_bias [h*dk], A_log [h] -> g [T, h, dk] float32 <= 0."""
    g = (f.float() + dt_bias.float()).view(f.shape[0], -1, head_dim)  # [T, h, dk]
    softplus = torch.where(g > 20.0, g, torch.log(1.0 + torch.exp(g)))
    return -A_log.float().exp()[:, None] * softplus


def _prepare(q, k, v, g, beta):
    """[B, S, h, d] inputs -> math-dtype [B, h, S, d] (q, k L2-normalised, q scaled by dk^-0.5); g [B, h, S, dk];
    beta [B, h, S]."""
    dtype = gated_delta.MATH_DTYPE  # read at call time: a test may widen it
    q, k, v, g, beta = (t.transpose(1, 2).to(dtype, memory_format=torch.contiguous_format) for t in (q, k, v, g, beta))
    q, k = l2norm(q), l2norm(k)
    return q * q.shape[-1] ** -0.5, k, v, g, beta


def recurrent_step(q, k, v, g, beta, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per sequence (decode). q, k, v: [B, 1, h, d]; g: [B, 1, h, dk]; beta: [B, 1, h]; state
    [B, h, dk, dv]. -> (o [B, 1, h, dv] in v's dtype, new state)."""
    dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)  # [B, h, 1, d]
    s = state.to(q.dtype) * g[:, :, 0].exp().unsqueeze(-1)  # [B, h, dk, dv]: each key row decays by its channel
    out, s = delta_update(s, q[:, :, 0], k[:, :, 0], v[:, :, 0], beta[:, :, 0])  # [B, h, dv]
    return out[:, None].to(dtype), s


def chunked(q, k, v, g, beta, state: torch.Tensor, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """A run of tokens continuing from `state`. q, k, v: [B, S, h, d]; g: [B, S, h, dk]; beta: [B, S, h]; state
    [B, h, dk, dv]. -> (o [B, S, h, dv] in v's dtype, new state)."""
    dtype, seq = v.dtype, q.shape[1]
    q, k, v, g, beta = _prepare(q, k, v, g, beta)  # [B, h, S, d]
    pad = (chunk - seq % chunk) % chunk
    q, k, v, g = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v, g))
    beta = F.pad(beta, (0, pad))
    b, h = q.shape[:2]
    v_beta, k_beta = v * beta.unsqueeze(-1), k * beta.unsqueeze(-1)
    q, k, g, k_beta, v_beta = (t.reshape(b, h, -1, chunk, t.shape[-1]) for t in (q, k, g, k_beta, v_beta))
    cum = g.cumsum(dim=3)  # [B, h, N, C, dk] log of each channel's decay from the chunk's start
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    ut, intra = [], []
    for n in range(q.shape[2]):  # one chunk's [C, C, dk] decay weights at a time
        c = cum[:, :, n]  # [B, h, C, dk]
        pair = (c.unsqueeze(-2) - c.unsqueeze(-3)).masked_fill(upper[..., None], float("-inf")).exp()  # [B,h,C,C,dk]
        ut.append((k_beta[:, :, n].unsqueeze(-2) * k[:, :, n].unsqueeze(-3) * pair).sum(-1))  # [B, h, C, C]
        intra.append((q[:, :, n].unsqueeze(-2) * k[:, :, n].unsqueeze(-3) * pair).sum(-1))
    ut, intra = torch.stack(ut, dim=2), torch.stack(intra, dim=2)  # [B, h, N, C, C]
    new_values = torch.linalg.solve_triangular(ut, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(ut, k_beta * cum.exp(), upper=False, unitriangular=True)
    last = cum[..., -1:, :]  # [B, h, N, 1, dk]
    q = q * cum.exp()
    k = k * (last - cum).exp()
    chunk_decay = last.exp().transpose(-1, -2)  # [B, h, N, dk, 1]
    return scan_chunks(q, k, intra, new_values, k_cumdecay, chunk_decay, state, seq, dtype)


def sigmoid_gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """KimiLinearRMSNormGated: float32 w * rms_norm(x) * sigmoid(gate), cast back to x's dtype. x, gate [..., d]."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * x32 * torch.sigmoid(gate.float())).to(x.dtype)


class KimiDeltaAttention(GatedDeltaNet):
    """A KDA layer: the Gated DeltaNet layer's per-sequence state handling (decode rows batched, runs chunked) with
    KDA's projections, per-channel decay and sigmoid-gated output norm."""

    recurrent_step = staticmethod(recurrent_step)
    chunked = staticmethod(chunked)

    def __init__(self, cfg: MoEModelConfig, w):
        """w: experts/weights_kimi_linear.py KDAWeights; cfg.gated_delta holds the KDA dims (as many key as value
        heads, dk = dv)."""
        super().__init__(cfg, w)

    def _inputs(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """h [T, H] -> (conv inputs [T, 3*h*d], output gate [T, h, d], beta [T, h], g [T, h, dk] float32)."""
        d, w = self.d, self.w
        mixed = F.linear(h, w.qkv)  # [T, 3*h*d]: q, k, v channels
        gate = F.linear(F.linear(h, w.g_a), w.g_b).view(-1, d.num_v_heads, d.v_head_dim)  # [T, h, d]
        beta = F.linear(h, w.b).sigmoid()  # [T, h]
        g = forget_gate(F.linear(F.linear(h, w.f_a), w.f_b), w.dt_bias, w.A_log, d.k_head_dim)  # [T, h, dk]
        return mixed, gate, beta, g

    def _output(self, core: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """core [T, h, d], gate [T, h, d] -> o_proj(norm(core) * sigmoid(gate)) [T, H]."""
        core = sigmoid_gated_rms_norm(core, gate, self.w.norm, self.eps).reshape(core.shape[0], -1)  # [T, h*d]
        return F.linear(core, self.w.out)
