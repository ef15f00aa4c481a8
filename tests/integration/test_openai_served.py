"""The OpenAI-compatible HTTP API, the live cluster page and Prometheus against one `expertmesh serve --http-port`
(plaintext, no token; the embedded model) on a Ray this module starts with a known metrics export port:

- the unmodified `openai` client: completions and chat, streamed and not, greedy output equal to gRPC Generate and
  to the in-process reference; logprobs equal to the reference's log-softmax; stop strings; seeds; 32 concurrent
  streams equal to their solo runs; every bad input with its HTTP code and `param`;
- a client that disconnects frees its sequence and KV cache;
- the distribution's Prometheus scrapes Ray's metrics endpoint and our counters agree with the routing summaries;
- the cluster page in a headless Chromium: loads with no console errors, lists every actor, updates after a kill.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import re
import urllib.error
import urllib.request
from urllib.parse import urlsplit

import grpc
import pytest
import ray
import torch

from expertmesh.cluster.naming import NAMESPACE
from expertmesh.experts.embedded_model import EMBEDDED_MODEL_DIR, EMBEDDED_MODEL_NAME
from expertmesh.experts.reference import load_reference_model
from expertmesh.experts.tokenizer import load_tokenizer
from expertmesh.protos import inference_pb2 as pb
from expertmesh.protos import inference_pb2_grpc
from expertmesh.router_service.chat_template import load_chat_template
from expertmesh.router_service.sampling import SamplingParams, sample_next
from tests.browser_and_prometheus import (
    Prometheus,
    chromium_missing,
    free_port,
    headless_chromium,
    prometheus_missing,
)
from tests.clusters import init_local_ray
from tests.served import start_server
from tests.traffic import wait_for

openai = pytest.importorskip("openai", reason="the openai client is in the test extra (pip install -e '.[test]')")

MODEL = EMBEDDED_MODEL_NAME
MAX_BODY = 1 << 20  # --max-message-bytes: the 413 test sends more
PROMPTS = ["The river", "def main():\n    ", "Once upon a time, there"]
EOS = 1  # the embedded model's eos_token_id


@pytest.fixture(scope="module")
def served():
    metrics_port = free_port()
    init_local_ray(num_cpus=4, namespace=NAMESPACE, include_dashboard=False,
             _metrics_export_port=metrics_port, _system_config={"metrics_report_interval_ms": 1000})
    try:
        server = start_server("--address", ray.get_runtime_context().gcs_address, "--http-port", "0",
                              "--max-message-bytes", str(MAX_BODY))
        server.metrics_port = metrics_port
        try:
            yield server
        finally:
            assert server.stop() == 0, server.log()
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"{served.http_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference():
    return load_reference_model(EMBEDDED_MODEL_DIR)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(EMBEDDED_MODEL_DIR)


def reference_greedy(model, prompt_ids: list[int], max_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """The in-process reference's greedy continuation (stopping at eos, as the API does) and each step's logits."""
    cache = model.new_cache()
    x = torch.tensor(prompt_ids)
    ids, logits = [], []
    for _ in range(max_tokens):
        last = model.forward([x], [cache])[0][-1]  # [V]
        token = sample_next(last, SamplingParams())
        ids.append(token)
        logits.append(last)
        if token == EOS:
            break
        x = torch.tensor([token])
    return ids, logits


def grpc_text(served, prompt: str, max_tokens: int) -> str:
    with grpc.insecure_channel(served.target) as channel:
        stream = inference_pb2_grpc.InferenceStub(channel).Generate(
            pb.GenerateRequest(prompt=prompt, max_tokens=max_tokens), timeout=120)
        return "".join(m.token.text for m in stream if m.HasField("token"))


def state(served) -> dict:
    return json.loads(urllib.request.urlopen(f"{served.http_url}/api/state", timeout=30).read())


def http_error(url: str, data: bytes | None = None) -> tuple[int, dict]:
    """(status, JSON body) of a request the server refuses."""
    with pytest.raises(urllib.error.HTTPError) as info:
        # JSON's media type: urllib's default for a body (a form) is refused with 415 before the body is read.
        headers = {"Content-Type": "application/json"} if data is not None else {}
        urllib.request.urlopen(urllib.request.Request(url, data=data, headers=headers), timeout=30)
    return info.value.code, json.loads(info.value.read())


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_completion_equals_grpc_generate_and_the_reference(client, served, reference, tokenizer, prompt):
    n = 12
    ids, _ = reference_greedy(reference, tokenizer.encode(prompt).ids, n)
    want = tokenizer.decode(ids)
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0)
    assert whole.choices[0].text == want
    assert whole.choices[0].finish_reason == ("stop" if ids[-1] == EOS else "length")
    assert whole.usage.completion_tokens == len(ids)
    assert whole.usage.prompt_tokens == len(tokenizer.encode(prompt).ids)
    streamed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0, stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed) == want
    assert grpc_text(served, prompt, n) == want


def test_greedy_chat_equals_the_reference_on_the_rendered_template(client, reference, tokenizer):
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "A loop, please"}]
    rendered = load_chat_template(EMBEDDED_MODEL_DIR).render(messages)
    prompt_ids = tokenizer.encode(rendered, add_special_tokens=False).ids
    ids, _ = reference_greedy(reference, prompt_ids, 10)
    want = tokenizer.decode(ids)
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=10, temperature=0)
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == want
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(prompt_ids), len(ids))
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == len(prompt_ids) + len(ids)
    finished = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finished) == 1
    routing = finished[0].model_extra["expertmesh"]["routing"]  # the extension field; standard clients ignore it
    assert set(routing["tokens_per_expert"]) == {"0", "1", "2", "3"}
    # Every token forwarded (the prompt but what the prefix cache served from the request before, then each generated
    # token but the last), top-2, in every layer.
    cached = chunks[-1].usage.prompt_tokens_details.cached_tokens
    assert sum(routing["tokens_per_expert"]["0"]) == 2 * (len(prompt_ids) - cached + len(ids) - 1)


def test_logprobs_are_the_reference_log_softmax(client, reference, tokenizer):
    prompt = PROMPTS[0]
    ids, logits = reference_greedy(reference, tokenizer.encode(prompt).ids, 6)
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, logprobs=3)
    lp = got.choices[0].logprobs
    assert len(lp.token_logprobs) == len(ids)
    for i, (token, step) in enumerate(zip(ids, logits)):
        want = torch.log_softmax(step, -1)
        assert lp.token_logprobs[i] == pytest.approx(float(want[token]), abs=1e-4)
        assert lp.tokens[i] == tokenizer.decode([token])
        assert len(lp.top_logprobs[i]) <= 3
        assert max(lp.top_logprobs[i].values()) == pytest.approx(float(want.max()), abs=1e-4)  # greedy: the best
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.logprob == pytest.approx(c.top_logprobs[0].logprob) for c in content)


def test_stop_strings_and_seeded_sampling(client):
    full = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=16, temperature=0).choices[0].text
    stop = full[6:9]
    at = full.find(stop)
    cut = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=16, temperature=0, stop=[stop])
    assert cut.choices[0].text == full[:at] and cut.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=16, temperature=0, stop=stop,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == full[:at]
    runs = [client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=12, temperature=1.0, top_p=0.9,
                                      seed=11).choices[0].text for _ in range(2)]
    assert runs[0] == runs[1]


PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "color": {"enum": ["red", "green", "blue"]}}, "required": ["name", "age", "color"], "additionalProperties": False}
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                               "required": ["city"], "additionalProperties": False}}}


def test_structured_output_through_the_openai_client(client):
    """Grammar-constrained output from a model whose own text is nowhere near JSON (router_service/grammar_mask.py)."""
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Describe a person"}], max_tokens=60, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    person = json.loads(reply.choices[0].message.content)
    assert set(person) == {"name", "age", "color"} and isinstance(person["age"], int)
    assert person["color"] in ("red", "green", "blue") and reply.choices[0].finish_reason == "stop"
    pattern = r"[0-9]{3}-[a-z]{2}"
    streamed = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0.8, seed=3,
                                         stream=True, extra_body={"structured_outputs": {"regex": pattern}})
    assert re.fullmatch(pattern, "".join(c.choices[0].text for c in streamed))
    choice = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=8, temperature=0,
                                       extra_body={"guided_choice": ["yes", "no", "maybe"]})
    assert choice.choices[0].text in ("yes", "no", "maybe")


def test_forced_tool_call_through_the_openai_client(client):
    """tool_choice required makes even the embedded model call the tool; the client reads tool_calls, whole and
    streamed."""
    ask = {"model": MODEL, "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER_TOOL],
           "tool_choice": "required", "max_tokens": 60, "temperature": 0}
    reply = client.chat.completions.create(**ask)
    (call,) = reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "tool_calls" and call.type == "function"
    assert call.function.name == "get_weather" and set(json.loads(call.function.arguments)) == {"city"}
    chunks = list(client.chat.completions.create(**ask, stream=True))
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [(d.function.name, d.function.arguments) for d in deltas] == [(call.function.name, call.function.arguments)]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_32_concurrent_streams_equal_their_solo_runs(client, served):
    words = ["river", "import", "while", "class", "the", "data", "for", "return"]
    prompts = [f"{words[i % 8]} {words[(i * 3) % 8]}" * (1 + i % 3) for i in range(32)]
    lengths = [4 + i % 9 for i in range(32)]
    solo = [client.completions.create(model=MODEL, prompt=p, max_tokens=n, temperature=0).choices[0].text
            for p, n in zip(prompts, lengths)]
    aclient = openai.AsyncOpenAI(base_url=f"{served.http_url}/v1", api_key="unused", max_retries=0, timeout=300)

    async def one(prompt: str, n: int) -> str:
        stream = await aclient.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0,
                                                  stream=True)
        return "".join([chunk.choices[0].text async for chunk in stream])

    async def together() -> list[str]:
        try:
            return await asyncio.gather(*(one(p, n) for p, n in zip(prompts, lengths)))
        finally:
            await aclient.close()

    texts = asyncio.run(together())
    assert texts == solo
    router = state(served)["router"]
    assert router["max_batch_seen"] >= 8  # they shared steps
    assert router["live_kv_caches"] == 0


BAD = [  # (endpoint, fields, HTTP status, param)
    ("completions", {"prompt": "x", "temperature": 3}, 400, "temperature"),
    ("completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("completions", {"prompt": "x", "max_tokens": 600}, 400, "max_tokens"),  # past the 512-token context
    ("completions", {"prompt": "word " * 1000}, 400, "prompt"),  # tokenizes past the context
    ("completions", {"prompt": [5, 99999]}, 400, "prompt"),  # a token id outside the vocabulary
    ("completions", {"prompt": "x", "n": 0}, 400, "n"),
    ("completions", {"prompt": "x", "best_of": 2, "stream": True}, 400, "best_of"),
    ("completions", {"prompt": "x", "logit_bias": {"99999": 1}}, 400, "logit_bias"),  # outside the vocabulary
    ("completions", {"prompt": "x", "extra_body": {"stop_token_ids": [99999]}}, 400, "stop_token_ids"),
    ("completions", {"prompt": "x", "extra_body": {"min_tokens": 20}, "max_tokens": 4}, 400, "min_tokens"),
    ("completions", {"prompt": "x", "logprobs": 9}, 400, "logprobs"),
    ("completions", {"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("completions", {"prompt": "x", "seed": -5}, 400, "seed"),
    ("completions", {"prompt": "x", "suffix": "y"}, 400, "suffix"),
    ("completions", {"prompt": "x", "frequency_penalty": 3.0}, 400, "frequency_penalty"),
    ("completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("completions", {"prompt": "x", "model": "gpt-4o"}, 404, "model"),
    ("completions", {"prompt": "x" * (MAX_BODY + 10)}, 413, None),
    ("chat", {"messages": []}, 400, "messages"),
    ("chat", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400, "top_logprobs"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 9999}, 400,
     "max_completion_tokens"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "format": "bogus"}}}},
     400, "response_format"),
]


@pytest.mark.parametrize(("endpoint", "fields", "status", "param"), BAD)
def test_bad_inputs_get_their_code_and_param(client, endpoint, fields, status, param):
    create = client.completions.create if endpoint == "completions" else client.chat.completions.create
    with pytest.raises(openai.APIStatusError) as info:
        create(**({"model": MODEL} | fields))
    error = info.value
    assert error.status_code == status, error.body
    assert error.body["param"] == param and error.body["message"] and error.body["type"]
    assert "Traceback" not in error.body["message"]


def test_bad_json_and_unknown_paths_answer_in_openai_shape(served):
    status, body = http_error(f"{served.http_url}/v1/completions", b"{not json")
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    status, body = http_error(f"{served.http_url}/v1/nothing")
    assert status == 404 and "error" in body


def test_client_disconnect_frees_the_sequence_and_its_kv_cache(served):
    body = {"model": MODEL, "prompt": "The river", "max_tokens": 400, "temperature": 0, "stream": True}
    steps_before = int(state(served)["router"]["steps"])  # the router's step counter runs since it started
    url = urlsplit(served.http_url)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=120)
    connection.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    reply = connection.getresponse()
    assert reply.status == 200 and reply.getheader("Content-Type").startswith("text/event-stream")
    received = [reply.readline() for _ in range(6)]
    assert received[0].startswith(b"data: {")
    assert state(served)["router"]["live_kv_caches"] == 1
    reply.close()  # the socket closes when both the response and the connection let go of it
    connection.close()
    # The connection is closed: the front cancels the Serve call, the replica closes the batcher stream.
    wait_for(lambda: state(served)["router"]["live_kv_caches"] == 0, timeout=30, what="the KV cache freed")
    steps = int(state(served)["router"]["steps"])
    assert steps - steps_before < 300  # it stopped long before max_tokens
    assert int(state(served)["router"]["steps"]) == steps  # and decodes no more


def test_prometheus_scrapes_our_metrics_from_rays_endpoint(served, client, tmp_path):
    missing = prometheus_missing()
    if missing:
        pytest.skip(missing)
    prometheus = Prometheus([f"127.0.0.1:{served.metrics_port}"], tmp_path)
    try:
        prometheus.wait_ready()
        shard_tokens = "sum by (layer, expert) (ray_expertmesh_shard_tokens_total)"

        def by_shard() -> dict[tuple[str, str], float]:
            return {(r["metric"]["layer"], r["metric"]["expert"]): float(r["value"][1])
                    for r in prometheus.query(shard_tokens)}

        before = wait_for(by_shard, timeout=120, what="Prometheus to scrape ray_expertmesh_shard_tokens_total")
        expected = dict(before)
        for prompt in PROMPTS:
            reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0)
            for layer, counts in reply.model_extra["expertmesh"]["routing"]["tokens_per_expert"].items():
                for expert, n in enumerate(counts):
                    key = (layer, str(expert))
                    expected[key] = expected.get(key, 0.0) + n
        expected = {k: v for k, v in expected.items() if v}
        wait_for(lambda: by_shard() == expected, timeout=120, what="Prometheus to see this module's routing",
                 detail=lambda: f"{by_shard()} != {expected}")
        epoch = prometheus.query("max(ray_expertmesh_routing_epoch)")
        assert epoch and float(epoch[0]["value"][1]) >= 0
        replicas = prometheus.query("sum(ray_expertmesh_replica_tokens_total)")
        assert float(replicas[0]["value"][1]) == pytest.approx(sum(expected.values()))  # no replication: 1 each
        series = prometheus.api("label/__name__/values")
        assert "ray_expertmesh_dispatch_seconds_bucket" in series
    finally:
        prometheus.stop()


def test_cluster_page_in_headless_chromium(served, client, tmp_path):
    """Runs last: it kills an expert actor (the controller restores it) and watches the page follow."""
    missing = chromium_missing()
    if missing:
        pytest.skip(missing)
    victim = "expert-e3-r0"
    client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4)  # some load for the heatmap
    with headless_chromium() as browser:
        browser.get(f"{served.http_url}/")

        def page(selector: str, cell: str = "el.textContent") -> list:
            """What the page shows, read in one script call (it redraws every second: no stale elements)."""
            return browser.execute_script(
                f"return [...document.querySelectorAll({selector!r})].map(el => {cell});")

        def rows() -> dict[str, tuple[str, str]]:
            """actor -> (state, generation) as the page shows them."""
            return {actor: (state, generation) for actor, state, generation in page(
                "#replicas tbody tr", "[el.dataset.actor, el.dataset.state, el.cells[7].textContent]")}

        wait_for(lambda: len(rows()) == 8, timeout=60, what="the page to list every expert actor",
                 detail=lambda: page("#status"))
        assert set(rows()) == {f"expert-e{e}-r0" for e in range(8)}
        assert all(s == ("alive", "0") for s in rows().values())
        assert page("#model") == [MODEL]
        heat = wait_for(lambda: (cells := page("#heatmap td")) and sum(map(float, cells)) > 0 and cells,
                        timeout=60, what="the heatmap to show the load")
        assert len(heat) == 4 * 8
        browser.save_screenshot(str(tmp_path / "cluster_page.png"))
        assert (tmp_path / "cluster_page.png").stat().st_size > 10_000

        ray.kill(ray.get_actor(victim, namespace=NAMESPACE), no_restart=True)
        # The page follows on its own: the controller's events name the actor, and its replica comes back restored.
        wait_for(lambda: victim in page("#events td"), timeout=180,
                 what="the page to show the controller's event for the killed actor", detail=lambda: page("#status"))
        browser.save_screenshot(str(tmp_path / "cluster_page_after_kill.png"))
        wait_for(lambda: rows().get(victim) == ("alive", "1"), timeout=180,
                 what="the page to show the restored replica (generation 1)", detail=lambda: rows())
        browser.save_screenshot(str(tmp_path / "cluster_page_restored.png"))
        errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
        assert not errors, errors
