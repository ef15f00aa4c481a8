"""Resuming OpenAI generations after a router failover (router_service/openai_continuation.py), without Ray:

- what the progress records per choice and the job that continues from it (resumed tokens, echoed and finished
  choices), a seed for sampled jobs without one, best_of re-sent whole with the replay dropped;
- the plan of a continued job (openai_requests: resumed_ids per choice, checked against max_tokens and the vocabulary);
- against a real ContinuousBatcher on a tiny model (openai_generation.job_events, what the deployment streams): a job
  cut off at points spread over its events (first and last included) and continued, once or twice, relays exactly the
  uninterrupted job's events, per choice, each once: greedy and seeded sampling, n > 1, a batch of prompts, echo with
  logprobs, chat, best_of.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import defaultdict

import pytest
import torch

from expertmesh.experts.embedded_model import EMBEDDED_MODEL_DIR
from expertmesh.experts.kv_cache import KVCacheSettings
from expertmesh.experts.modeling import MoEDecoder
from expertmesh.experts.reference import load_reference_model
from expertmesh.router_service import openai_generation, openai_requests
from expertmesh.router_service.batching import ContinuousBatcher
from expertmesh.router_service.chat_template import load_chat_template
from expertmesh.router_service.errors import RequestError
from expertmesh.router_service.openai_api import parse_chat, parse_completion
from expertmesh.router_service.openai_continuation import OpenAIProgress, with_resumable_seed

MODEL = "m"
TIMEOUT = 60.0


def token(index: int, *ids: int) -> dict:
    return {"token": {"index": index, "ids": list(ids), "text": "x" * len(ids), "logprobs": None}}


def done(index: int) -> dict:
    return {"done": {"index": index, "finish_reason": "length", "prompt_tokens": 2, "completion_tokens": 3}}


def job_of(body: dict, kind: str = "completion"):
    return (parse_chat if kind == "chat" else parse_completion)({"model": MODEL} | body, MODEL)


# ---------------------------------------------------------------- the progress and the continuing job


def test_the_continuing_job_carries_each_choices_relayed_tokens_echoes_and_ends():
    job = job_of({"prompt": [[5, 6], [7, 8, 9]], "n": 2, "echo": True, "max_tokens": 4, "temperature": 0})
    progress = OpenAIProgress(job)
    assert progress.next_job() is job  # nothing relayed: the original
    for event in [{"echo": {"index": i, "text": "", "logprobs": None, "prompt_tokens": 2}} for i in (0, 1, 2)] + [
            token(0, 11), token(2, 30), token(0, 12, 13), token(1, 20), done(1)]:
        assert progress.fresh(event)
        progress.record(event)
    again = progress.next_job()
    assert again.resumed == ((11, 12, 13), (20,), (30,), ())
    assert (again.echoed, again.finished) == ((0, 1, 2), (1,))
    assert again.prompts == job.prompts and again.n == job.n and again.seed == job.seed  # otherwise the same job
    assert not progress.done and progress.events == 8


def test_every_choice_finished_is_done():
    progress = OpenAIProgress(job_of({"prompt": "ab", "n": 2}))
    for event in (token(0, 1), done(0), done(1)):
        progress.record(event)
    assert progress.done


def test_a_sampled_job_without_a_seed_gets_one_and_others_stay_as_they_are():
    sampled = job_of({"prompt": "ab", "temperature": 0.8})
    seeded = with_resumable_seed(sampled)
    assert seeded.seed is not None and 0 <= seeded.seed < 2**63 and seeded.temperature == 0.8
    greedy = job_of({"prompt": "ab", "temperature": 0})
    assert with_resumable_seed(greedy) is greedy
    chosen = job_of({"prompt": "ab", "seed": 3})
    assert with_resumable_seed(chosen) is chosen


def test_best_of_is_re_sent_whole_and_the_replayed_events_are_dropped():
    job = job_of({"prompt": "ab", "n": 2, "best_of": 3, "seed": 1})
    progress = OpenAIProgress(job)
    for event in (token(0, 1), token(0, 2), done(0), token(1, 5)):
        progress.record(event)
    assert progress.next_job() is job
    replay = [token(0, 1), token(0, 2), done(0), token(1, 5), token(1, 6), done(1)]
    assert [progress.fresh(e) for e in replay] == [False, False, False, False, True, True]


# ---------------------------------------------------------------- the continued job's plan


class _Cfg:
    vocab_size = 100
    max_position_embeddings = 64
    eos_token_id = 1


def encode(text: str) -> list[int]:
    return [3 + ord(c) % 50 for c in text]


def test_a_continued_plan_resumes_each_choice_after_its_tokens():
    job = job_of({"prompt": "ab", "n": 3, "max_tokens": 5, "seed": 4, "temperature": 0.5})
    progress = OpenAIProgress(job)
    for event in (token(0, 7, 8), token(2, 9)):
        progress.record(event)
    plan = openai_requests.plan(progress.next_job(), _Cfg(), encode, encode, None)
    assert [r.resumed_ids for r in plan.requests] == [(7, 8), (), (9,)]
    assert [r.sampling.seed for r in plan.requests] == [4, 5, 6]  # choice j's seed as before the failover


@pytest.mark.parametrize(("resumed", "message"), [
    (((1,) * 6, (), ()), "exceed max_tokens"), (((100,), (), ()), "vocabulary"), (((1,),), "3 sequences")])
def test_a_continued_plan_refuses_resumed_tokens_it_cannot_continue(resumed, message):
    from dataclasses import replace

    job = replace(job_of({"prompt": "ab", "n": 3, "max_tokens": 5}), resumed=resumed)
    with pytest.raises(RequestError, match=message) as err:
        openai_requests.plan(job, _Cfg(), encode, encode, None)
    assert err.value.field == "resumed"


# ---------------------------------------------------------------- against a real batcher


@pytest.fixture(scope="module")
def model(checkpoints):
    # Prefix caching off: the jobs here run again and again on one batcher, and a request's routing counts cover the
    # tokens it computed, which with the cache on would depend on the runs before it (README: Prefix caching).
    reference = load_reference_model(checkpoints["mixtral"])
    return MoEDecoder(reference.cfg, reference.w, reference.experts, kv_cache=KVCacheSettings(prefix_caching=False))


def fake_decode(ids: list[int]) -> str:
    return "".join(chr(97 + i % 26) for i in ids)


def tiny_encode(text: str) -> list[int]:
    return [3 + ord(c) % 90 for c in text]


class Deployment:
    """The router deployment's OpenAIGenerate without Ray: plan, then openai_generation.job_events on a batcher."""

    def __init__(self, model):
        self.model = model
        self.batcher = ContinuousBatcher(model, fake_decode)
        self.template = load_chat_template(EMBEDDED_MODEL_DIR)

    def events(self, job):
        plan = openai_requests.plan(job, self.model.cfg, tiny_encode, tiny_encode, self.template)

        async def score(prompts):  # as Router.score_batch: per prompt its logits [S, V]
            return self.model.forward([torch.tensor(ids) for ids in prompts])

        return openai_generation.job_events(job, plan, stream=self.batcher.stream, score=score, decode=fake_decode,
                                            token_text=lambda t: fake_decode([t]))


