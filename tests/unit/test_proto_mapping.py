"""The protobuf <-> request mapping (router_service/proto_mapping.py), directly: no Ray, no server.

Every function on valid messages (what it builds) and on invalid ones (the gRPC status code, and the field named
first in the message, which is what a client sees in the status details).
"""

from __future__ import annotations

import pickle

import grpc
import numpy as np
import pytest
import torch

from expertmesh.experts.config import MoEModelConfig
from expertmesh.protos import inference_pb2 as pb
from expertmesh.protos import kserve_v2_pb2 as kpb
from expertmesh.router_service import proto_mapping
from expertmesh.router_service.batching import DoneEvent, TokenEvent
from expertmesh.router_service.errors import RequestError
from expertmesh.router_service.sampling import SamplingParams

MODEL = "tiny"
VOCAB, CONTEXT, EOS = 50, 16, 2
CFG = MoEModelConfig(
    family="mixtral", vocab_size=VOCAB, hidden_size=8, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=4,
    num_experts=4, top_k=2, expert_intermediate_size=8, norm_topk_prob=True, rms_norm_eps=1e-5, rope_theta=1e4,
    max_position_embeddings=CONTEXT, moe_layers=(0, 1), eos_token_id=EOS,
)


def encode(text: str) -> list[int]:
    """A stand-in tokenizer: one id per non-space character."""
    return [ord(c) % VOCAB for c in text if not c.isspace()]


def no_tokenizer(text: str) -> list[int]:
    raise RequestError("prompt", "this checkpoint has no tokenizer.json; send token_ids")


def raises_api_error(code: str, field: str, call, *args, **kwargs) -> proto_mapping.ApiError:
    """Run call(*args, **kwargs); it must raise ApiError with a real gRPC code, its message starting with `field`."""
    with pytest.raises(proto_mapping.ApiError) as err:
        call(*args, **kwargs)
    assert err.value.code == code, err.value
    assert isinstance(getattr(grpc.StatusCode, err.value.code), grpc.StatusCode)  # what the front sets
    assert err.value.message.startswith(f"{field}:"), err.value.message
    assert str(err.value) == f"{code}: {err.value.message}"
    return err.value


# ---- ApiError, invalid, as_api_error, check_model_name ---------------------------------------------------------------


def test_api_error_keeps_code_and_message_through_pickle():
    err = proto_mapping.ApiError("NOT_FOUND", "model: unknown")
    back = pickle.loads(pickle.dumps(err))  # how Ray moves it between processes
    assert type(back) is proto_mapping.ApiError and (back.code, back.message) == ("NOT_FOUND", "model: unknown")


def test_invalid_is_invalid_argument_naming_the_field():
    err = proto_mapping.invalid("top_k", "must be ≥ 0")
    assert (err.code, err.message) == ("INVALID_ARGUMENT", "top_k: must be ≥ 0")


def test_as_api_error_maps_known_errors_only():
    err = proto_mapping.ApiError("NOT_FOUND", "x: y")
    assert proto_mapping.as_api_error(err) is err
    mapped = proto_mapping.as_api_error(RequestError("max_tokens", "must be positive"))
    assert (mapped.code, mapped.message) == ("INVALID_ARGUMENT", "max_tokens: must be positive")
    assert proto_mapping.as_api_error(RuntimeError("boom")) is None
    assert proto_mapping.as_api_error(ValueError("a plain ValueError is not a caller's mistake")) is None


def test_check_model_name():
    proto_mapping.check_model_name("", MODEL)  # unset: the served model
    proto_mapping.check_model_name(MODEL, MODEL)
    err = raises_api_error("NOT_FOUND", "model", proto_mapping.check_model_name, "other", MODEL)
    assert "'other'" in err.message and repr(MODEL) in err.message
    raises_api_error("NOT_FOUND", "model_name",
                     lambda: proto_mapping.check_model_name("other", MODEL, field="model_name"))


# ---- GenerateRequest -> GenerationRequest ----------------------------------------------------------------------------


def gen_request(**fields) -> pb.GenerateRequest:
    fields.setdefault("max_tokens", 4)
    if "prompt" not in fields and "token_ids" not in fields:
        fields["token_ids"] = pb.TokenIds(ids=[1, 2, 3])
    return pb.GenerateRequest(**fields)


def test_generation_request_from_token_ids_with_defaults():
    got = proto_mapping.generation_request(gen_request(), CFG, encode, MODEL)
    assert got.prompt_ids == [1, 2, 3] and got.max_tokens == 4
    assert got.sampling == SamplingParams(temperature=0.0, top_p=1.0, top_k=0, seed=None)  # unset top_p is 1
    assert got.stop_token_ids == frozenset() and got.stop_strings == ()
    assert got.eos_token_id == EOS


