"""The OpenAI mapping beyond one choice (router_service/openai_requests.py, openai_responses.py, http_metrics.py):
n / best_of / batches of prompts as GenerationRequests, echo with prompt logprobs (the request lm-evaluation-harness'
`local-completions` sends for loglikelihood, scored as lm-eval scores it, against the reference model), best_of's
selection, per-choice responses and chunks, continuous usage, and the /metrics text. No Ray."""

from __future__ import annotations

import math
from operator import itemgetter

import pytest
import torch

from expertmesh.experts.embedded_model import EMBEDDED_MODEL_DIR
from expertmesh.experts.reference import load_reference_model
from expertmesh.router_service import http_metrics, openai_requests, openai_responses
from expertmesh.router_service.chat_template import load_chat_template
from expertmesh.router_service.errors import RequestError
from expertmesh.router_service.openai_api import parse_chat, parse_completion

MODEL = "m"


class _Cfg:
    vocab_size = 100
    max_position_embeddings = 64
    eos_token_id = 1


def encode(text: str) -> list[int]:
    return [3 + ord(c) % 50 for c in text]


def plan_of(body, kind="completion"):
    job = (parse_chat if kind == "chat" else parse_completion)({"model": MODEL} | body, MODEL)
    return job, openai_requests.plan(job, _Cfg(), encode, encode, None)


def test_n_best_of_and_batches_make_one_request_per_prompt_and_candidate():
    job, plan = plan_of({"prompt": ["ab", [7, 8, 9]], "n": 2, "best_of": 3, "seed": 10, "temperature": 0.7})
    assert len(plan.requests) == 6 and plan.prompt_ids == [encode("ab"), [7, 8, 9]]
    assert [r.prompt_ids for r in plan.requests] == [encode("ab")] * 3 + [[7, 8, 9]] * 3
    assert [r.sampling.seed for r in plan.requests] == [10, 11, 12] * 2  # choice j: seed + j
    assert all(r.top_logprobs == 0 for r in plan.requests)  # best_of ranks by cumulative logprob
    _, plain = plan_of({"prompt": "ab", "n": 3})
    assert [r.top_logprobs for r in plain.requests] == [None] * 3
    assert all(r.sampling.seed is None for r in plain.requests)


