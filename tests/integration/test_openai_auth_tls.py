"""The OpenAI HTTP API with auth and TLS on, and its limits, against one `expertmesh serve --http-port` with a
bearer token, a certificate, a one-sequence batcher with a one-request queue and no controller:

- the unmodified `openai` client over HTTPS with the token gets what gRPC (TLS + token) gets;
- a missing or wrong token is 401 in OpenAI's shape; the page is public, its state is not; plain HTTP is refused;
- a full queue is 429; expert actors that are gone are 503, and the server keeps answering.
"""

from __future__ import annotations

import http.client
import json
import ssl
import urllib.error
import urllib.request
from urllib.parse import urlsplit

import grpc
import pytest

from expertmesh.experts.embedded_model import EMBEDDED_MODEL_NAME
from expertmesh.protos import inference_pb2 as pb
from expertmesh.protos import inference_pb2_grpc
from tests.served import ONE_ACTOR, self_signed_cert, server_on_own_ray
from tests.traffic import kill_and_wait, wait_for

openai = pytest.importorskip("openai", reason="the openai client is in the test extra (pip install -e '.[test]')")

MODEL = EMBEDDED_MODEL_NAME
TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    cert, key = self_signed_cert(tmp_path_factory.mktemp("tls"))
    # One actor hosting every expert (ONE_ACTOR): these tests name none, and the last one kills them all.
    with server_on_own_ray(*ONE_ACTOR, "--http-port", "0", "--auth-token", TOKEN, "--tls-cert", str(cert), "--tls-key",
                           str(key), "--max-active", "1", "--max-waiting", "1", "--no-controller",
                           "--wait-timeout", "1") as server:
        server.cert = cert
        server.tls = ssl.create_default_context(cafile=str(cert))
        yield server


def client_for(served, token: str = TOKEN):
    return openai.OpenAI(base_url=f"{served.http_url}/v1", api_key=token, max_retries=0, timeout=120,
                         http_client=openai.DefaultHttpxClient(verify=served.tls))


def get(served, path: str, headers: dict | None = None) -> tuple[int, dict | str]:
    request = urllib.request.Request(f"{served.http_url}{path}", headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=30, context=served.tls) as reply:
            status, raw, kind = reply.status, reply.read(), reply.headers.get("Content-Type", "")
    except urllib.error.HTTPError as exc:
        status, raw, kind = exc.code, exc.read(), exc.headers.get("Content-Type", "")
    return status, json.loads(raw) if kind.startswith("application/json") else raw.decode()


def router_stats(served) -> dict:
    status, body = get(served, "/api/state", AUTH)
    assert status == 200, body
    return body["router"]


def test_openai_client_over_tls_with_the_token_gets_what_grpc_gets(served):
    assert served.http_url.startswith("https://")
    client = client_for(served)
    text = client.completions.create(model=MODEL, prompt="The river", max_tokens=8, temperature=0).choices[0].text
    credentials = grpc.ssl_channel_credentials(served.cert.read_bytes())
    with grpc.secure_channel(served.target, credentials) as channel:
        stream = inference_pb2_grpc.InferenceStub(channel).Generate(
            pb.GenerateRequest(prompt="The river", max_tokens=8), metadata=(("authorization", f"Bearer {TOKEN}"),),
            timeout=120)
        assert "".join(m.token.text for m in stream if m.HasField("token")) == text
    chunks = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                            temperature=0, stream=True)
    assert sum(bool(c.choices and c.choices[0].delta.content) for c in chunks) >= 1


def test_missing_or_wrong_token_is_401_and_the_page_is_public(served):
    with pytest.raises(openai.AuthenticationError) as info:
        client_for(served, "wrong").models.list()
    assert info.value.status_code == 401 and info.value.body["code"] == "invalid_api_key"
    for path in ("/v1/models", "/api/state"):
        status, body = get(served, path)
        assert status == 401 and body["error"]["type"] == "authentication_error", (path, body)
    assert get(served, "/v1/models", AUTH)[0] == 200
    status, page = get(served, "/")  # the page holds no data: it asks /api/state with the token from #token=
    assert status == 200 and "cluster.js" in page


def test_plain_http_to_the_tls_port_is_refused(served):
    plain = served.http_url.replace("https://", "http://")
    with pytest.raises((urllib.error.URLError, http.client.HTTPException, ConnectionError)):
        urllib.request.urlopen(urllib.request.Request(f"{plain}/v1/models", headers=AUTH), timeout=30)


def _start_stream(served, max_tokens: int) -> http.client.HTTPSConnection:
    url = urlsplit(served.http_url)
    connection = http.client.HTTPSConnection(url.hostname, url.port, timeout=120, context=served.tls)
    body = {"model": MODEL, "prompt": "The river", "max_tokens": max_tokens, "temperature": 0, "stream": True}
    connection.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json", **AUTH})
    return connection


def test_a_full_queue_is_429(served):
    first = _start_stream(served, 400)
    reply = first.getresponse()
    assert reply.status == 200 and reply.readline().startswith(b"data: ")  # decoding: the one active slot
    second = _start_stream(served, 400)  # queued: its response starts when it gets the slot
    try:
        wait_for(lambda: router_stats(served)["waiting_requests"] == 1, timeout=30, what="the second request queued")
        with pytest.raises(openai.RateLimitError) as info:
            client_for(served).completions.create(model=MODEL, prompt="x", max_tokens=2)
        assert info.value.status_code == 429
        assert info.value.body["type"] == "rate_limit_error" and "max_waiting" in info.value.body["message"]
    finally:
        reply.close()
        first.close()
        second.close()
    wait_for(lambda: router_stats(served)["live_kv_caches"] == 0, timeout=60, what="both sequences freed")


def test_experts_gone_is_503_and_the_server_keeps_answering(served):
    """Runs last: it kills every expert actor (no controller: nothing restores them)."""
    import ray

    from expertmesh.cluster.naming import NAMESPACE

    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["namespace"] == NAMESPACE and a["name"].startswith("expert-")]
    assert len(names) == 1  # ONE_ACTOR: the embedded model's 8 experts in one actor
    for name in names:
        kill_and_wait(name)
    with pytest.raises(openai.InternalServerError) as info:
        client_for(served).completions.create(model=MODEL, prompt="The river", max_tokens=3)
    assert info.value.status_code == 503
    assert info.value.body["type"] == "service_unavailable_error" and "Traceback" not in info.value.body["message"]
    assert get(served, "/v1/models", AUTH)[0] == 200