def test_generation_request_from_a_prompt_with_every_field():
    req = gen_request(prompt="ab c", model=MODEL, temperature=0.7, top_p=0.9, top_k=5, seed=11,
                      stop_token_ids=[7, 8], stop=["\n", "END"], ignore_eos=True, max_tokens=6)
    got = proto_mapping.generation_request(req, CFG, encode, MODEL)
    assert got.prompt_ids == encode("ab c") and len(got.prompt_ids) == 3
    assert got.sampling == SamplingParams(temperature=pytest.approx(0.7), top_p=pytest.approx(0.9), top_k=5, seed=11)
    assert got.stop_token_ids == frozenset({7, 8}) and got.stop_strings == ("\n", "END")
    assert got.eos_token_id is None and got.max_tokens == 6  # ignore_eos: never stop at EOS


def test_generation_request_carries_the_logit_rules():
    req = gen_request(min_tokens=2, presence_penalty=0.5, frequency_penalty=-1.0, repetition_penalty=1.25,
                      logit_bias={9: -100.0, 4: 2.5})
    got = proto_mapping.generation_request(req, CFG, encode, MODEL)
    assert got.min_tokens == 2
    assert (got.sampling.presence_penalty, got.sampling.frequency_penalty, got.sampling.repetition_penalty,
            got.sampling.logit_bias) == (0.5, -1.0, 1.25, ((4, 2.5), (9, -100.0)))
    plain = proto_mapping.generation_request(gen_request(), CFG, encode, MODEL)
    assert plain.sampling.repetition_penalty == 1.0 and not plain.sampling.adjusts_logits  # unset = off


def test_generation_request_carries_the_resumed_tokens():
    got = proto_mapping.generation_request(gen_request(resume_token_ids=[5, 6, 7, 8]), CFG, encode, MODEL)
    assert got.resumed_ids == (5, 6, 7, 8) and got.prompt_ids == [1, 2, 3] and got.max_tokens == 4
    assert proto_mapping.generation_request(gen_request(), CFG, encode, MODEL).resumed_ids == ()


BAD_GENERATE = [
    (dict(model="other"), "NOT_FOUND", "model"),
    (dict(token_ids=None), "INVALID_ARGUMENT", "prompt"),  # neither prompt nor token_ids
    (dict(prompt=""), "INVALID_ARGUMENT", "prompt"),
    (dict(prompt="   "), "INVALID_ARGUMENT", "prompt"),  # encodes to no tokens
    (dict(token_ids=pb.TokenIds(ids=[])), "INVALID_ARGUMENT", "token_ids"),
    (dict(token_ids=pb.TokenIds(ids=[1, VOCAB])), "INVALID_ARGUMENT", "token_ids"),
    (dict(token_ids=pb.TokenIds(ids=[-1])), "INVALID_ARGUMENT", "token_ids"),
    (dict(token_ids=pb.TokenIds(ids=[1] * (CONTEXT + 1))), "INVALID_ARGUMENT", "token_ids"),
    (dict(prompt="x" * (CONTEXT + 1)), "INVALID_ARGUMENT", "prompt"),
    (dict(max_tokens=0), "INVALID_ARGUMENT", "max_tokens"),
    (dict(max_tokens=-2), "INVALID_ARGUMENT", "max_tokens"),
    (dict(max_tokens=CONTEXT - 2), "INVALID_ARGUMENT", "max_tokens"),  # 3 prompt tokens + 14 > 16
    (dict(resume_token_ids=[1] * 5), "INVALID_ARGUMENT", "resume_token_ids"),  # more than max_tokens (4)
    (dict(resume_token_ids=[2, VOCAB]), "INVALID_ARGUMENT", "resume_token_ids"),
    (dict(temperature=float("nan")), "INVALID_ARGUMENT", "temperature"),
    (dict(temperature=-0.5), "INVALID_ARGUMENT", "temperature"),
    (dict(min_tokens=5), "INVALID_ARGUMENT", "min_tokens"),  # over max_tokens (4)
    (dict(min_tokens=-1), "INVALID_ARGUMENT", "min_tokens"),
    (dict(presence_penalty=2.5), "INVALID_ARGUMENT", "presence_penalty"),
    (dict(frequency_penalty=-3.0), "INVALID_ARGUMENT", "frequency_penalty"),
    (dict(repetition_penalty=0.0), "INVALID_ARGUMENT", "repetition_penalty"),
    (dict(logit_bias={VOCAB: 1.0}), "INVALID_ARGUMENT", "logit_bias"),
    (dict(logit_bias={3: 150.0}), "INVALID_ARGUMENT", "logit_bias"),
    (dict(top_p=0.0), "INVALID_ARGUMENT", "top_p"),
    (dict(top_p=1.5), "INVALID_ARGUMENT", "top_p"),
    (dict(top_k=-1), "INVALID_ARGUMENT", "top_k"),
    (dict(seed=2**63), "INVALID_ARGUMENT", "seed"),
    (dict(stop_token_ids=[3, VOCAB]), "INVALID_ARGUMENT", "stop_token_ids"),
    (dict(stop_token_ids=[-4]), "INVALID_ARGUMENT", "stop_token_ids"),
    (dict(stop=["ok", ""]), "INVALID_ARGUMENT", "stop"),
]