def test_rules_reach_the_generation_request():
    _, plan = plan_of({"prompt": "ab", "ignore_eos": True, "min_tokens": 2, "stop_token_ids": [5, 6],
                       "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.1,
                       "logit_bias": {"9": 3}, "top_k": 4})
    req = plan.requests[0]
    assert (req.eos_token_id, req.min_tokens, req.stop_token_ids) == (None, 2, frozenset({5, 6}))
    s = req.sampling
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty, s.logit_bias, s.top_k) == \
        (0.5, -0.5, 1.1, ((9, 3.0),), 4)
    assert plan_of({"prompt": "ab"})[1].requests[0].eos_token_id == 1
    chat = parse_chat({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": 2}, MODEL)
    chat_plan = openai_requests.plan(chat, _Cfg(), encode, encode, load_chat_template(EMBEDDED_MODEL_DIR))
    assert chat.num_choices == 2 and len(chat_plan.requests) == 2


@pytest.mark.parametrize(("body", "field"), [
    ({"prompt": "ab", "logit_bias": {"100": 1}}, "logit_bias"),
    ({"prompt": "ab", "stop_token_ids": [100]}, "stop_token_ids"),
    ({"prompt": ["ab", [5, 100]]}, "prompt[1]"),
])
def test_model_bounds_name_the_field(body, field):
    with pytest.raises(RequestError) as info:
        plan_of(body)
    assert info.value.field == field


def test_prompt_logprobs_are_the_log_softmax_of_the_position_before():
    logits = torch.tensor([[0.0, 1.0, 2.0], [3.0, 1.0, 0.0], [0.5, 0.5, 2.0]])  # [S=3, V=3]
    got = openai_requests.prompt_logprobs(logits, [2, 0, 1], top=2)
    expected = torch.log_softmax(logits, -1)
    assert got[0] == (None, None)
    assert got[1][0] == pytest.approx(float(expected[0, 0])) and got[2][0] == pytest.approx(float(expected[1, 1]))
    assert [t for t, _ in got[1][1]] == [2, 1] and got[1][1][0][1] == pytest.approx(float(expected[0, 2]))


def test_best_of_keeps_the_highest_cumulative_logprob_and_drops_unasked_logprobs():
    def candidate(lps):
        return [{"token": {"ids": [1], "text": "x", "logprobs": [{"token": "x", "logprob": lp, "top": []}]}}
                for lp in lps] + [{"done": {"completion_tokens": len(lps)}}]

    cands = [candidate([-1.0, -1.0]), candidate([-0.1, -0.5]), candidate([-3.0]), candidate([-0.6])]
    kept = openai_requests.best_of(cands, 2, keep_logprobs=False)
    assert [len(c) for c in kept] == [3, 2]  # -0.6 (one token) and -0.6 (two): ties keep the earlier candidate
    assert all(ev["token"]["logprobs"] is None for c in kept for ev in c if "token" in ev)
    assert openai_requests.best_of(cands, 1, keep_logprobs=True)[0] == cands[1]


def done(index, prompt_tokens=3, completion_tokens=2, counts=(1, 0), cached_tokens=0):
    return {"done": {"index": index, "finish_reason": "length", "prompt_tokens": prompt_tokens,
                     "completion_tokens": completion_tokens, "tokens_per_expert": {0: list(counts)},
                     "rerouted": 0, "degraded": 1, "dropped": 0, "shed": 0, "cached_tokens": cached_tokens}}


def test_several_choices_in_one_response_with_echo_and_usage():
    job = parse_completion({"model": MODEL, "prompt": ["ab", "c"], "n": 2, "echo": True, "logprobs": 1}, MODEL)
    got = openai_responses.Accumulated()
    for i in range(4):
        prompt_tokens = 2 if i < 2 else 1
        got.add({"echo": {"index": i, "text": "ab" if i < 2 else "c", "prompt_tokens": prompt_tokens,
                          "logprobs": [{"token": "a", "logprob": None, "top": None}]}})
        got.add({"token": {"index": i, "ids": [4], "text": f"<{i}>", "prompt_tokens": prompt_tokens,
                           "logprobs": [{"token": f"<{i}>", "logprob": -0.5, "top": [[f"<{i}>", -0.5]]}]}})
    # Cached prompt tokens count like the prompt's: once per prompt, from its first choice (index 1 is prompt 0's
    # second choice, which found what the first one computed).
    for i, cached in ((3, 1), (1, 2), (0, 0), (2, 1)):
        got.add(done(i, prompt_tokens=2 if i < 2 else 1, completion_tokens=1, cached_tokens=cached))
    body = openai_responses.response(job, "cmpl-1", 1, got)
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in body["choices"]] == ["ab<0>", "ab<1>", "c<2>", "c<3>"]
    lp = body["choices"][2]["logprobs"]
    assert lp["token_logprobs"] == [None, -0.5] and lp["top_logprobs"] == [None, {"<2>": -0.5}]
    assert lp["text_offset"] == [0, 1]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7,
                             "prompt_tokens_details": {"cached_tokens": 1}}
    assert body["expertmesh"]["routing"]["tokens_per_expert"] == {"0": [4, 0]}
    assert body["expertmesh"]["routing"]["degraded_tokens"] == 4


