"""Where a failed expert call goes and a layer's retry rounds (router_service/call_retry.py), without a transport."""

from __future__ import annotations

import torch

from expertmesh.router_service.call_retry import CallRounds, replan_failed
from expertmesh.router_service.dispatch_plan import ActorCall


def _call(actor: str, pieces: dict[int, list[int]]) -> ActorCall:
    """A call of `actor` with expert -> token positions (slot = position % 2)."""
    experts = sorted(pieces)
    tokens = [torch.tensor(pieces[e], dtype=torch.int64) for e in experts]
    return ActorCall.of(actor, experts, tokens, [t % 2 for t in tokens])


def _rows(calls: list[ActorCall]) -> list[tuple[int, int, int]]:
    """Every (expert, token, slot) the calls carry, sorted."""
    return sorted((e, int(t), int(s)) for c in calls for e, ts, ss in zip(c.experts, c.token_idx, c.slot_idx)
                  for t, s in zip(ts, ss))


def test_a_failed_calls_rows_go_to_the_other_live_replicas_of_each_shard():
    replicas = {(0, 1): ["a", "b", "c"], (0, 3): ["a", "c"]}
    failed = _call("a", {1: [0, 2, 5, 7], 3: [1, 4]})
    calls = replan_failed(0, failed, lambda shard: replicas[shard])
    assert [c.actor for c in calls] == ["b", "c"]
    b, c = calls
    assert b.experts == [1] and b.tokens.tolist() == [0, 2]  # expert 1's rows split in contiguous chunks over b, c
    assert c.experts == [1, 3] and c.tokens.tolist() == [5, 7, 1, 4] and c.counts == [2, 2]
    assert _rows(calls) == _rows([failed])  # every row once, with its slot
    assert "a" not in {c.actor for c in calls}


def test_no_replacement_when_a_shard_has_no_other_live_replica():
    replicas = {(0, 1): ["a", "b"], (0, 3): ["a"]}
    assert replan_failed(0, _call("a", {1: [0], 3: [1]}), lambda shard: replicas[shard]) is None
    asked = []
    replan_failed(2, _call("a", {1: [0]}), lambda shard: asked.append(shard) or ["b"])
    assert asked == [(2, 1)]  # asks for the failed call's shards at its layer


def test_rounds_keep_outputs_aligned_with_the_calls_that_served():
    calls = [_call("a", {0: [0]}), _call("b", {1: [1]}), _call("c", {2: [2]})]
    rounds = CallRounds(calls)
    assert rounds.pending == [0, 1, 2] and rounds.outputs() is None  # owed answers: no outputs yet
    seen = []
    replacement = _call("d", {1: [1]})

    def failed(call, error):
        seen.append(("failed", call.actor, str(error)))
        return [replacement]

    out_a, out_c, out_d = torch.full((1, 2), 1.0), torch.full((1, 2), 3.0), torch.full((1, 2), 4.0)
    ok = rounds.settle([out_a, RuntimeError("b down"), out_c], lambda actor: seen.append(("ok", actor)), failed)
    assert ok and seen == [("ok", "a"), ("failed", "b", "b down"), ("ok", "c")]  # in result order
    assert rounds.pending == [3] and calls[3] is replacement  # appended to the caller's list
    assert rounds.settle([out_d], lambda actor: None, failed)
    outputs = rounds.outputs()
    assert [c.actor for c in calls] == ["a", "c", "d"]  # the failed call dropped, in place
    assert [o[0, 0].item() for o in outputs] == [1.0, 3.0, 4.0]


def test_a_failure_without_replacement_ends_the_attempt_at_once():
    calls = [_call("a", {0: [0]}), _call("b", {1: [1]})]
    rounds = CallRounds(calls)
    later = []
    assert not rounds.settle([RuntimeError("a down"), torch.zeros(1, 2)], later.append,
                             lambda call, error: None)
    assert later == []  # b's answer is not recorded: the layer is routed again from scratch
    assert len(calls) == 2


def test_a_replacement_that_fails_again_is_retried_in_the_next_round():
    calls = [_call("a", {0: [0, 1]})]
    rounds = CallRounds(calls)
    spare = iter([[_call("b", {0: [0, 1]})], [_call("c", {0: [0]}), _call("d", {0: [1]})]])
    assert rounds.settle([RuntimeError("a")], lambda actor: None, lambda call, error: next(spare))
    assert rounds.settle([RuntimeError("b")], lambda actor: None, lambda call, error: next(spare))
    assert rounds.pending == [2, 3] and rounds.outputs() is None
    assert rounds.settle([torch.zeros(1, 2), torch.ones(1, 2)], lambda actor: None, lambda call, error: None)
    outputs = rounds.outputs()
    assert [c.actor for c in calls] == ["c", "d"] and [o.sum().item() for o in outputs] == [0.0, 2.0]