@pytest.mark.parametrize("fields,code,field", BAD_GENERATE)
def test_bad_generate_requests_get_their_code_and_field(fields, code, field):
    if fields.get("token_ids", 0) is None:
        req = pb.GenerateRequest(max_tokens=4)
    else:
        req = gen_request(**fields)
    raises_api_error(code, field, _map, req)


def _map(req: pb.GenerateRequest):
    """generation_request with RequestError mapped the way the Serve deployment maps it (as_api_error)."""
    try:
        return proto_mapping.generation_request(req, CFG, encode, MODEL)
    except RequestError as exc:
        raise proto_mapping.as_api_error(exc) from exc


def test_a_prompt_without_a_tokenizer_names_the_prompt():
    with pytest.raises(RequestError) as err:
        proto_mapping.generation_request(gen_request(prompt="hello"), CFG, no_tokenizer, MODEL)
    assert err.value.field == "prompt" and proto_mapping.as_api_error(err.value).code == "INVALID_ARGUMENT"


# ---- events -> GenerateResponse --------------------------------------------------------------------------------------


def test_token_message():
    msg = proto_mapping.token_message(TokenEvent(token_ids=[4, 5], text="hi"))
    assert msg.HasField("token") and not msg.HasField("done")
    assert list(msg.token.token_ids) == [4, 5] and msg.token.text == "hi"


def test_done_message_carries_usage_and_routing():
    event = DoneEvent(finish_reason="eos", prompt_tokens=3, completion_tokens=2,
                      tokens_per_expert={0: [1, 0, 3, 6], 1: [2, 2, 2, 4]}, rerouted=5, dropped=1, degraded=2)
    msg = proto_mapping.done_message(event)
    assert msg.HasField("done") and not msg.HasField("token")
    done = msg.done
    assert done.finish_reason == "eos"
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (3, 2)
    assert {r.layer: list(r.tokens_per_expert) for r in done.routing.layers} == event.tokens_per_expert
    assert (done.routing.rerouted_tokens, done.routing.dropped_tokens, done.routing.degraded_tokens) == (5, 1, 2)
    assert pb.GenerateResponse.FromString(msg.SerializeToString()) == msg


# ---- ScoreRequest / ScoreResponse ------------------------------------------------------------------------------------


def test_score_ids():
    assert proto_mapping.score_ids(pb.ScoreRequest(token_ids=[0, 9, VOCAB - 1]), CFG, MODEL) == [0, 9, VOCAB - 1]
    assert proto_mapping.score_ids(pb.ScoreRequest(token_ids=[1], model=MODEL), CFG, MODEL) == [1]
    raises_api_error("NOT_FOUND", "model", proto_mapping.score_ids, pb.ScoreRequest(token_ids=[1], model="x"), CFG,
                     MODEL)
    for ids in ([], [VOCAB], [1] * (CONTEXT + 1)):
        with pytest.raises(RequestError) as err:
            proto_mapping.score_ids(pb.ScoreRequest(token_ids=ids), CFG, MODEL)
        assert err.value.field == "token_ids" and proto_mapping.as_api_error(err.value).code == "INVALID_ARGUMENT"


def test_score_message_logits_and_log_probs():
    logits = torch.tensor([[0.0, 1.0, 2.0], [3.0, -1.0, 0.5]])  # [S=2, V=3]
    raw = proto_mapping.score_message(logits, log_probs=False)
    assert (raw.seq_len, raw.vocab_size) == (2, 3)
    assert list(raw.values) == pytest.approx(logits.reshape(-1).tolist())  # row-major: position, then vocab
    logp = proto_mapping.score_message(logits, log_probs=True)
    got = torch.tensor(list(logp.values)).reshape(2, 3)
    torch.testing.assert_close(got, torch.log_softmax(logits, -1))
    assert torch.allclose(got.exp().sum(-1), torch.ones(2))


