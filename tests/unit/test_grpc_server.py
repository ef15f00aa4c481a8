"""The expert actor's gRPC server in-process (no Ray): it runs the given forward on the decoded batch, passes the
W3C carrier on, and turns a failing forward into INTERNAL, which the router counts as a failed call (not a death)."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from expertmesh.experts import wire
from expertmesh.experts.grpc_server import MESSAGE_OPTIONS, ExpertGrpcServer
from expertmesh.protos import expert_transport_pb2_grpc as pb_grpc
from tests.fakes import FakeExperts


@pytest.fixture
def served():
    experts = FakeExperts()
    server = ExpertGrpcServer(experts.forward, "127.0.0.1")
    channel = grpc.insecure_channel(server.address, options=MESSAGE_OPTIONS)
    yield experts, pb_grpc.ExpertTransportStub(channel)
    channel.close()
    server.stop()


def test_forward_round_trip_with_trace(served):
    experts, stub = served
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    carrier = {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}
    reply = stub.Forward(wire.encode_batch(1, [2, 5], [1, 2], x, carrier), timeout=10)
    assert np.array_equal(wire.decode(reply.y), x * 2 + 1)
    assert experts.seen == [(1, [2, 5], [1, 2], (3, 4), carrier)]
    stub.Forward(wire.encode_batch(0, [0], [3], x), timeout=10)
    assert experts.seen[-1][-1] is None  # untraced calls reach forward without a carrier


def test_a_large_batch_passes_the_default_message_limit(served):
    _, stub = served
    x = np.ones((2048, 1024), np.float32)  # 8 MiB, twice gRPC's default limit
    assert wire.decode(stub.Forward(wire.encode_batch(0, [0], [2048], x), timeout=30).y).shape == (2048, 1024)


def test_a_failing_forward_is_internal(served):
    _, stub = served
    with pytest.raises(grpc.RpcError) as err:
        stub.Forward(wire.encode_batch(-1, [7], [1], np.zeros((1, 4), np.float32)), timeout=10)
    assert err.value.code() == grpc.StatusCode.INTERNAL and "KeyError" in err.value.details()
