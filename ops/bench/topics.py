"""A mixed-topic workload for expert-affinity admission (README: Offload): router-side dense weights bent so that
routing follows a token's "topic", on models whose own routing does not (the benchmark model has random weights; the
embedded model's routing is not topic-specific: router_service/affinity_sim.py's recorded-trace test).

`make_topical` adds ±strength × a unit direction u to the embeddings of the two halves of the vocabulary, to the gate
rows of the two halves of the experts (every MoE layer) and to the lm_head rows of the two vocabulary halves. The
residual stream then carries ±u: topic A's tokens route to experts [0, E/2) and their decode picks topic-A tokens,
topic B's to [E/2, E). Only the router's weights change (embeddings, gates, lm_head), so it applies to a served mesh's
router after its actors loaded their experts. No Ray.
"""

from __future__ import annotations

import torch


def make_topical(weights, num_experts: int, strength: float = 3.0, seed: int = 0) -> None:
    """Bend DenseWeights in place (see the module doc). strength: the added vector's norm in units of the tensor's
    mean row norm (scale-free: the same on the tiny test model and the benchmark model)."""
    embed = weights.embed  # [V, H]
    vocab, hidden = embed.shape
    u = torch.randn(hidden, generator=torch.Generator().manual_seed(seed))
    u = u / u.norm()  # [H], float32 on the host
    topic_v = torch.where(torch.arange(vocab) < vocab // 2, 1.0, -1.0)  # [V]: topic A +, topic B -
    topic_e = torch.where(torch.arange(num_experts) < num_experts // 2, 1.0, -1.0)  # [E]: A's experts +, B's -
    with torch.no_grad():
        _add_direction(embed, topic_v, u, strength)
        for layer in weights.layers:
            if layer.router is not None:
                _add_direction(layer.router, topic_e, u, strength)
        head = weights.lm_head
        if head is not None and head.data_ptr() != embed.data_ptr():  # tied: the embeddings already carry it
            _add_direction(head, topic_v, u, strength)


def _add_direction(rows: torch.Tensor, signs: torch.Tensor, u: torch.Tensor, strength: float) -> None:
    """rows [N, H] += strength × mean row norm × signs [N] ⊗ u [H], in the tensor's dtype and device."""
    scale = strength * float(rows.float().norm(dim=1).mean())
    rows += (scale * signs[:, None] * u[None, :]).to(rows.dtype).to(rows.device)


def topic_prompt(topic: int, length: int, vocab: int, seed: int) -> list[int]:
    """length token ids from topic 0's half of the vocabulary [0, V/2) or topic 1's [V/2, V)."""
    half = vocab // 2
    ids = torch.randint(0, half, (length,), generator=torch.Generator().manual_seed(seed))
    return (ids + topic * half).tolist()
