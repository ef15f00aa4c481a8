"""Where a failed expert call goes, and a layer's calls over retry rounds. Pure (no Ray, no transport): the
dispatcher (router_service/dispatch.py) sends and gathers; these decide and keep the books.

  replan_failed  a failed call's rows -> calls to the other live replicas of the same shards (None: a shard has none)
  CallRounds     which calls came back, which are still owed an answer, and the calls that replaced failed ones

Within one step a failed call's tokens go to another replica of the same shard, so the step's result is the
fault-free one; a shard without another replica ends the attempt, and the dispatcher routes the layer again under the
no-replica policy (at most MAX_LAYER_ATTEMPTS times).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..cluster.routing_table import Shard, split_tokens
from .dispatch_plan import ActorCall, add_rows

MAX_LAYER_ATTEMPTS = 8  # a layer whose calls keep failing (not just moving to another replica) gives up
MAX_CALL_ROUNDS = 4  # retry rounds within one attempt


def replan_failed(layer: int, failed: ActorCall,
                  live_replicas: Callable[[Shard], Sequence[str]]) -> list[ActorCall] | None:
    """The failed call's rows, expert by expert, split over the shard's other live replicas in contiguous chunks
    (split_tokens), merged into one call per actor. None when a shard has no replica but the failed one."""
    replan: dict[str, ActorCall] = {}
    for expert, token_idx, slot_idx in zip(failed.experts, failed.token_idx, failed.slot_idx):
        others = [a for a in live_replicas((layer, expert)) if a != failed.actor]
        if not others:
            return None
        for actor, start, end in split_tokens(others, int(token_idx.numel())):
            add_rows(replan, actor, expert, token_idx[start:end], slot_idx[start:end])
    return list(replan.values())


class CallRounds:
    """A layer's calls over retry rounds. `calls` is the caller's list and grows: a failed call's replacements are
    appended (and owed an answer next round); `outputs` then keeps only the calls that served, aligned with theirs."""

    def __init__(self, calls: list[ActorCall]):
        self.calls = calls
        self.pending: list[int] = list(range(len(calls)))  # indices into calls owed an answer this round
        self._done: dict[int, torch.Tensor] = {}

    def settle(self, results: Sequence[torch.Tensor | BaseException], succeeded: Callable[[str], None],
               failed: Callable[[ActorCall, BaseException], list[ActorCall] | None]) -> bool:
        """Record this round's results (aligned with `pending`), in order: succeeded(actor) for an output,
        failed(call, error) -> its replacement calls for an error. False as soon as a failed call has no replacement
        (a shard ran out of replicas); else the replacements are next round's `pending`."""
        retry: list[int] = []
        for i, result in zip(self.pending, results):
            call = self.calls[i]
            if not isinstance(result, BaseException):
                succeeded(call.actor)
                self._done[i] = result
                continue
            replacement = failed(call, result)
            if replacement is None:
                return False
            for new_call in replacement:
                self.calls.append(new_call)
                retry.append(len(self.calls) - 1)
        self.pending = retry
        return True

    def outputs(self) -> list[torch.Tensor] | None:
        """Outputs aligned with `calls`, trimmed in place to the calls that served (the failed ones dropped), or None
        while a call is still owed an answer."""
        if self.pending:
            return None
        served = sorted(self._done)
        self.calls[:] = [self.calls[i] for i in served]
        return [self._done[i] for i in served]
