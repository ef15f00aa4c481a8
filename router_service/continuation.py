"""Resuming a Generate stream on another router replica when the one serving it dies (the gRPC front's failover).

The front relays every message itself, so it knows what the client already has. When the Serve call fails because
the replica is gone, it sends the same request again with `resume_token_ids` = every token delivered so far; the
router re-prefills prompt + those tokens and continues after them (router_service/batching.py), counting them toward
max_tokens and usage and not streaming them again. Greedy output is then identical; so is sampled output, given a
seed (sampling.skip_draws), which is why a sampled request without one gets one here, before its first attempt.

Pure (protobuf messages only): the front (grpc_front.py) decides when to resume; this decides what is sent.
"""

from __future__ import annotations

import secrets

from ..protos import inference_pb2 as pb


def with_resumable_seed(request: pb.GenerateRequest) -> pb.GenerateRequest:
    """The request, with a random seed when it samples without one, so a resumed stream draws what the lost one
    would have (an unseeded request is random either way; the client sees no difference)."""
    if request.temperature == 0 or request.HasField("seed"):
        return request
    seeded = pb.GenerateRequest()
    seeded.CopyFrom(request)
    seeded.seed = secrets.randbelow(2**63)  # SamplingParams takes [0, 2^63)
    return seeded


class StreamProgress:
    """What one Generate stream has delivered to its client, and the request that continues it from there."""

    def __init__(self, request: pb.GenerateRequest):
        self.request = request
        self.delivered: list[int] = []  # token ids written to the client, in order
        self.done = False  # the final message (usage, routing) went out

    def record(self, message: pb.GenerateResponse) -> None:
        """Call after `message` was written to the client."""
        if message.HasField("token"):
            self.delivered.extend(message.token.token_ids)
        elif message.HasField("done"):
            self.done = True

    def next_request(self) -> pb.GenerateRequest:
        """The request to send now: the original until a token went out, then the original resuming after them
        (after any tokens the original itself resumed from, when a client resumes a stream of its own)."""
        if not self.delivered:
            return self.request
        resumed = pb.GenerateRequest()
        resumed.CopyFrom(self.request)
        resumed.resume_token_ids.extend(self.delivered)
        return resumed
