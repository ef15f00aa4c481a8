"""Overload shedding through `expertmesh serve --shed-overload` (issue 15 item 4): the flags reach the Serve
deployment's dispatcher, the served logits equal the in-process reference applying the same shed decisions (and
differ from the model without shedding), and shed slots are counted per response and in Admin RouterStats.

The tiny model has 4 experts, top-2: a 12-token round routes 24 slots, 6 per expert on average. Capacity 6 slots per
replica, zero-second windows and the off threshold equal to the threshold (no hysteresis band; 0.95 x 6 is no whole
number of slots) make each round's decisions depend on its routing alone, so the reference reproduces them with a
fresh policy.
"""

from __future__ import annotations

import grpc
import pytest
import torch

from expertmesh.experts.reference import load_reference_model
from expertmesh.protos import admin_pb2, admin_pb2_grpc, inference_pb2_grpc
from expertmesh.protos import inference_pb2 as pb
from expertmesh.router_service.shedding import ShedConfig, ShedPolicy, apply_shed
from tests.served import ONE_ACTOR, start_server
from tests.tiny_checkpoints import write_direct_mixtral

PROMPT = [5, 17, 29, 41, 53, 3, 77, 12, 90, 64, 8, 31]
SHED = ShedConfig(enabled=True, replica_tokens_per_step=6, window_s=0.0, off_threshold=0.95, off_window_s=0.0)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    model = write_direct_mixtral(tmp_path_factory.mktemp("served_shed") / "model", seed=5)
    server = start_server(*ONE_ACTOR, "--model", str(model), "--no-controller", "--shed-overload",
                          "--shed-capacity", "6", "--shed-window-s", "0", "--shed-off-threshold", "0.95",
                          "--shed-off-window-s", "0")
    server.model_dir = model
    yield server
    assert server.stop() == 0, server.log()


class _SameShedding:
    """The reference's experts serving what the router's dispatcher serves: the policy applied to every round,
    one live replica per shard."""

    def __init__(self, inner, num_experts: int):
        self.inner, self.num_experts = inner, num_experts
        self.policy = ShedPolicy(SHED, num_experts)
        self.shed = 0
        self._served = {}

    def effective_routing(self, layer, routing):
        return self._served.get(layer, routing)

    def run(self, layer, hidden, routing):
        shed = self.policy.observe(layer, 0.0, routing.tokens_per_expert(self.num_experts),
                                   torch.ones(self.num_experts, dtype=torch.int64))
        served = apply_shed(routing, shed, ~self.policy.shedding(layer))
        self.shed += served.shed
        self._served[layer] = served
        return self.inner.run(layer, hidden, served)


def _shed_slots(channel) -> int:
    return admin_pb2_grpc.AdminStub(channel).GetRouterStats(admin_pb2.RouterStatsRequest(), timeout=30).shed_slots


def test_served_shedding_equals_the_reference_and_is_counted(served):
    from expertmesh.experts.modeling import MoEDecoder

    reference = load_reference_model(served.model_dir)
    shedding = MoEDecoder(reference.cfg, reference.w, _SameShedding(reference.experts, reference.cfg.num_experts))
    want = torch.log_softmax(shedding.forward([torch.tensor(PROMPT)])[0], dim=-1)  # [S, V]
    plain = torch.log_softmax(reference.forward([torch.tensor(PROMPT)])[0], dim=-1)
    assert (want - plain).abs().max() > 1e-3  # shedding changes this output

    with grpc.insecure_channel(served.target) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        before = _shed_slots(channel)
        scored = stub.Score(pb.ScoreRequest(token_ids=PROMPT, log_probs=True), timeout=60)
        got = torch.tensor(scored.values).reshape(scored.seq_len, scored.vocab_size)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
        after_score = _shed_slots(channel)
        assert after_score - before == shedding.experts.shed > 0

        done = None
        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=PROMPT), max_tokens=4)
        for message in stub.Generate(request, timeout=60):
            if message.HasField("done"):
                done = message.done
        assert done is not None and done.routing.shed_tokens > 0
        assert _shed_slots(channel) - after_score == done.routing.shed_tokens
