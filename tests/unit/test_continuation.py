"""What the gRPC front re-sends when a router replica dies under a Generate stream
(`expertmesh.router_service.continuation`): the original request until a token went out, then the original resuming
after every delivered token; a sampled request without a seed gets one first, so the resumed draws match."""

from __future__ import annotations

from expertmesh.protos import inference_pb2 as pb
from expertmesh.router_service.continuation import StreamProgress, with_resumable_seed

REQUEST = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[4, 5, 6]), max_tokens=8, temperature=0.7, seed=42,
                             stop=["END"], stop_token_ids=[9])


def token(*ids: int, text: str = "") -> pb.GenerateResponse:
    return pb.GenerateResponse(token=pb.TokenChunk(token_ids=list(ids), text=text))


def test_before_any_token_the_request_is_resent_unchanged():
    progress = StreamProgress(REQUEST)
    assert progress.next_request() is REQUEST and not progress.delivered


def test_after_tokens_the_request_resumes_after_every_delivered_token_and_keeps_every_other_field():
    progress = StreamProgress(REQUEST)
    for message in (token(11, text="a"), token(12), token(13, 14)):
        progress.record(message)
    resumed = progress.next_request()
    assert list(resumed.resume_token_ids) == [11, 12, 13, 14]
    expected = pb.GenerateRequest()
    expected.CopyFrom(REQUEST)
    resumed.ClearField("resume_token_ids")
    assert resumed == expected  # prompt, max_tokens (the router counts the resumed tokens in it), seed, stops
    assert not REQUEST.resume_token_ids  # the original is not modified


def test_a_second_failover_resumes_after_all_tokens_and_a_client_resume_is_kept_in_front():
    original = pb.GenerateRequest()
    original.CopyFrom(REQUEST)
    original.resume_token_ids.extend([1, 2])  # the client itself resumed a stream
    progress = StreamProgress(original)
    progress.record(token(3))
    assert list(progress.next_request().resume_token_ids) == [1, 2, 3]
    progress.record(token(4))
    assert list(progress.next_request().resume_token_ids) == [1, 2, 3, 4]


def test_done_is_recorded():
    progress = StreamProgress(REQUEST)
    progress.record(token(1))
    assert not progress.done
    progress.record(pb.GenerateResponse(done=pb.GenerationDone(finish_reason="length")))
    assert progress.done and progress.delivered == [1]


def test_an_unseeded_sampled_request_gets_a_seed_greedy_and_seeded_ones_are_unchanged():
    unseeded = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1]), max_tokens=3, temperature=0.5)
    seeded = with_resumable_seed(unseeded)
    assert seeded.HasField("seed") and 0 <= seeded.seed < 2**63 and not unseeded.HasField("seed")
    seeded.ClearField("seed")
    assert seeded == unseeded
    assert with_resumable_seed(REQUEST) is REQUEST
    greedy = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1]), max_tokens=3)
    assert with_resumable_seed(greedy) is greedy
