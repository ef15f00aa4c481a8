"""DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5): MLA whose queries each attend only the top-k past tokens that a
lightning indexer picks, as transformers' DeepseekV32Indexer / GlmMoeDsaIndexer compute them.

The indexer (per layer, small: nh_i heads of d_i dims, one shared key per token):
  q_i   = wq_b(q_resid)                    [T, nh_i, d_i]   q_resid = rms(q_a_proj(h)), MLA's q-LoRA latent
  k_i   = LayerNorm(wk(h)) (with bias)     [T, d_i]         cached per token beside MLA's latent ("index_k")
  RoPE on the first d_rope dims of both: the two halves (V3.2) or interleaved pairs (GLM-5), unlike MLA's own
  w     = weights_proj(h) * nh_i^-0.5      [T, nh_i]        float32 (transformers keeps weights_proj float32)
  score = sum_h w_h * relu(q_i,h . k_i * d_i^-0.5)          [T, L] over the history, in float32
Each query keeps its top `index_topk` scores among the keys causality allows (all of them while the history is
shorter), and MLA attends those only: the boolean mask is the causal mask AND the selection. A decode row whose
history is longer than index_topk gathers only its picked latents and expands those (attention_core._take_picked):
kv_b_proj runs over k tokens instead of the whole history, which is where DSA saves work on long contexts; prefill
rows (different picks per query) attend the whole history under the mask. GLM-5's "shared"
layers run no indexer and reuse the selection of the layer before (kept on the step's StepLayout per row group,
so micro-batches and decode / prefill groups each keep theirs).

The Hadamard rotation and FP8 scoring of DeepSeek's reference kernels are omitted, as transformers omits them: the
rotation is orthogonal (q.k unchanged) and FP8 is only a precision choice.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .config import MoEModelConfig
from .mla_attention import LORA_NORM_EPS, MLAAttention, _rms, _rotate_half_layout
from .rope_yarn import apply_rotary_pairs
from .weights_deepseek import IndexerWeights, MLAWeights

INDEX_NORM_EPS = 1e-6  # the indexer's k_norm: nn.LayerNorm(d_i, eps=1e-6)


def index_projections(w: IndexerWeights, h: torch.Tensor, q_resid: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor, n_heads: int, rope_dim: int, interleaved: bool
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """h [T, H], q_resid [T, q_r], cos/sin [T, d_rope] -> (q [T, nh_i, d_i], k [T, d_i], weights [T, nh_i] f32)."""
    rotate = apply_rotary_pairs if interleaved else _rotate_half_layout
    d = w.wk.shape[0]
    q = F.linear(q_resid, w.wq_b).view(h.shape[0], n_heads, d)  # [T, nh_i, d_i]
    k = F.layer_norm(F.linear(h, w.wk), (d,), w.k_norm, w.k_norm_bias, INDEX_NORM_EPS)  # [T, d_i]
    q = torch.cat([rotate(q[..., :rope_dim], cos, sin), q[..., rope_dim:]], dim=-1)  # [T, nh_i, d_i]
    k = torch.cat([rotate(k[:, None, :rope_dim], cos, sin)[:, 0], k[:, rope_dim:]], dim=-1)  # [T, d_i]
    weights = F.linear(h.to(w.weights_proj.dtype), w.weights_proj).float() * n_heads ** -0.5  # [T, nh_i]
    return q, k, weights


# Per-head scores are [B, S, nh_i, L] float32 before the heads are summed: a long prompt chunk against a long
# history would take GBs at once (DeepSeek-V3.2: 512 queries x 64 heads x 128k keys = 17 GB), so queries go in pieces
# whose per-head scores stay under this many bytes (the same sums; BLAS may block a smaller matmul differently, so
# equal to float rounding, not bit for bit: the tiny tests never reach a second piece).
SCORE_PIECE_BYTES = 256 << 20


def index_scores(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor,
                 piece_bytes: int = SCORE_PIECE_BYTES) -> torch.Tensor:
    """q [B, S, nh_i, d_i], k [B, L, d_i], weights [B, S, nh_i] -> scores [B, S, L] (float32), summed over heads
    in transformers' order (a matmul over the heads axis)."""
    b, s, heads, d = q.shape
    rows = max(1, piece_bytes // max(1, b * heads * k.shape[1] * 4))  # query rows per piece
    keys = k.float().transpose(-1, -2)[:, None]  # [B, 1, d_i, L]
    out = []
    for lo in range(0, s, rows):
        scores = torch.matmul(q[:, lo:lo + rows].float(), keys) * d ** -0.5  # [B, s', nh_i, L]
        scores = F.relu(scores)
        out.append(torch.matmul(weights[:, lo:lo + rows, None, :], scores)[..., 0, :])  # [B, s', L]
    return out[0] if len(out) == 1 else torch.cat(out, dim=1)


def top_k_picks(scores: torch.Tensor, allowed: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """scores [B, S, L], allowed [B, S, L] bool -> (mask [B, S, L] bool: each query's top k allowed keys, all of them
    when fewer; picks [B, S, min(k, L)] their positions). Disallowed keys score -inf, so a top-k that reaches them
    adds nothing once ANDed with `allowed`."""
    masked = scores.masked_fill(~allowed, float("-inf"))
    picks = masked.topk(min(k, scores.shape[-1]), dim=-1).indices  # [B, S, k]
    return torch.zeros_like(allowed).scatter_(-1, picks, True) & allowed, picks


def top_k_mask(scores: torch.Tensor, allowed: torch.Tensor, k: int) -> torch.Tensor:
    """top_k_picks' mask alone."""
    return top_k_picks(scores, allowed, k)[0]


class DSAAttention(MLAAttention):
    """MLA (naive form) with the DSA top-k selection. `project` also returns the layer's `select` for
    attention_core.attend; a layer without its own indexer (GLM-5 "shared") selects what the previous one did."""

    sparse_index = True

    def __init__(self, cfg: MoEModelConfig, w: MLAWeights):
        super().__init__(cfg, w)
        self.index = w.indexer  # None: a shared layer
        self.index_heads = cfg.index_n_heads
        self.index_topk = cfg.index_topk
        self.index_interleaved = cfg.index_rope_interleaved
        if self.index is not None:
            self.cache_spec["index_k"] = (cfg.index_head_dim,)

    def project(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """h [T, H] -> (q [T, nh, d_qk], {"latent": [T, r + d_rope], "index_k": [T, d_i]}, select)."""
        w = self.w
        q_resid = _rms(F.linear(h, w.q_a, w.q_a_bias), w.q_a_norm, LORA_NORM_EPS)  # [T, q_r]
        q, entries = self._project_from_latent(h, q_resid, cos, sin)
        if self.index is None:
            return q, entries, _reuse_selection
        iq, ik, iw = index_projections(self.index, h, q_resid, cos, sin, self.index_heads, self.d_rope,
                                       self.index_interleaved)
        entries["index_k"] = ik
        topk = self.index_topk

        def select(layout, group: str, rows: torch.Tensor, keys: dict[str, torch.Tensor],
                   allowed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            """rows [B, S] token of [T] per query; keys {name: [B, L, *shape]}; allowed [B, 1, S, L]."""
            scores = index_scores(iq[rows], keys["index_k"], iw[rows])  # [B, S, L]
            mask, picks = top_k_picks(scores, allowed[:, 0], topk)  # [B, S, L], [B, S, k]
            layout.selections[group] = (mask[:, None], picks)
            return layout.selections[group]

        return q, entries, select

    def _project_from_latent(self, h: torch.Tensor, q_resid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """MLAAttention.project with the q-LoRA latent already computed."""
        w, nh = self.w, self.num_heads
        q = F.linear(q_resid, w.q_b).view(h.shape[0], nh, self.d_nope + self.d_rope)  # [T, nh, d_qk]
        q_nope, q_rot = q.split([self.d_nope, self.d_rope], dim=-1)
        latent, k_rot = F.linear(h, w.kv_a, w.kv_a_bias).split([self.rank, self.d_rope], dim=-1)
        latent = _rms(latent, w.kv_a_norm, LORA_NORM_EPS)  # [T, r]
        k_rot = self._rotate(k_rot[:, None, :], cos, sin)[:, 0]  # [T, d_rope]
        q = torch.cat([q_nope, self._rotate(q_rot, cos, sin)], dim=-1)  # [T, nh, d_qk]
        return q, {"latent": torch.cat([latent, k_rot], dim=-1)}


def _reuse_selection(layout, group: str, rows: torch.Tensor, keys: dict[str, torch.Tensor],
                     allowed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GLM-5's shared layer: the selection the previous layer made for this row group (same rows, same keys)."""
    return layout.selections[group]
