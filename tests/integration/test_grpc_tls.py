"""The embedded default model served over TLS by two router replicas with a tiny queue: text prompts, stop strings,
seeded sampling, and RESOURCE_EXHAUSTED when the queue is full."""

from __future__ import annotations

import concurrent.futures

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from expertmesh.experts.embedded_model import EMBEDDED_MODEL_DIR
from expertmesh.experts.tokenizer import load_tokenizer
from expertmesh.protos import inference_pb2 as pb
from expertmesh.protos import inference_pb2_grpc
from tests.served import ONE_ACTOR, self_signed_cert, start_server


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory):
    cert, key = self_signed_cert(tmp_path_factory.mktemp("tls"))
    server = start_server(*ONE_ACTOR, "--tls-cert", str(cert), "--tls-key", str(key), "--router-replicas", "2",
                          "--max-active", "1", "--max-waiting", "1")
    yield server, cert
    assert server.stop() == 0, server.log()


@pytest.fixture(scope="module")
def secure_channel(tls_server):
    server, cert = tls_server
    creds = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
    with grpc.secure_channel(f"localhost:{server.port}", creds) as chan:
        yield chan


def stream(chan, **fields) -> tuple[list[int], str, pb.GenerationDone]:
    ids, text, done = [], [], None
    for message in inference_pb2_grpc.InferenceStub(chan).Generate(pb.GenerateRequest(**fields), timeout=120):
        if message.HasField("token"):
            ids.extend(message.token.token_ids)
            text.append(message.token.text)
        else:
            done = message.done
    return ids, "".join(text), done


def test_tls_serves_and_plaintext_is_refused(tls_server, secure_channel):
    server, _ = tls_server
    assert server.model_name == "expertmesh-demo"
    resp = health_pb2_grpc.HealthStub(secure_channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert resp.status == health_pb2.HealthCheckResponse.SERVING
    with grpc.insecure_channel(server.target) as plain, pytest.raises(grpc.RpcError) as err:
        health_pb2_grpc.HealthStub(plain).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_prompt_text_streams_pieces_that_add_up_to_the_decoded_tokens(secure_channel):
    ids, text, done = stream(secure_channel, prompt="import os\n\ndef ", max_tokens=24, ignore_eos=True)
    assert len(ids) == 24 and done.finish_reason == "length"
    assert text == load_tokenizer(EMBEDDED_MODEL_DIR).decode(ids) and text.strip()


def test_stop_string_ends_the_text_before_it(secure_channel):
    ids, text, done = stream(secure_channel, prompt="class Parser:\n    def ", max_tokens=64, stop=["\n"],
                             ignore_eos=True)
    assert "\n" not in text
    assert done.finish_reason == "stop" or len(ids) == 64


def test_seeded_sampling_is_reproducible(secure_channel):
    common = dict(prompt="def ", max_tokens=16, temperature=1.0, top_p=0.9, top_k=50, ignore_eos=True)
    first = stream(secure_channel, seed=7, **common)[0]
    again = stream(secure_channel, seed=7, **common)[0]
    other = [stream(secure_channel, seed=s, **common)[0] for s in (8, 9)]
    assert first == again and any(o != first for o in other)


def test_full_queue_is_resource_exhausted_and_the_server_recovers(secure_channel):
    def attempt(i: int) -> str:
        try:
            stream(secure_channel, token_ids=pb.TokenIds(ids=[10 + i, 20, 30]), max_tokens=40, ignore_eos=True)
            return "OK"
        except grpc.RpcError as exc:
            return exc.code().name

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        codes = list(pool.map(attempt, range(12)))
    assert "RESOURCE_EXHAUSTED" in codes and "OK" in codes
    assert set(codes) <= {"OK", "RESOURCE_EXHAUSTED"}
    assert stream(secure_channel, prompt="x = ", max_tokens=4)[0]