def test_chunks_of_several_choices_with_continuous_usage():
    job = parse_chat({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": 2, "stream": True,
                      "stream_options": {"include_usage": True, "continuous_usage_stats": True}}, MODEL)
    writer = openai_responses.ChunkWriter(job, "c", 1)
    chunks = writer.first()
    assert [c["choices"][0]["index"] for c in chunks] == [0, 1]
    for i in (0, 1, 0):
        chunks += writer.event({"token": {"index": i, "ids": [4], "text": "t", "logprobs": None,
                                          "prompt_tokens": 3}})
    assert chunks[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
    chunks += writer.event(done(0, completion_tokens=2))
    assert not any(c["choices"] == [] for c in chunks)  # the usage-only chunk waits for every choice
    chunks += writer.event(done(1, completion_tokens=1))
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
    assert [c["choices"][0]["finish_reason"] for c in chunks[-3:-1]] == ["length", "length"]


# ---- lm-evaluation-harness' local-completions loglikelihood request, end to end on the pure path ----------------

def lm_eval_parse_logprobs(out: dict, ctxlens: list[int]) -> list[tuple[float, bool]]:
    """What lm-eval's LocalCompletionsAPI.parse_logprobs computes from a response (its algorithm, restated):
    sum of token_logprobs[ctxlen:-1] and whether each of those tokens was the top-1 one."""
    res = []
    for choice, ctxlen in zip(sorted(out["choices"], key=itemgetter("index")), ctxlens):
        lps = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        res.append((sum(lps), all(lp == max(top.values()) for lp, top in zip(lps, tops))))
    return res


def test_lm_eval_loglikelihood_request_scores_like_the_reference():
    model = load_reference_model(EMBEDDED_MODEL_DIR)
    contexts = [[5, 17, 42, 8], [9, 9, 30]]
    continuations = [[61, 7], [12]]
    prompts = [c + x for c, x in zip(contexts, continuations)]
    # the exact body lm-eval sends (batch_size 2, tokenized requests): echo, logprobs 1, max_tokens 1, temperature 0
    body = {"model": MODEL, "prompt": prompts, "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234,
            "echo": True}
    job = parse_completion(body, MODEL)
    cfg = model.cfg
    plan = openai_requests.plan(job, cfg, encode, encode, None)
    got = openai_responses.Accumulated()
    for p, ids in enumerate(plan.prompt_ids):
        logits = model.forward([torch.tensor(ids)])[0]  # [S, V]: Score's forward
        scored = openai_requests.prompt_logprobs(logits, ids, job.top_logprobs)
        got.add(openai_requests.echo_dict(p, "", ids, scored, lambda t: f"<{t}>"))
        following = int(torch.argmax(logits[-1]))  # the one greedy token max_tokens = 1 generates
        lp = float(torch.log_softmax(logits[-1], -1)[following])
        got.add({"token": {"index": p, "ids": [following], "text": "", "prompt_tokens": len(ids),
                           "logprobs": [{"token": f"<{following}>", "logprob": lp, "top": [[f"<{following}>", lp]]}]}})
        got.add(done(p, prompt_tokens=len(ids), completion_tokens=1))
    out = openai_responses.response(job, "cmpl", 0, got)
    scores = lm_eval_parse_logprobs(out, [len(c) for c in contexts])
    for (total, greedy), ctx, cont in zip(scores, contexts, continuations):
        full = torch.tensor(ctx + cont)
        logp = torch.log_softmax(model.forward([full])[0], -1)  # [S, V]
        expected = sum(float(logp[len(ctx) - 1 + k, t]) for k, t in enumerate(cont))
        assert total == pytest.approx(expected, abs=1e-5)
        is_greedy = all(int(torch.argmax(logp[len(ctx) - 1 + k])) == t for k, t in enumerate(cont))
        assert greedy == is_greedy
    assert all(math.isfinite(t) for t, _ in scores)


def test_metrics_text():
    front = http_metrics.FrontCounters()
    front.count_request("/v1/completions", 200)
    front.count_request("/v1/completions", 200)
    front.count_request("/health", 503)
    front.count_usage({"prompt_tokens": 5, "completion_tokens": 7})
    text = http_metrics.prometheus_text(front, {"replica": "r1", "active_sequences": 3, "steps": "12",
                                                 "stage_seconds": {"loop.busy": 1.5}})
    assert 'expertmesh_http_requests_total{path="/v1/completions",status="200"} 2' in text
    assert 'expertmesh_http_requests_total{path="/health",status="503"} 1' in text
    assert "expertmesh_http_completion_tokens_total 7" in text and "expertmesh_router_up 1" in text
    assert 'expertmesh_router_active_sequences{replica="r1"} 3' in text
    assert 'expertmesh_router_steps_total{replica="r1"} 12' in text
    assert 'expertmesh_router_stage_seconds_total{replica="r1",stage="loop.busy"} 1.500000' in text
    assert "expertmesh_router_up 0" in http_metrics.prometheus_text(front, None)
    for line in text.splitlines():  # every sample line: name{labels} value
        if not line.startswith("#"):
            float(line.rsplit(" ", 1)[1])
