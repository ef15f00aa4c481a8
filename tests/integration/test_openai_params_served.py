"""The OpenAI API's generation parameters beyond the basics, with the unmodified `openai` client against one
`expertmesh serve --http-port` (the embedded model):

- presence / frequency / repetition penalties and logit_bias: greedy output equal to the in-process reference
  applying the same rule (sampling.adjust_logits) step by step; gRPC Generate with the same fields agrees;
- ignore_eos and min_tokens; stop_token_ids;
- n (choice j = the solo run with seed + j), best_of (the candidate with the highest cumulative logprob);
- echo with prompt logprobs: the exact request lm-evaluation-harness' `local-completions` sends for loglikelihood,
  scored as lm-eval scores it, equal to the reference; echo with max_tokens = 0;
- stream_options.continuous_usage_stats; /health, /ping, /metrics, /tokenize, /detokenize;
- prefix caching: a second chat with the same ~390-token system prompt reports usage.prompt_tokens_details
  .cached_tokens, and its output equals the in-process reference (and a repeat of it);
- an OpenAI-style load generator (probe /health, then 1, 8 and 32 concurrent streams with ignore_eos): no error and
  exactly max_tokens tokens per request.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from operator import itemgetter

import grpc
import pytest
import torch

from expertmesh.experts.embedded_model import EMBEDDED_MODEL_DIR, EMBEDDED_MODEL_NAME
from expertmesh.experts.reference import load_reference_model
from expertmesh.experts.tokenizer import load_tokenizer
from expertmesh.protos import inference_pb2 as pb
from expertmesh.protos import inference_pb2_grpc
from expertmesh.router_service.batching import GenerationRequest
from expertmesh.router_service.sampling import SamplingParams, adjust_logits, sample_next

openai = pytest.importorskip("openai", reason="the openai client is in the test extra (pip install -e '.[test]')")

MODEL = EMBEDDED_MODEL_NAME
EOS = 1  # the embedded model's eos_token_id
PROMPT = "The river"  # its greedy continuation repeats tokens, so every penalty changes it


@pytest.fixture(scope="module")
def served(shared_http_server):
    return shared_http_server  # the embedded model with the OpenAI front, shared (tests/shared_server.py)


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"{served.http_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference():
    return load_reference_model(EMBEDDED_MODEL_DIR)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(EMBEDDED_MODEL_DIR)


def reference_with_rules(model, request: GenerationRequest) -> list[int]:
    """The in-process reference, greedy, applying the request's logit rules to each step's logits."""
    cache = model.new_cache()
    x = torch.tensor(request.prompt_ids)
    out: list[int] = []
    while len(out) < request.max_tokens:
        last = model.forward([x], [cache])[0][-1]  # [V]
        adjusted = adjust_logits(last, request.sampling, request.prompt_ids, out, request.suppressed_ids(len(out)))
        out.append(sample_next(adjusted, request.sampling))
        if out[-1] == request.eos_token_id or out[-1] in request.stop_token_ids:
            break
        x = torch.tensor([out[-1]])
    return out


def get(url: str) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=30) as reply:
        return reply.status, reply.read().decode()


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as reply:
        return json.loads(reply.read())


RULES = [  # (OpenAI fields, the same as SamplingParams)
    ({"presence_penalty": 1.5}, SamplingParams(presence_penalty=1.5)),
    ({"frequency_penalty": 2.0}, SamplingParams(frequency_penalty=2.0)),
    ({"extra_body": {"repetition_penalty": 1.8}}, SamplingParams(repetition_penalty=1.8)),
    ({"logit_bias": {"40": 6.0, "13": -100}}, SamplingParams(logit_bias=((13, -100.0), (40, 6.0)))),
    ({"presence_penalty": -0.5, "frequency_penalty": 0.75, "extra_body": {"repetition_penalty": 1.3}},
     SamplingParams(presence_penalty=-0.5, frequency_penalty=0.75, repetition_penalty=1.3)),
]


@pytest.mark.parametrize(("fields", "params"), RULES)
def test_greedy_with_logit_rules_equals_the_reference_applying_them(client, served, reference, tokenizer, fields,
                                                                    params):
    prompt_ids = tokenizer.encode(PROMPT).ids
    want = reference_with_rules(reference, GenerationRequest(prompt_ids=prompt_ids, max_tokens=16, sampling=params,
                                                             eos_token_id=EOS))
    plain = reference_with_rules(reference, GenerationRequest(prompt_ids=prompt_ids, max_tokens=16,
                                                              eos_token_id=EOS))
    assert want != plain  # the rule changes the output
    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, **fields)
    assert got.choices[0].text == tokenizer.decode(want)
    assert got.usage.completion_tokens == len(want)
    # gRPC Generate with the same fields
    rules = dict(fields.get("extra_body", {}))
    rules |= {k: v for k, v in fields.items() if k in ("presence_penalty", "frequency_penalty")}
    if "logit_bias" in fields:
        rules["logit_bias"] = {int(k): float(v) for k, v in fields["logit_bias"].items()}
    with grpc.insecure_channel(served.target) as channel:
        stream = inference_pb2_grpc.InferenceStub(channel).Generate(
            pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt_ids), max_tokens=16, **rules), timeout=120)
        ids = [t for m in stream if m.HasField("token") for t in m.token.token_ids]
    assert ids == want


def test_ignore_eos_min_tokens_and_stop_token_ids(client, reference, tokenizer):
    prompt_ids = tokenizer.encode(PROMPT).ids
    # bias eos up so plain greedy ends at once; ignore_eos and min_tokens then decide
    bias = {str(EOS): 100}
    first = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logit_bias=bias)
    assert (first.usage.completion_tokens, first.choices[0].finish_reason) == (1, "stop")
    ignored = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logit_bias=bias,
                                        extra_body={"ignore_eos": True})
    assert (ignored.usage.completion_tokens, ignored.choices[0].finish_reason) == (8, "length")
    held = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logit_bias=bias,
                                     extra_body={"min_tokens": 5})
    want = reference_with_rules(reference, GenerationRequest(
        prompt_ids=prompt_ids, max_tokens=8, eos_token_id=EOS, min_tokens=5,
        sampling=SamplingParams(logit_bias=((EOS, 100.0),))))
    assert len(want) == 6 and want[-1] == EOS  # 5 tokens held off eos, then eos
    assert held.usage.completion_tokens == 6 and held.choices[0].text == tokenizer.decode(want)
    plain = reference_with_rules(reference, GenerationRequest(prompt_ids=prompt_ids, max_tokens=8, eos_token_id=EOS))
    stop_id = plain[2]
    stopped = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                        extra_body={"stop_token_ids": [stop_id]})
    assert stopped.usage.completion_tokens == plain.index(stop_id) + 1
    assert stopped.choices[0].finish_reason == "stop"


def test_n_choices_are_the_solo_runs_with_seed_plus_j(client):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=1.0, top_p=0.95)
    many = client.completions.create(n=3, seed=40, **kw)
    assert [c.index for c in many.choices] == [0, 1, 2]
    solo = [client.completions.create(seed=40 + j, **kw).choices[0].text for j in range(3)]
    assert [c.text for c in many.choices] == solo
    assert many.usage.completion_tokens == sum(
        client.completions.create(seed=40 + j, **kw).usage.completion_tokens for j in range(3))
    streamed = client.completions.create(n=3, seed=40, stream=True, **kw)
    texts = ["", "", ""]
    for chunk in streamed:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == solo
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2,
                                          max_tokens=4, temperature=0)
    assert len(chat.choices) == 2 and chat.choices[0].message.content == chat.choices[1].message.content


def test_best_of_returns_the_candidate_with_the_highest_cumulative_logprob(client):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0)
    candidates = [client.completions.create(seed=70 + j, logprobs=0, **kw).choices[0] for j in range(4)]
    sums = [sum(c.logprobs.token_logprobs) for c in candidates]
    best = client.completions.create(seed=70, best_of=4, **kw)
    assert len(best.choices) == 1 and best.choices[0].logprobs is None
    assert best.choices[0].text == candidates[max(range(4), key=lambda j: (sums[j], -j))].text
    two = client.completions.create(seed=70, best_of=4, n=2, logprobs=1, **kw)
    order = sorted(range(4), key=lambda j: (-sums[j], j))[:2]
    assert [c.text for c in two.choices] == [candidates[j].text for j in order]


def test_lm_eval_loglikelihood_request_equals_the_reference(client, reference, tokenizer):
    contexts = [tokenizer.encode("The river").ids, tokenizer.encode("def main():").ids]
    continuations = [tokenizer.encode(" flows").ids, tokenizer.encode("\n    return").ids]
    prompts = [c + x for c, x in zip(contexts, continuations)]
    # lm-eval's LocalCompletionsAPI._create_payload(generate=False), batch of 2, tokenized requests:
    out = client.completions.create(model=MODEL, prompt=prompts, temperature=0, max_tokens=1, logprobs=1,
                                    seed=1234, echo=True).model_dump()
    for choice, ctx, cont in zip(sorted(out["choices"], key=itemgetter("index")), contexts, continuations):
        # lm-eval's parse_logprobs: token_logprobs[ctxlen:-1] summed, greedy if each is its top-1
        lps = choice["logprobs"]["token_logprobs"][len(ctx):-1]
        tops = choice["logprobs"]["top_logprobs"][len(ctx):-1]
        logp = torch.log_softmax(reference.forward([torch.tensor(ctx + cont)])[0], -1)  # [S, V]
        assert len(lps) == len(cont)
        for k, token in enumerate(cont):
            assert lps[k] == pytest.approx(float(logp[len(ctx) - 1 + k, token]), abs=1e-4)
        greedy = all(lp == max(top.values()) for lp, top in zip(lps, tops))
        assert greedy == all(int(torch.argmax(logp[len(ctx) - 1 + k])) == t for k, t in enumerate(cont))
        assert choice["logprobs"]["token_logprobs"][0] is None  # the first prompt token has no context
        assert len(choice["logprobs"]["tokens"]) == len(ctx) + len(cont) + 1  # prompt + the one generated token
    only = client.completions.create(model=MODEL, prompt="The river", max_tokens=0, echo=True, logprobs=2)
    assert only.choices[0].text == "The river" and only.usage.completion_tokens == 0
    assert len(only.choices[0].logprobs.tokens) == len(tokenizer.encode("The river").ids)


def test_continuous_usage_stats(client):
    chunks = list(client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, stream=True, extra_body={"ignore_eos": True},
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    with_choices = [c for c in chunks if c.choices]
    assert all(c.usage is not None for c in with_choices)
    counts = [c.usage.completion_tokens for c in with_choices]
    assert counts == sorted(counts) and counts[-1] == 6
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6


def test_health_ping_metrics_tokenize_detokenize(served, client, tokenizer):
    assert get(f"{served.http_url}/health")[0] == 200
    assert get(f"{served.http_url}/ping")[0] == 200
    client.completions.create(model=MODEL, prompt="x", max_tokens=2, temperature=0)
    status, text = get(f"{served.http_url}/metrics")
    assert status == 200 and "expertmesh_router_up 1" in text
    assert 'expertmesh_http_requests_total{path="/v1/completions",status="200"}' in text
    assert "expertmesh_router_kv_blocks_total" in text
    tokens = post(f"{served.http_url}/tokenize", {"model": MODEL, "prompt": PROMPT})
    assert tokens["tokens"] == tokenizer.encode(PROMPT).ids and tokens["count"] == len(tokens["tokens"])
    assert tokens["max_model_len"] == 512
    assert post(f"{served.http_url}/detokenize", {"tokens": tokens["tokens"]})["prompt"] == \
        tokenizer.decode(tokens["tokens"])
    with pytest.raises(urllib.error.HTTPError) as info:
        post(f"{served.http_url}/detokenize", {"tokens": [10**9]})
    assert info.value.code == 400 and json.loads(info.value.read())["error"]["param"] == "tokens"


def test_a_repeated_system_prompt_comes_from_the_prefix_cache_with_the_same_output(served, client, reference,
                                                                                   tokenizer):
    from expertmesh.router_service.chat_template import load_chat_template

    system = " ".join(f"Rule {i}: answer the river question about stones and water number {i}." for i in range(1, 15))
    template = load_chat_template(EMBEDDED_MODEL_DIR)
    replies, wants = [], []
    for user in ("Where does it go?", "Why is it cold?", "Why is it cold?"):
        messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        prompt_ids = tokenizer.encode(template.render(messages), add_special_tokens=False).ids
        wants.append(reference_with_rules(reference, GenerationRequest(prompt_ids, 8, eos_token_id=EOS)))
        replies.append(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0))
        assert replies[-1].usage.prompt_tokens == len(prompt_ids) > 384
    cached = [r.usage.prompt_tokens_details.cached_tokens for r in replies]
    # The first computes the system prompt (nothing before in this module shares it); the others find its full
    # blocks (16 tokens each), never the block of the last prompt token.
    assert cached[0] == 0 and cached[1] >= 368 and cached[1] % 16 == 0 and cached[2] >= cached[1]
    for reply, want in zip(replies, wants):
        assert reply.choices[0].message.content == tokenizer.decode(want)
    assert replies[2].choices[0].message.content == replies[1].choices[0].message.content
    text = get(f"{served.http_url}/metrics")[1]
    front = [line for line in text.splitlines() if line.startswith("expertmesh_http_cached_prompt_tokens_total ")]
    assert front and float(front[0].split()[1]) >= cached[1] + cached[2]
    assert "expertmesh_router_prefix_hit_tokens_total" in text


@pytest.mark.parametrize("streams", [1, 8, 32])
def test_load_generator_with_ignore_eos_gets_exactly_max_tokens(served, streams):
    """What OpenAI-style load generators do: probe /health, then keep `streams` streaming requests in flight with
    ignore_eos, counting tokens from the usage chunk."""
    assert get(f"{served.http_url}/health")[0] == 200
    max_tokens, rounds = 24, 2
    aclient = openai.AsyncOpenAI(base_url=f"{served.http_url}/v1", api_key="unused", max_retries=0, timeout=300)
    words = ["river", "import", "while", "class", "the", "data", "for", "return"]

    async def one(i: int) -> int:
        stream = await aclient.completions.create(
            model=MODEL, prompt=f"{words[i % 8]} {words[(i * 3) % 8]}", max_tokens=max_tokens, temperature=0.8,
            seed=i, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        usage = None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
        return usage.completion_tokens

    async def run() -> list:
        try:
            results = []
            for r in range(rounds):
                results += await asyncio.gather(*(one(r * streams + i) for i in range(streams)),
                                                return_exceptions=True)
            return results
        finally:
            await aclient.close()

    began = time.perf_counter()
    results = asyncio.run(run())
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors[:3]
    assert results == [max_tokens] * (rounds * streams)
    print(f"load: {streams} streams × {rounds} rounds × {max_tokens} tokens in {time.perf_counter() - began:.1f} s")