# ---- KServe v2 -------------------------------------------------------------------------------------------------------


def test_model_metadata():
    meta = proto_mapping.model_metadata(MODEL, CFG)
    assert meta.name == MODEL and list(meta.versions) == ["1"] and meta.platform == "expertmesh"
    (inp,), (out,) = meta.inputs, meta.outputs
    assert (inp.name, inp.datatype, list(inp.shape)) == ("input_ids", "INT64", [-1, -1])
    assert (out.name, out.datatype, list(out.shape)) == ("logits", "FP32", [-1, -1, VOCAB])


def infer_request(ids: np.ndarray | None = None, raw: bool = False, **fields) -> kpb.ModelInferRequest:
    ids = np.array([[1, 2, 3], [4, 5, 6]], dtype=np.int64) if ids is None else ids
    req = kpb.ModelInferRequest(model_name=fields.pop("model_name", MODEL), **fields)
    tensor = req.inputs.add(name="input_ids", datatype="INT64", shape=list(ids.shape))
    if raw:
        req.raw_input_contents.append(ids.astype("<i8").tobytes())
    else:
        tensor.contents.int64_contents.extend(ids.reshape(-1).tolist())
    return req


@pytest.mark.parametrize("raw", [False, True])
def test_infer_input_from_contents_or_raw_bytes(raw):
    ids = np.array([[1, 2, 3], [4, 5, VOCAB - 1]], dtype=np.int64)
    req = infer_request(ids, raw=raw, model_version="1")
    req.outputs.add(name="logits")
    got = proto_mapping.infer_input(req, CFG, MODEL)
    assert got.dtype == np.int64 and np.array_equal(got, ids)
    assert np.array_equal(proto_mapping.infer_input(infer_request(ids, raw=raw, model_name=""), CFG, MODEL), ids)


def _bad_infer(change) -> kpb.ModelInferRequest:
    req = infer_request()
    change(req)
    return req


BAD_INFER = [
    (lambda r: setattr(r, "model_name", "other"), "NOT_FOUND", "model_name"),
    (lambda r: setattr(r, "model_version", "2"), "NOT_FOUND", "model_version"),
    (lambda r: r.inputs.add(name="extra", datatype="INT64", shape=[1, 1]), "INVALID_ARGUMENT", "inputs"),
    (lambda r: setattr(r.inputs[0], "name", "tokens"), "INVALID_ARGUMENT", "inputs"),
    (lambda r: setattr(r.inputs[0], "datatype", "INT32"), "INVALID_ARGUMENT", "inputs[input_ids].datatype"),
    (lambda r: r.inputs[0].shape.__delitem__(0), "INVALID_ARGUMENT", "inputs[input_ids].shape"),  # rank 1
    (lambda r: r.inputs[0].shape.__setitem__(1, 0), "INVALID_ARGUMENT", "inputs[input_ids].shape"),
    (lambda r: r.inputs[0].contents.int64_contents.append(7), "INVALID_ARGUMENT", "inputs[input_ids].contents"),
    (lambda r: r.raw_input_contents.append(b"\0" * 8), "INVALID_ARGUMENT", "raw_input_contents"),
    (lambda r: r.inputs[0].contents.int64_contents.__setitem__(0, VOCAB), "INVALID_ARGUMENT", "input_ids"),
    (lambda r: r.inputs[0].contents.int64_contents.__setitem__(0, -1), "INVALID_ARGUMENT", "input_ids"),
    (lambda r: r.outputs.add(name="probs"), "INVALID_ARGUMENT", "outputs"),
]


@pytest.mark.parametrize("change,code,field", BAD_INFER)
def test_bad_infer_requests_get_their_code_and_field(change, code, field):
    raises_api_error(code, field, proto_mapping.infer_input, _bad_infer(change), CFG, MODEL)


def test_infer_input_refuses_a_sequence_longer_than_the_context():
    ids = np.ones((1, CONTEXT + 1), dtype=np.int64)
    err = raises_api_error("INVALID_ARGUMENT", "inputs[input_ids].shape", proto_mapping.infer_input,
                           infer_request(ids), CFG, MODEL)
    assert str(CONTEXT) in err.message


