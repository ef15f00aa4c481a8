"""A router replica killed under live streams, through the real fronts of `expertmesh serve --router-replicas 2
--http-port 0`:

- gRPC Generate (issue 18 item 11): every in-flight stream, greedy and seeded sampling, completes without an error
  and equals its fault-free output (the front resumes it on the live replica after the tokens it delivered), and
  requests sent right after the kill are served;
- the OpenAI HTTP API (issue 30 item 2), with the unmodified `openai` client: 10 in-flight completions and chat
  requests, streamed and not, n = 1 and 2, greedy and seeded sampling, complete without an error and equal their
  fault-free responses (text, finish reasons, usage).

The served process joins this module's Ray by address, so the test can find and kill a router replica (a Serve
replica actor, in namespace "serve"). The checkpoint is the tiny Mixtral with a word-level tokenizer added (token i
is the word `wi`), so HTTP responses' text names every token.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import grpc
import pytest
import ray
from ray import serve

from expertmesh.protos import inference_pb2 as pb
from expertmesh.protos import inference_pb2_grpc
from tests.served import ONE_ACTOR, router_replicas, server_on_own_ray
from tests.traffic import StreamsInFlight, wait_for

PROMPTS = [[3, 14, 15, 92, 65, 35, 89, 79, 32, 38], [2, 71, 82, 81, 82, 84, 59, 4], [1, 41, 42, 13, 56, 23]]
MAX_TOKENS = 100  # long enough (several seconds on a 2-core machine) to be mid-stream when the replica dies
SAMPLING = [dict(), dict(temperature=0.9, top_k=20, seed=7), dict(temperature=1.1, top_p=0.9, seed=2**40 + 1)]


def requests() -> list[pb.GenerateRequest]:
    """Every prompt greedy and with two seeded samplings: 9 streams, so both replicas carry some."""
    return [pb.GenerateRequest(token_ids=pb.TokenIds(ids=p), max_tokens=MAX_TOKENS, ignore_eos=True, **s)
            for p in PROMPTS for s in SAMPLING]


def with_word_tokenizer(source: Path, out: Path) -> Path:
    """The checkpoint at `source` (links to its files) plus a word-level tokenizer.json (id i = the word `wi`) and a
    plain chat template, so text prompts, chat and the HTTP responses' text work on the tiny model."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    out.mkdir()
    for path in source.iterdir():
        (out / path.name).symlink_to(path)
    vocab = json.loads((source / "config.json").read_text())["vocab_size"]
    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(out / "tokenizer.json"))
    template = "{% for m in messages %}w3 {{ m['content'] }} w4 {% endfor %}{% if add_generation_prompt %}w5{% endif %}"
    (out / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    return out


@pytest.fixture(scope="module")
def served(checkpoints, tmp_path_factory):
    model = with_word_tokenizer(checkpoints["mixtral"], tmp_path_factory.mktemp("resume") / "mixtral-words")
    with server_on_own_ray(*ONE_ACTOR, "--model", str(model), "--router-replicas", "2",
                           "--http-port", "0") as server:
        yield server


@pytest.fixture(scope="module")
def stub(served):
    with grpc.insecure_channel(served.target) as chan:
        yield inference_pb2_grpc.InferenceStub(chan)


def generate(stub, request: pb.GenerateRequest, timeout: float = 120) -> list[int]:
    return [t for m in stub.Generate(request, timeout=timeout) if m.HasField("token") for t in m.token.token_ids]


def test_streams_survive_a_killed_router_replica_with_identical_output(served, stub):
    fault_free = [generate(stub, r) for r in requests()]
    assert all(len(tokens) == MAX_TOKENS for tokens in fault_free)
    replicas = wait_for(lambda: len(router_replicas()) == 2 and router_replicas(), 30, "two router replicas")

    streams = StreamsInFlight(stub, requests())
    wait_for(streams.all_started, 120, "every stream mid-way", detail=lambda: streams.errors)
    name, namespace = replicas[0]
    ray.kill(ray.get_actor(name, namespace=namespace))
    # New requests right after the kill: served by the live replica (or resent to it), never failed.
    for request, expected in zip(requests()[:3], fault_free[:3]):
        assert generate(stub, request) == expected

    got = streams.join()
    assert streams.errors == [None] * len(got), streams.errors
    assert got == fault_free  # greedy and seeded sampling alike: nothing lost, nothing repeated, nothing changed
    # The kill did land under live streams: the front resumed some of them.
    assert "router replica lost mid-stream" in served.log(chars=200_000), served.log()


# ---------------------------------------------------------------- the OpenAI HTTP API

HTTP_MAX_TOKENS = 60  # per choice; with n = 2 and 10 requests, mid-stream for seconds on a 2-core machine
WORDS = ["w11 w23 w5 w71 w40 w9", "w2 w64 w31 w8", "w90 w17 w17 w3 w55"]
GREEDY, SEEDED, SEEDED_N2 = dict(temperature=0), dict(temperature=0.9, seed=7), dict(temperature=1.1, top_p=0.9,
                                                                                       seed=2**40 + 1, n=2)


def http_requests() -> list[tuple[str, bool, dict]]:
    """(kind, stream, arguments) of 10 requests: completions and chat, streamed or not, greedy or seeded, n 1 or 2."""
    def chat(words: str) -> list[dict]:
        return [{"role": "user", "content": words}]

    return [
        ("completion", True, dict(prompt=WORDS[0], **GREEDY)),
        ("completion", True, dict(prompt=WORDS[1], **SEEDED)),
        ("completion", True, dict(prompt=WORDS[2], **SEEDED_N2)),
        ("completion", True, dict(prompt=WORDS[0], logprobs=1, stream_options={"include_usage": True}, **SEEDED)),
        ("chat", True, dict(messages=chat(WORDS[1]), **GREEDY)),
        ("chat", True, dict(messages=chat(WORDS[2]), stream_options={"include_usage": True}, **SEEDED_N2)),
        ("completion", False, dict(prompt=WORDS[1], **GREEDY)),
        ("completion", False, dict(prompt=WORDS[2], **SEEDED_N2)),
        ("chat", False, dict(messages=chat(WORDS[0]), **SEEDED)),
        ("chat", False, dict(messages=chat(WORDS[0]), **SEEDED_N2)),
    ]


class HttpInFlight:
    """The requests on threads with the `openai` client, each recording per choice its text and finish reason (and
    the usage), chunk by chunk for a streamed one, so the test can kill a replica while they are mid-way."""

    def __init__(self, client, requests: list[tuple[str, bool, dict]]):
        self.results: list[dict] = [{"text": {}, "finish": {}, "usage": None} for _ in requests]
        self.chunks = [0] * len(requests)
        self.errors: list[BaseException | None] = [None] * len(requests)
        self._threads = [threading.Thread(target=self._run, args=(client, i, r), daemon=True)
                         for i, r in enumerate(requests)]
        for thread in self._threads:
            thread.start()

    def _run(self, client, i: int, request) -> None:
        kind, stream, arguments = request
        out = self.results[i]
        api = client.chat.completions if kind == "chat" else client.completions
        try:
            reply = api.create(model=MODEL_NAME, max_tokens=HTTP_MAX_TOKENS, stream=stream,
                               extra_body={"ignore_eos": True}, **arguments)
            for chunk in (reply if stream else [reply]):
                self.chunks[i] += 1
                if chunk.usage is not None:
                    # Without prompt_tokens_details: what the prefix cache served depends on what each replica ran
                    # before (a resumed call may find the blocks its first replica's run left), not on the request.
                    out["usage"] = chunk.usage.model_dump(exclude={"prompt_tokens_details"})
                for choice in chunk.choices:
                    piece = choice.delta.content if stream and kind == "chat" else (
                        choice.message.content if kind == "chat" else choice.text)
                    out["text"][choice.index] = out["text"].get(choice.index, "") + (piece or "")
                    if choice.finish_reason:
                        out["finish"][choice.index] = choice.finish_reason
        except BaseException as exc:  # recorded for the test to assert on
            self.errors[i] = exc

    def streams_started(self, requests) -> bool:
        return all(self.chunks[i] >= 3 for i, (_, stream, _) in enumerate(requests) if stream) and not any(
            self.errors)

    def join(self, timeout: float = 240) -> list[dict]:
        for thread in self._threads:
            thread.join(timeout)
        assert not any(t.is_alive() for t in self._threads), "a request is still running"
        return self.results


MODEL_NAME = "mixtral-words"  # the served model's name: its folder's


def running_router_replicas() -> int:
    status = serve.status().applications.get("expertmesh")
    return 0 if status is None else status.deployments["router"].replica_states.get("RUNNING", 0)


def test_http_streams_survive_a_killed_router_replica_with_identical_output(served):
    openai = pytest.importorskip("openai", reason="the openai client is in the test extra")
    client = openai.OpenAI(base_url=f"{served.http_url}/v1", api_key="unused", max_retries=0, timeout=240)
    fault_free = HttpInFlight(client, http_requests()).join()  # together: the same batching as under the fault
    for result, (_, _, arguments) in zip(fault_free, http_requests()):
        choices = arguments.get("n", 1)
        assert sorted(result["finish"]) == list(range(choices)) and set(result["finish"].values()) == {"length"}
        assert all(len(text.split()) == HTTP_MAX_TOKENS for text in result["text"].values()), result
    # The previous test killed a replica: Serve has to have replaced it, so both carry streams when one dies.
    wait_for(lambda: running_router_replicas() == 2 and len(router_replicas()) == 2, 120, "two running replicas")

    flight = HttpInFlight(client, http_requests())
    wait_for(lambda: flight.streams_started(http_requests()), 120, "every stream mid-way", detail=lambda: flight.errors)
    name, namespace = router_replicas()[0]
    ray.kill(ray.get_actor(name, namespace=namespace))
    got = flight.join()
    assert flight.errors == [None] * len(got), flight.errors
    assert got == fault_free  # text per choice, finish reasons, usage: nothing lost, repeated or changed
    assert "HTTP); resuming after" in served.log(chars=400_000), served.log()
