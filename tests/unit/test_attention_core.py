"""The attention core against the obvious formula: masks, windows, GQA, sinks, padded decode."""

from __future__ import annotations

import torch

from expertmesh.experts.attention_core import attend_decode, attend_prefill, default_scale


def _naive(q, k, v, q_pos, window=None, sinks=None):
    """q [S, nh, D], k/v [L, kvh, D]: softmax(q k^T * scale + mask [+ sink]) v, one head at a time."""
    nh, kvh = q.shape[1], k.shape[1]
    out = torch.zeros(q.shape[0], nh, v.shape[-1], dtype=torch.float64)
    for h in range(nh):
        kh, vh = k[:, h // (nh // kvh)].double(), v[:, h // (nh // kvh)].double()
        for s, pos in enumerate(q_pos):
            scores = (kh @ q[s, h].double()) * default_scale(q.shape[-1])  # [L]
            allowed = torch.arange(k.shape[0]) <= pos
            if window is not None:
                allowed &= pos - torch.arange(k.shape[0]) < window
            scores = scores.masked_fill(~allowed, float("-inf"))
            extra = torch.tensor([float(sinks[h])], dtype=torch.float64) if sinks is not None else torch.zeros(0)
            probs = torch.softmax(torch.cat([scores, extra.double()]), 0)[: k.shape[0]]
            out[s, h] = probs @ vh
    return out.reshape(q.shape[0], -1).float()


def _qkv(seed, s, length, nh=4, kvh=2, d=8, dv=6):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(s, nh, d, generator=g), torch.randn(length, kvh, d, generator=g),
            torch.randn(length, kvh, dv, generator=g))


def test_prefill_matches_the_formula_with_windows_and_sinks():
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    for start, window, sink in [(0, None, None), (3, None, None), (0, 4, None), (5, 3, None), (0, None, sinks),
                                (2, 3, sinks)]:
        q, k, v = _qkv(start, 6, start + 6)
        got = attend_prefill(q, k, v, start, default_scale(8), window, sink)
        want = _naive(q, k, v, list(range(start, start + 6)), window, sink)
        assert torch.allclose(got, want, atol=1e-5), (start, window, sink is not None)


def test_decode_over_padded_histories_matches_each_sequence_alone():
    sinks = torch.tensor([0.3, 0.1, -0.2, 1.0])
    lengths = [5, 9, 1]
    for window, sink in [(None, None), (4, None), (None, sinks), (3, sinks)]:
        qs, ks, vs = zip(*(_qkv(10 + n, 1, n) for n in lengths))
        k = torch.nn.utils.rnn.pad_sequence(ks, batch_first=True)  # [B, L, kvh, D]
        v = torch.nn.utils.rnn.pad_sequence(vs, batch_first=True)
        got = attend_decode(torch.cat(qs), k, v, torch.tensor(lengths), default_scale(8), window, sink)  # [B, nh*Dv]
        for b, n in enumerate(lengths):
            want = _naive(qs[b], ks[b], vs[b], [n - 1], window, sink)
            assert torch.allclose(got[b:b + 1], want, atol=1e-5), (b, window, sink is not None)