def test_infer_response_is_raw_little_endian_fp32():
    logits = np.arange(2 * 3 * VOCAB, dtype=np.float32).reshape(2, 3, VOCAB) / 7
    resp = proto_mapping.infer_response(kpb.ModelInferRequest(id="req-9"), MODEL, logits)
    assert (resp.model_name, resp.model_version, resp.id) == (MODEL, "1", "req-9")
    (out,) = resp.outputs
    assert (out.name, out.datatype, list(out.shape)) == ("logits", "FP32", [2, 3, VOCAB])
    back = np.frombuffer(resp.raw_output_contents[0], dtype="<f4").reshape(out.shape)
    assert np.array_equal(back, logits)
    with pytest.raises(AssertionError):
        proto_mapping.infer_response(kpb.ModelInferRequest(), MODEL, logits.astype(np.float64))  # only float32 goes out


# ---- hostile input: sizes, echoes, ambiguous data ------------------------------------------------------------------


def test_raw_bytes_of_the_wrong_size_name_raw_input_contents():
    req = infer_request(raw=True)
    req.raw_input_contents[0] += b"\0" * 8
    err = raises_api_error("INVALID_ARGUMENT", "raw_input_contents", proto_mapping.infer_input, req, CFG, MODEL)
    assert "56 bytes" in err.message


def test_data_in_both_raw_input_contents_and_contents_is_refused():
    """KServe v2: an input's data is in raw_input_contents or in its contents; given both, neither silently wins."""
    req = infer_request(raw=True)
    req.inputs[0].contents.int64_contents.extend([7] * 6)  # the same shape's worth, different values
    err = raises_api_error("INVALID_ARGUMENT", "raw_input_contents", proto_mapping.infer_input, req, CFG, MODEL)
    assert "inputs[input_ids].contents" in err.message and "not both" in err.message


def test_shown_caps_an_echoed_value():
    assert proto_mapping.shown("tiny") == "'tiny'"
    long = "é" * 100_000
    got = proto_mapping.shown(long)
    assert got == repr("é" * proto_mapping.ECHO_CHARS) + "…(200000 bytes)"
    assert proto_mapping.shown(b"\0" * 1000).endswith("…(1000 bytes)")


def test_errors_echo_at_most_a_capped_part_of_a_huge_value():
    huge = "m" * (1 << 20)  # a 1 MB model name, echoed whole, overflowed gRPC's 16 KiB trailer
    for call in (lambda: proto_mapping.check_model_name(huge, MODEL),
                 lambda: proto_mapping.infer_input(_bad_infer(lambda r: setattr(r, "model_name", huge)), CFG, MODEL),
                 lambda: proto_mapping.infer_input(_bad_infer(lambda r: setattr(r.inputs[0], "name", huge)), CFG,
                                                   MODEL),
                 lambda: proto_mapping.infer_input(_bad_infer(lambda r: setattr(r.inputs[0], "datatype", huge)), CFG,
                                                   MODEL),
                 lambda: proto_mapping.infer_input(_bad_infer(lambda r: r.outputs.add(name=huge)), CFG, MODEL)):
        with pytest.raises(proto_mapping.ApiError) as err:
            call()
        assert len(err.value.message) < 300 and f"({1 << 20} bytes)" in err.value.message, err.value.message[:300]


def test_a_prompt_too_large_for_the_context_is_refused_before_tokenizing():
    calls = []

    def counting_encode(text: str) -> list[int]:
        calls.append(len(text))
        return encode(text)

    limit = CONTEXT * proto_mapping.PROMPT_BYTES_PER_TOKEN
    fits = proto_mapping.generation_request(gen_request(prompt="a" + " " * (limit - 1)), CFG, counting_encode, MODEL)
    assert fits.prompt_ids == encode("a") and calls == [limit]  # at the bound: tokenized (one token)
    for prompt in ("a" * (limit + 1), "é" * (limit // 2 + 1), "x" * 4_000_000):  # bytes, not characters, count
        err = raises_api_error("INVALID_ARGUMENT", "prompt", proto_mapping.generation_request,
                               gen_request(prompt=prompt), CFG, counting_encode, MODEL)
        assert str(limit) in err.message and str(CONTEXT) in err.message
    assert calls == [limit]  # none of the refused prompts was tokenized


def test_logits_over_the_response_limit_are_refused_naming_the_limit():
    proto_mapping.check_logits_fit(2, 8, VOCAB, 2 * 8 * VOCAB * 4, "token_ids")  # exactly at the limit: fine
    err = raises_api_error("RESOURCE_EXHAUSTED", "token_ids", proto_mapping.check_logits_fit, 2, 8, VOCAB,
                           2 * 8 * VOCAB * 4 - 1, "token_ids")
    assert str(2 * 8 * VOCAB * 4 - 1) in err.message and "server.max_message_bytes" in err.message
