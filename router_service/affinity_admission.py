"""Expert-affinity admission in the continuous batcher (`router.batcher.admission: affinity`; README: Offload).

When more requests wait than decode slots are free, the batcher asks `reorder_waiting` which to take: those whose
predicted experts overlap most with the running batch's (router_service/affinity.py's pure `admit`, with its
fairness bound `router.batcher.affinity_max_wait_s`), so a step calls fewer distinct shards and an offloaded actor
loads fewer. Only the order of admission changes: every request still computes alone in its rows (per-sequence
KV cache, per-request sampling generator), so its tokens are the ones FIFO gives (tests/unit/test_affinity_batching.py).

A prompt's signature is the `affinity_experts` experts its tokens' embeddings pick most often under the first MoE
layer's gate: a prediction made before any compute (it skips the attention before that gate), good enough to group
by and never used for the output. Requests already admitted once (preempted, to be recomputed) keep their place at
the head of the queue. Also here: `shards_called`, the distinct (layer, expert) shards one step routed to, the
"expert loads per step" the batcher exports.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch

from ..experts.device_rule import routing_on_host
from .affinity import Waiting, admit, signature


def prompt_signature(model, prompt_ids: list[int], keep: int) -> frozenset[int]:
    """The `keep` experts (0: 2 × top-k) the prompt's token embeddings pick most often at the first MoE layer."""
    cfg = model.cfg
    layer = cfg.moe_layers[0] if cfg.moe_layers else 0
    ids = torch.tensor(prompt_ids, dtype=torch.int64, device=model.device)  # [S]
    with torch.inference_mode():
        h = torch.nn.functional.embedding(ids, model.w.embed)  # [S, H]
        picks = model.predict_experts(layer, h)  # [S, k]
    return signature(picks.tolist(), keep or 2 * cfg.top_k)  # one device read per prompt


def reorder_waiting(waiting: deque, active: list, free: int, now: float, max_wait_s: float,
                    signature_of: Callable[[object], frozenset[int]], recent: frozenset[int] = frozenset()) -> None:
    """Reorder the batcher's queue in place so its head is what affinity admits into `free` slots. Sequences
    admitted before (admitted ≥ 0) stay first, in queue order; the rest follow in arrival order. recent: the experts
    of the last running batch, the reference while none runs (its shards are the ones the actors hold now: the next
    batch of the same topic loads nothing, one of the other topic reloads them)."""
    again = [s for s in waiting if s.admitted >= 0]
    fresh = [s for s in waiting if s.admitted < 0]
    slots = free - len(again)
    if slots <= 0 or len(fresh) <= slots:
        return  # every fresh one that can be admitted now will be: the order changes nothing
    index = {id(s): i for i, s in enumerate(fresh)}
    candidates = [Waiting(index[id(s)], s.arrived, signature_of(s)) for s in fresh]
    running = {i: signature_of(s) for i, s in enumerate(active)} if active else {-1: recent}
    chosen = admit(candidates, running, slots, now, max_wait_s)
    taken = set(chosen)
    order = again + [fresh[i] for i in chosen] + [s for i, s in enumerate(fresh) if i not in taken]
    waiting.clear()
    waiting.extend(order)


def shards_called(routings: dict) -> int:
    """Distinct (layer, expert) shards a step's routings (layer -> Routing over its tokens) sent tokens to."""
    total = 0
    for routing in routings.values():
        experts = routing_on_host(routing).experts  # [T, K], -1 = dropped
        total += int(torch.unique(experts[experts >= 0]).numel())
    return total
