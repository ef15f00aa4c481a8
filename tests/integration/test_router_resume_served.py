"""A router replica killed under live Generate streams, through the real gRPC front of `expertmesh serve
--router-replicas 2` (issue 18 item 11): every in-flight stream, greedy and seeded sampling, completes without an
error and equals its fault-free output (the front resumes it on the live replica after the tokens it delivered), and
requests sent right after the kill are served.

The served process joins this module's Ray by address, so the test can find and kill a router replica (a Serve
replica actor, in namespace "serve").
"""

from __future__ import annotations

import grpc
import pytest
import ray

from expertmesh.protos import inference_pb2 as pb
from expertmesh.protos import inference_pb2_grpc
from tests.served import router_replicas, server_on_own_ray
from tests.traffic import StreamsInFlight, wait_for

PROMPTS = [[3, 14, 15, 92, 65, 35, 89, 79, 32, 38], [2, 71, 82, 81, 82, 84, 59, 4], [1, 41, 42, 13, 56, 23]]
MAX_TOKENS = 100  # long enough (several seconds on a 2-core machine) to be mid-stream when the replica dies
SAMPLING = [dict(), dict(temperature=0.9, top_k=20, seed=7), dict(temperature=1.1, top_p=0.9, seed=2**40 + 1)]


def requests() -> list[pb.GenerateRequest]:
    """Every prompt greedy and with two seeded samplings: 9 streams, so both replicas carry some."""
    return [pb.GenerateRequest(token_ids=pb.TokenIds(ids=p), max_tokens=MAX_TOKENS, ignore_eos=True, **s)
            for p in PROMPTS for s in SAMPLING]


@pytest.fixture(scope="module")
def served(checkpoints):
    with server_on_own_ray("--model", str(checkpoints["mixtral"]), "--router-replicas", "2") as server:
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
