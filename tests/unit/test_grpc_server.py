"""The expert actor's gRPC server in-process (no Ray): it runs the given forward on the decoded batch, passes the
W3C carrier on, and turns a failing forward into INTERNAL, which the router counts as a failed call (not a death).
It serves only callers that send the cluster secret: none, a wrong one or a prefix of it is UNAUTHENTICATED, and
the forward never runs for them (issue 18 item 13)."""

from __future__ import annotations

import grpc
import pytest
import torch

from expertmesh.experts import wire
from expertmesh.experts.arrays import pack
from expertmesh.experts.grpc_server import MESSAGE_OPTIONS, SECRET_METADATA_KEY, ExpertGrpcServer, call_metadata
from expertmesh.protos import expert_transport_pb2_grpc as pb_grpc
from tests.fakes import FakeExperts

SECRET = "cluster-secret-for-tests"


class _WithSecret:
    """The stub as a router uses it: every call carries the cluster secret."""

    def __init__(self, stub: pb_grpc.ExpertTransportStub):
        self.Forward = lambda request, **kw: stub.Forward(request, metadata=call_metadata(SECRET), **kw)


@pytest.fixture
def server_and_stub():
    experts = FakeExperts()
    server = ExpertGrpcServer(experts.forward, "127.0.0.1", SECRET)
    channel = grpc.insecure_channel(server.address, options=MESSAGE_OPTIONS)
    yield experts, pb_grpc.ExpertTransportStub(channel), channel
    channel.close()
    server.stop()


@pytest.fixture
def served(server_and_stub):
    experts, stub, _ = server_and_stub
    return experts, _WithSecret(stub)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_forward_round_trip_with_trace(served, dtype):
    experts, stub = served
    x = (torch.randn(3, 4, generator=torch.Generator().manual_seed(0)) * 10).to(dtype)
    carrier = {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}
    reply = stub.Forward(wire.encode_batch(1, [2, 5], [1, 2], pack(x), carrier), timeout=10)
    got = wire.decode(reply.y)
    assert got.dtype == dtype and torch.equal(got, x * 2 + 1)  # the dtype crosses both ways, bit for bit
    assert experts.seen == [(1, [2, 5], [1, 2], (3, 4), carrier)]
    stub.Forward(wire.encode_batch(0, [0], [3], pack(x)), timeout=10)
    assert experts.seen[-1][-1] is None  # untraced calls reach forward without a carrier


def test_a_large_batch_passes_the_default_message_limit(served):
    _, stub = served
    x = pack(torch.ones(2048, 1024))  # 8 MiB, twice gRPC's default limit
    assert wire.decode(stub.Forward(wire.encode_batch(0, [0], [2048], x), timeout=30).y).shape == (2048, 1024)


def test_a_failing_forward_is_internal(served):
    _, stub = served
    with pytest.raises(grpc.RpcError) as err:
        stub.Forward(wire.encode_batch(-1, [7], [1], pack(torch.zeros(1, 4))), timeout=10)
    assert err.value.code() == grpc.StatusCode.INTERNAL and "KeyError" in err.value.details()


@pytest.mark.parametrize("metadata", [None, call_metadata("wrong"), call_metadata(SECRET[:-1]),
                                      call_metadata(SECRET + "x"), ((SECRET_METADATA_KEY, ""),),
                                      (("authorization", f"Bearer {SECRET}"),)],
                         ids=["none", "wrong", "prefix", "longer", "empty", "other-key"])
def test_a_call_without_the_cluster_secret_is_unauthenticated(server_and_stub, metadata):
    experts, stub, _ = server_and_stub
    x = torch.ones(1, 4)
    with pytest.raises(grpc.RpcError) as err:
        stub.Forward(wire.encode_batch(1, [0], [1], pack(x)), metadata=metadata, timeout=10)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert experts.seen == []  # refused before the forward ran
    reply = stub.Forward(wire.encode_batch(1, [0], [1], pack(x)), metadata=call_metadata(SECRET), timeout=10)
    assert torch.equal(wire.decode(reply.y), x * 2 + 1)  # the right secret is served


def test_an_unknown_method_without_the_secret_is_unauthenticated_too(server_and_stub):
    """The check sits in front of every method, so a probe cannot tell which methods exist."""
    _, _, channel = server_and_stub
    probe = channel.unary_unary("/expertmesh.v1.Other/Method")
    with pytest.raises(grpc.RpcError) as err:
        probe(b"", timeout=10)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_the_server_refuses_to_start_without_a_secret():
    with pytest.raises(ValueError, match="secret"):
        ExpertGrpcServer(FakeExperts().forward, "127.0.0.1", "")
