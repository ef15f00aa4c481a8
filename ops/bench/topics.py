"""A mixed-topic workload for expert-affinity admission (README: Offload): router-side dense weights bent so that
routing follows a token's "topic", on models whose own routing does not (the benchmark model has random weights; the
embedded model's routing is not topic-specific: router_service/affinity_sim.py's recorded-trace test).

`make_topical` adds ±strength × a unit direction u to the embeddings of the two halves of the vocabulary, to the gate
rows of the two halves of the experts (every MoE layer) and to the lm_head rows of the two vocabulary halves. The
residual stream then carries ±u: topic A's tokens route to experts [0, E/2) and their decode picks topic-A tokens,
topic B's to [E/2, E). With n > 2 topics the vocabulary and the experts split into n contiguous parts, and part t gets
strength × v_t, where the v_t are the corners of a regular simplex (unit vectors, v_t · v_s = -1/(n-1)): each topic's
direction points away from every other's, as ±u does for two. Only the router's weights change (embeddings, gates,
lm_head), so it applies to a served mesh's router after its actors loaded their experts. No Ray.
"""

from __future__ import annotations

import torch


def make_topical(weights, num_experts: int, strength: float = 3.0, seed: int = 0, topics: int = 2) -> None:
    """Bend DenseWeights in place (see the module doc). strength: the added vector's norm in units of the tensor's
    mean row norm (scale-free: the same on the tiny test model and the benchmark model); topics: how many (each gets
    a contiguous 1/topics of the vocabulary and of the experts; num_experts must divide evenly)."""
    assert topics >= 2 and num_experts % topics == 0, (topics, num_experts)
    embed = weights.embed  # [V, H]
    vocab, hidden = embed.shape
    u = topic_directions(hidden, topics, seed)  # [n, H]
    part_v = torch.div(torch.arange(vocab) * topics, vocab, rounding_mode="floor")  # [V]: each token's topic
    part_e = torch.div(torch.arange(num_experts) * topics, num_experts, rounding_mode="floor")  # [E]
    with torch.no_grad():
        _add_direction(embed, u[part_v], strength)
        for layer in weights.layers:
            if layer.router is not None:
                _add_direction(layer.router, u[part_e], strength)
        head = weights.lm_head
        if head is not None and head.data_ptr() != embed.data_ptr():  # tied: the embeddings already carry it
            _add_direction(head, u[part_v], strength)


def topic_directions(hidden: int, topics: int, seed: int = 0) -> torch.Tensor:
    """[topics, H] unit directions: +u and -u for two topics; for more, a regular simplex's corners (v_t · v_s =
    -1/(n-1)) spanned by random orthonormal vectors."""
    gen = torch.Generator().manual_seed(seed)
    if topics == 2:
        u = torch.randn(hidden, generator=gen)
        u = u / u.norm()  # [H], float32 on the host
        return torch.stack([u, -u])
    q, _ = torch.linalg.qr(torch.randn(hidden, topics, generator=gen))  # [H, n], orthonormal columns
    v = q.T - q.T.mean(dim=0, keepdim=True)  # [n, H]: centred, so the corners point away from each other
    return v / v.norm(dim=1, keepdim=True)


def _add_direction(rows: torch.Tensor, directions: torch.Tensor, strength: float) -> None:
    """rows [N, H] += strength × mean row norm × directions [N, H], in the tensor's dtype and device."""
    scale = strength * float(rows.float().norm(dim=1).mean())
    rows += (scale * directions).to(rows.dtype).to(rows.device)


def topic_prompt(topic: int, length: int, vocab: int, seed: int, topics: int = 2) -> list[int]:
    """length token ids from topic `topic`'s part of the vocabulary (the t-th of `topics` contiguous parts; its ids
    are the ones make_topical gave that topic)."""
    if topics == 2:  # as the committed two-topic runs drew them
        half = vocab // 2
        ids = torch.randint(0, half, (length,), generator=torch.Generator().manual_seed(seed))
        return (ids + topic * half).tolist()
    ids = torch.randint(0, vocab, (4 * topics * length,), generator=torch.Generator().manual_seed(seed))
    mine = ids[torch.div(ids * topics, vocab, rounding_mode="floor") == topic]
    assert mine.numel() >= length, (topic, topics, vocab)
    return mine[:length].tolist()
