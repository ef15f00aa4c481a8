"""What a careless or hostile client does to `expertmesh serve` (issue 18, items 2, 3, 6-10), through the real gRPC
front of one served embedded model with default settings:

- every size the server advertises works end to end (a Score / ModelInfer of the model's whole context), and what
  cannot be sent is RESOURCE_EXHAUSTED naming the limit, never an UNAVAILABLE that invites a retry;
- a multi-megabyte prompt is refused at once, without stalling the streams already running;
- bytes that are not the request message, a 1 MB model name, data given twice: the right code and a short message;
- none of it floods the server's log with tracebacks;
- a junk certificate or a port in use stops `expertmesh serve` in a line, before Ray starts.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import threading
import time

import grpc
import numpy as np
import pytest
import torch

from expertmesh.experts.embedded_model import EMBEDDED_MODEL_DIR
from expertmesh.experts.reference import load_reference_model
from expertmesh.ops.cli import main
from expertmesh.protos import inference_pb2 as pb
from expertmesh.protos import inference_pb2_grpc, kserve_v2_pb2, kserve_v2_pb2_grpc
from tests.served import start_server
from tests.traffic import wait_for

TOL = 1e-4
CONTEXT, VOCAB = 512, 2048  # the embedded model's
BIG = [("grpc.max_receive_message_length", 256 << 20), ("grpc.max_send_message_length", 256 << 20)]


@pytest.fixture(scope="module")
def served():
    server = start_server()  # the embedded model, every setting at its default (16 MiB messages)
    yield server
    assert server.stop() == 0, server.log()


@pytest.fixture(scope="module")
def channel(served):
    with grpc.insecure_channel(served.target, options=BIG) as chan:
        yield chan


@pytest.fixture(scope="module")
def reference():
    return load_reference_model(EMBEDDED_MODEL_DIR)


def whole_context_ids(seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(3, VOCAB, size=CONTEXT).tolist()


def infer_request(ids: np.ndarray) -> kserve_v2_pb2.ModelInferRequest:
    req = kserve_v2_pb2.ModelInferRequest()
    req.inputs.add(name="input_ids", datatype="INT64", shape=list(ids.shape))
    req.raw_input_contents.append(ids.astype("<i8").tobytes())
    return req


def rpc_error(call, *args, stream: bool = False, **kwargs) -> grpc.RpcError:
    """The error `call` ends with (a server-streaming call is read to its end)."""
    with pytest.raises(grpc.RpcError) as err:
        result = call(*args, **kwargs)
        if stream:
            list(result)
    return err.value


# ---- item 2: the advertised sizes work end to end --------------------------------------------------------------


def test_score_of_the_whole_context_with_the_cli_equals_the_reference(served, reference, capsys):
    """512 positions × 2048 logits: a 4 MiB response, which the by-value hop through Serve used to refuse
    (UNAVAILABLE "router unavailable (AioRpcError); retry"; 511 positions worked)."""
    ids = whole_context_ids()
    capsys.readouterr()
    code = main(["score", "--target", served.target, "--token-ids", ",".join(map(str, ids)), "--json",
                 "--timeout", "240"])
    out, err = capsys.readouterr()
    assert code == 0, err[-2000:]
    got = torch.tensor(json.loads(out)["logits"])
    want = reference.forward([torch.tensor(ids)])[0]  # [S, V]
    assert got.shape == (CONTEXT, VOCAB) and (got - want).abs().max().item() <= TOL


def test_model_infer_of_the_whole_context_equals_the_reference(channel, reference):
    ids = np.array([whole_context_ids(seed=1)], dtype=np.int64)  # [1, 512]
    resp = kserve_v2_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(infer_request(ids), timeout=240)
    got = np.frombuffer(resp.raw_output_contents[0], dtype="<f4").reshape(resp.outputs[0].shape)
    want = reference.forward([torch.from_numpy(ids[0])])[0].numpy()
    assert got.shape == (1, CONTEXT, VOCAB) and np.abs(got[0] - want).max() <= TOL


def test_logits_too_large_to_send_are_resource_exhausted_naming_the_limit(channel):
    """17 × 512 positions of logits are 68 MiB, over the 64 MiB response limit: refused before any compute."""
    ids = np.ones((17, CONTEXT), dtype=np.int64)
    started = time.monotonic()
    err = rpc_error(kserve_v2_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer, infer_request(ids), timeout=60)
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.details()
    assert str(64 << 20) in err.details() and "max_message_bytes" in err.details()
    assert time.monotonic() - started < 10


def test_requests_up_to_the_limit_reach_the_router_and_larger_ones_are_resource_exhausted(channel):
    score = inference_pb2_grpc.InferenceStub(channel).Score
    # 6 MiB (one byte per id): over gRPC's 4 MiB default, under the 16 MiB limit, so the router answers (too long).
    err = rpc_error(score, pb.ScoreRequest(token_ids=[5] * (6 << 20)), timeout=60)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details().startswith("token_ids:"), err.details()
    err = rpc_error(score, pb.ScoreRequest(token_ids=[300] * (9 << 20)), timeout=60)  # two bytes per id: 18 MiB
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and str(16 << 20) in err.details(), err.details()


# ---- item 3: a huge prompt is refused without stalling other streams ---------------------------------------------


def test_a_multi_megabyte_prompt_is_refused_at_once_while_a_stream_keeps_flowing(channel):
    stub = inference_pb2_grpc.InferenceStub(channel)
    arrivals: list[float] = []
    errors: list[BaseException] = []

    def stream() -> None:
        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 6, 7]), max_tokens=300, ignore_eos=True)
        try:
            for message in stub.Generate(request, timeout=240):
                if message.HasField("token"):
                    arrivals.append(time.monotonic())
        except grpc.RpcError as exc:
            errors.append(exc)

    runner = threading.Thread(target=stream, daemon=True)
    runner.start()
    wait_for(lambda: len(arrivals) >= 5, timeout=120, what="the running stream's first tokens")
    refusals = []
    for size in (3_900_000, 12_000_000):  # under 4 MiB (tokenized in full before: 3+ s); over it (refused by Serve)
        prompt = ("def f(x):\n    return x * 2\n" * (size // 28 + 1))[:size]
        started = time.monotonic()
        err = rpc_error(stub.Generate, pb.GenerateRequest(prompt=prompt, max_tokens=1), stream=True, timeout=60)
        refusals.append((started, time.monotonic()))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
        assert err.details().startswith("prompt:") and str(CONTEXT) in err.details()
        assert refusals[-1][1] - started < 2.0, refusals
    runner.join(240)
    assert not errors and len(arrivals) == 300
    # The running stream's tokens kept coming while the huge prompts were refused (a 3.9 MB prompt held them 3-6 s).
    window = [t for t in arrivals if refusals[0][0] - 1.0 <= t <= refusals[-1][1] + 1.0]
    gaps = np.diff(window)
    assert len(window) >= 2 and gaps.max() < 1.0, (gaps.max(), refusals)


# ---- items 6, 7, 10: malformed, oversized and ambiguous input ----------------------------------------------------

GARBAGE = b"\xff\xff\xff\xff not a protobuf message"
PATHS = [("/expertmesh.v1.Inference/Score", False, "expertmesh.v1.ScoreRequest"),
         ("/expertmesh.v1.Inference/Generate", True, "expertmesh.v1.GenerateRequest"),
         ("/inference.GRPCInferenceService/ModelInfer", False, "expertmesh.kserve.v2.ModelInferRequest")]


@pytest.mark.parametrize("path,streaming,message", PATHS)
def test_bytes_that_are_not_the_request_message_are_invalid_argument(channel, path, streaming, message):
    make = channel.unary_stream if streaming else channel.unary_unary
    call = make(path, request_serializer=None, response_deserializer=None)  # raw bytes on the wire
    err = rpc_error(call, GARBAGE, stream=streaming, timeout=30)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (err.code(), err.details())
    assert message in err.details() and "Unexpected" not in err.details()


def test_a_one_megabyte_model_name_is_not_found_with_a_short_message(channel):
    name = "m" * (1 << 20)
    err = rpc_error(inference_pb2_grpc.InferenceStub(channel).Score, pb.ScoreRequest(model=name, token_ids=[1]),
                    timeout=30)
    assert err.code() == grpc.StatusCode.NOT_FOUND, (err.code(), err.details()[:200])
    assert len(err.details()) < 300 and f"({1 << 20} bytes)" in err.details()


def test_data_in_both_raw_input_contents_and_contents_is_invalid_argument(channel):
    req = infer_request(np.array([[1, 2, 3]], dtype=np.int64))
    req.inputs[0].contents.int64_contents.extend([4, 5, 6])
    err = rpc_error(kserve_v2_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer, req, timeout=30)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "inputs[input_ids]" in err.details()


# ---- item 8: no log flood ----------------------------------------------------------------------------------------


def test_bad_requests_do_not_flood_the_log(served, channel):
    """60 refused requests: no traceback, and a bounded number of lines about them (one per method and code, at
    most 5 per 10 s); Serve's access lines stay in its own log files."""
    start = served.log_path.stat().st_size
    stub = inference_pb2_grpc.InferenceStub(channel)
    raw_score = channel.unary_unary(PATHS[0][0], request_serializer=None, response_deserializer=None)
    for i in range(30):
        rpc_error(stub.Score, pb.ScoreRequest(model=f"no-such-model-{i}", token_ids=[1]), timeout=30)
        rpc_error(raw_score, GARBAGE, timeout=30)
    # A last refusal of another kind; its line shows every line before it has reached the server's stderr.
    sentinel = "sentinel-model-7f3a"
    rpc_error(kserve_v2_pb2_grpc.GRPCInferenceServiceStub(channel).ModelMetadata,
              kserve_v2_pb2.ModelMetadataRequest(name=sentinel), timeout=30)

    def new_log() -> str:
        with served.log_path.open("rb") as f:
            f.seek(start)
            return f.read().decode(errors="replace")

    log = wait_for(lambda: sentinel in new_log() and new_log(), timeout=60, what="the sentinel's log line",
                   detail=lambda: new_log()[-3000:])
    assert "Traceback" not in log, log[-3000:]
    about = [line for line in log.splitlines() if re.search(r"no-such-model|Score|Request failed|ScoreRequest", line)]
    assert len(about) <= 10, "\n".join(about[:40])


# ---- item 9: settings that cannot work stop `expertmesh serve` before anything starts ----------------------------


def serve_cli(*args: str) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "expertmesh.ops.cli", "serve", *args], capture_output=True,
                          text=True, timeout=120)
    return proc, time.monotonic() - started


def test_a_junk_certificate_exits_2_in_one_line_before_ray_starts(tmp_path):
    junk = tmp_path / "junk.pem"
    junk.write_text("-----BEGIN CERTIFICATE-----\nthis is no certificate\n-----END CERTIFICATE-----\n")
    proc, seconds = serve_cli("--port", "0", "--tls-cert", str(junk), "--tls-key", str(junk))
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: server.tls_cert:"), proc.stderr[-2000:]
    assert "Started" not in proc.stdout + proc.stderr and "ray" not in proc.stderr.lower()
    assert seconds < 30  # the import of torch and the CLI, nothing more (it took 46 s, Ray and every actor, before)


def test_a_port_in_use_exits_2_in_one_line_before_ray_starts():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        proc, seconds = serve_cli("--port", str(port))
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert lines == [f"error: server.port: {port} is already in use on 127.0.0.1"], proc.stderr[-2000:]
    assert seconds < 30