def rounded(value):
    """Log-probabilities to 4 places: a continued sequence re-prefills its tokens in one forward, whose float sums
    differ from the token-by-token ones in the last bits (the chosen tokens do not)."""
    if isinstance(value, float):
        return round(value, 4)
    if isinstance(value, dict):
        return {k: rounded(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [rounded(v) for v in value]
    return value


def per_choice(events: list[dict]) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = defaultdict(list)
    for event in events:
        out[next(iter(event.values()))["index"]].append(rounded(event))
    return dict(out)


async def relayed(deployment: Deployment, job, cuts: list[int]) -> list[dict]:
    """What the front relays when the calls serving `job` die after cuts[0], cuts[1], ... events each."""
    progress = OpenAIProgress(with_resumable_seed(job))
    out: list[dict] = []
    for cut in [*cuts, None]:
        async with contextlib.aclosing(deployment.events(progress.next_job())) as events:
            got = 0
            async for event in events:
                if cut is not None and got == cut:
                    break  # the replica died: the rest of this call never arrives
                got += 1
                if progress.fresh(event):
                    progress.record(event)
                    out.append(event)
        if progress.done:
            break
    return out


JOBS = {
    "greedy": ({"prompt": [[5, 9, 2, 44]], "max_tokens": 6, "temperature": 0}, "completion"),
    "seeded n=2": ({"prompt": [[5, 9, 2, 44]], "max_tokens": 6, "n": 2, "temperature": 0.9, "seed": 11},
                   "completion"),
    "batch, echo, logprobs": ({"prompt": [[5, 9, 2], [7, 7, 1, 3]], "max_tokens": 4, "echo": True, "logprobs": 2,
                               "temperature": 1.1, "top_p": 0.9, "seed": 3}, "completion"),
    "chat n=2": ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "n": 2, "temperature": 0.7,
                  "seed": 2**62}, "chat"),
    "best_of": ({"prompt": [[5, 9, 2, 44]], "max_tokens": 4, "n": 2, "best_of": 3, "temperature": 0.9, "seed": 8},
                "completion"),
}


@pytest.mark.parametrize("name", list(JOBS))
def test_a_job_cut_anywhere_and_continued_relays_the_uninterrupted_events_each_once(model, name):
    body, kind = JOBS[name]
    job = job_of(body, kind)
    deployment = Deployment(model)

    async def main():
        whole = await relayed(deployment, job, [])
        # Cut points spread over the job (its first and last event included), not all of them: each is a run.
        cuts = sorted({0, len(whole) - 1, *range(1, len(whole), max(1, len(whole) // 5))})
        cut_once = {k: await relayed(deployment, job, [k]) for k in cuts}
        cut_twice = await relayed(deployment, job, [len(whole) // 3, 1])
        return whole, cut_once, cut_twice

    whole, cut_once, cut_twice = asyncio.run(asyncio.wait_for(main(), TIMEOUT))
    expected = per_choice(whole)
    assert len(expected) == job.num_choices and all("done" in events[-1] for events in expected.values())
    for k, events in cut_once.items():
        assert per_choice(events) == expected, f"{name}: cut after {k} events"
    assert per_choice(cut_twice) == expected
