"""Between protobuf messages and the router's own types: validation that names the field, and status codes.

Pure (no Ray, no Serve); the Serve deployment and the gRPC front both use it, and unit tests cover it directly.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ..experts.config import MoEModelConfig
from ..protos import inference_pb2 as pb
from ..protos import kserve_v2_pb2 as kpb
from .batching import DoneEvent, GenerationRequest, TokenEvent
from .errors import RequestError, check_budget, check_token_ids
from .sampling import SamplingParams


class ApiError(Exception):
    """An error with a gRPC status code name (INVALID_ARGUMENT, NOT_FOUND, ...) and a message for the client."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message

    def __reduce__(self):  # keep code and message when Ray pickles the error across processes
        return (ApiError, (self.code, self.message))


def invalid(field: str, message: str) -> ApiError:
    return ApiError("INVALID_ARGUMENT", f"{field}: {message}")


ECHO_CHARS = 64  # the most of a caller's value an error message repeats


def shown(value: str | bytes, limit: int = ECHO_CHARS) -> str:
    """A caller's value as an error message may show it: its repr, cut to `limit` characters with its full size.

    Why: an error echoes what was sent, and gRPC carries the message in a trailer (16 KiB at most by default); a
    1 MB model name echoed whole turned NOT_FOUND into a RESOURCE_EXHAUSTED about metadata size.
    """
    if len(value) <= limit:
        return repr(value)
    size = len(value.encode("utf-8", "replace")) if isinstance(value, str) else len(value)
    return f"{value[:limit]!r}…({size} bytes)"


def as_api_error(exc: BaseException) -> ApiError | None:
    """The ApiError a known failure maps to, or None for an unexpected one."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, RequestError):
        return ApiError("INVALID_ARGUMENT", str(exc))
    return None


def check_model_name(requested: str, served: str, field: str = "model") -> None:
    if requested and requested != served:
        raise ApiError("NOT_FOUND", f"{field}: unknown model {shown(requested)}; this server serves {served!r}")


# A prompt longer than this many bytes per token of the context cannot fit it: natural text and code run at 2-5
# bytes per token, and the longest tokens of common vocabularies (runs of spaces) are under 64 bytes. Checked
# before tokenizing, so a multi-megabyte prompt is refused in microseconds instead of being tokenized in full.
PROMPT_BYTES_PER_TOKEN = 64


def check_prompt_size(prompt: str, context: int) -> None:
    """Refuse a prompt that cannot fit `context` tokens, from its size alone (no tokenizing)."""
    limit = context * PROMPT_BYTES_PER_TOKEN
    # Characters are a lower bound of the UTF-8 size: the common huge prompt is refused without encoding it.
    size = len(prompt) if len(prompt) > limit else len(prompt.encode("utf-8", "replace"))
    if size > limit:
        raise invalid("prompt", f"{size} bytes cannot fit the model's context of {context} tokens (at most {limit} "
                                f"bytes, {PROMPT_BYTES_PER_TOKEN} per token); shorten it or send token_ids")


def generation_request(
    req: pb.GenerateRequest, cfg: MoEModelConfig, encode, model_name: str
) -> GenerationRequest:
    """Validate a GenerateRequest against the served model; every error names the field."""
    check_model_name(req.model, model_name)
    which = req.WhichOneof("input")
    if which is None:
        raise invalid("prompt", "give prompt or token_ids")
    if which == "prompt":
        if not req.prompt:
            raise invalid("prompt", "must not be empty")
        check_prompt_size(req.prompt, cfg.max_position_embeddings)
        ids = encode(req.prompt)  # RequestError("prompt", ...) without a tokenizer
        if not ids:
            raise invalid("prompt", "encodes to no tokens")
        field = "prompt"
    else:
        ids = list(req.token_ids.ids)
        field = "token_ids"
    check_token_ids(ids, cfg.vocab_size, cfg.max_position_embeddings, field)
    check_budget(len(ids), req.max_tokens, cfg.max_position_embeddings)
    sampling = SamplingParams(
        temperature=req.temperature,
        top_p=req.top_p if req.HasField("top_p") else 1.0,
        top_k=req.top_k,
        seed=req.seed if req.HasField("seed") else None,
        presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty if req.HasField("repetition_penalty") else 1.0,
        logit_bias=tuple(sorted(req.logit_bias.items())),
    ).validate(vocab_size=cfg.vocab_size)
    if not 0 <= req.min_tokens <= req.max_tokens:
        raise invalid("min_tokens", f"must be in [0, max_tokens ({req.max_tokens})], got {req.min_tokens}")
    bad_stop = [t for t in req.stop_token_ids if not 0 <= t < cfg.vocab_size]
    if bad_stop:
        raise invalid("stop_token_ids", f"token id {bad_stop[0]} is outside the vocabulary")
    if any(s == "" for s in req.stop):
        raise invalid("stop", "stop strings must not be empty")
    resumed = list(req.resume_token_ids)
    if len(resumed) > req.max_tokens:
        raise invalid("resume_token_ids", f"{len(resumed)} tokens already streamed exceed max_tokens "
                                          f"({req.max_tokens})")
    bad_resumed = [t for t in resumed if not 0 <= t < cfg.vocab_size]
    if bad_resumed:
        raise invalid("resume_token_ids", f"token id {bad_resumed[0]} is outside the vocabulary")
    return GenerationRequest(
        prompt_ids=ids, max_tokens=req.max_tokens, sampling=sampling,
        stop_token_ids=frozenset(req.stop_token_ids), stop_strings=tuple(req.stop),
        eos_token_id=None if req.ignore_eos else cfg.eos_token_id, resumed_ids=tuple(resumed),
        min_tokens=req.min_tokens,
    )


def token_message(event: TokenEvent) -> pb.GenerateResponse:
    return pb.GenerateResponse(token=pb.TokenChunk(token_ids=event.token_ids, text=event.text))


def done_message(event: DoneEvent) -> pb.GenerateResponse:
    routing = pb.RoutingSummary(
        layers=[pb.LayerRouting(layer=layer, tokens_per_expert=counts)
                for layer, counts in event.tokens_per_expert.items()],
        rerouted_tokens=event.rerouted, degraded_tokens=event.degraded, dropped_tokens=event.dropped,
        shed_tokens=event.shed,
    )
    return pb.GenerateResponse(done=pb.GenerationDone(
        finish_reason=event.finish_reason,
        usage=pb.Usage(prompt_tokens=event.prompt_tokens, completion_tokens=event.completion_tokens,
                       cached_tokens=event.cached_tokens),
        routing=routing,
    ))


def score_ids(req: pb.ScoreRequest, cfg: MoEModelConfig, model_name: str) -> list[int]:
    check_model_name(req.model, model_name)
    return check_token_ids(list(req.token_ids), cfg.vocab_size, cfg.max_position_embeddings)


def check_logits_fit(rows: int, seq: int, vocab: int, limit: int, field: str) -> None:
    """Refuse, before computing them, logits that could not be sent: rows × seq × vocab float32 over `limit` bytes.

    RESOURCE_EXHAUSTED naming the limit: the same code gRPC gives a request over the receive limit, and unlike
    UNAVAILABLE it does not invite a retry that can never succeed.
    """
    size = rows * seq * vocab * 4
    if size > limit:
        raise ApiError("RESOURCE_EXHAUSTED", f"{field}: the logits of {rows} × {seq} positions × {vocab} vocabulary "
                                             f"(float32) take {size} bytes, over the server's response limit of "
                                             f"{limit} bytes (server.max_message_bytes); send fewer positions")


def score_message(logits: torch.Tensor, log_probs: bool) -> pb.ScoreResponse:
    values = torch.log_softmax(logits, dim=-1) if log_probs else logits  # [S, V]
    return pb.ScoreResponse(seq_len=values.shape[0], vocab_size=values.shape[1],
                            values=values.reshape(-1).tolist())


# ---- KServe v2 ---------------------------------------------------------------------------------------------------

INPUT_NAME, OUTPUT_NAME = "input_ids", "logits"


def model_metadata(model_name: str, cfg: MoEModelConfig) -> kpb.ModelMetadataResponse:
    tensor = kpb.ModelMetadataResponse.TensorMetadata
    return kpb.ModelMetadataResponse(
        name=model_name, versions=["1"], platform="expertmesh",
        inputs=[tensor(name=INPUT_NAME, datatype="INT64", shape=[-1, -1])],
        outputs=[tensor(name=OUTPUT_NAME, datatype="FP32", shape=[-1, -1, cfg.vocab_size])],
    )


def infer_input(req: kpb.ModelInferRequest, cfg: MoEModelConfig, model_name: str) -> np.ndarray:
    """ModelInferRequest -> input_ids [batch, seq] int64, validated (dtype, shape, range, requested outputs)."""
    check_model_name(req.model_name, model_name, field="model_name")
    if req.model_version not in ("", "1"):
        raise ApiError("NOT_FOUND", f"model_version: {req.model_name or model_name} has only version '1'")
    if len(req.inputs) != 1 or req.inputs[0].name != INPUT_NAME:
        names = ", ".join(shown(t.name) for t in req.inputs[:4]) + (", ..." if len(req.inputs) > 4 else "")
        raise invalid("inputs", f"expected exactly one input named '{INPUT_NAME}', got {len(req.inputs)}: [{names}]")
    tensor = req.inputs[0]
    if tensor.datatype != "INT64":
        raise invalid(f"inputs[{INPUT_NAME}].datatype", f"must be INT64, got {shown(tensor.datatype)}")
    shape = list(tensor.shape)
    if len(shape) != 2 or shape[0] < 1 or shape[1] < 1:
        raise invalid(f"inputs[{INPUT_NAME}].shape", f"must be [batch, seq] with both ≥ 1, got {shape}")
    count = shape[0] * shape[1]
    if req.raw_input_contents and tensor.contents.ListFields():
        # KServe v2: an input's data is in raw_input_contents or in its contents, never both (which would win?).
        raise invalid("raw_input_contents", f"given together with inputs[{INPUT_NAME}].contents; give the input's "
                                            "data in one of them, not both")
    if req.raw_input_contents:
        raw = req.raw_input_contents[0]
        if len(raw) != count * 8:
            raise invalid("raw_input_contents", f"holds {len(raw)} bytes; shape {shape} of INT64 needs {count * 8}")
        ids = np.frombuffer(raw, dtype="<i8").reshape(shape)
    else:
        values = list(tensor.contents.int64_contents)
        if len(values) != count:
            raise invalid(f"inputs[{INPUT_NAME}].contents", f"holds {len(values)} values; shape {shape} needs {count}")
        ids = np.asarray(values, dtype=np.int64).reshape(shape)
    if shape[1] > cfg.max_position_embeddings:
        raise invalid(f"inputs[{INPUT_NAME}].shape", f"seq {shape[1]} exceeds the model's context of "
                                                     f"{cfg.max_position_embeddings}")
    if ids.min() < 0 or ids.max() >= cfg.vocab_size:
        raise invalid(INPUT_NAME, f"token ids must be in [0, {cfg.vocab_size})")
    for out in req.outputs:
        if out.name != OUTPUT_NAME:
            raise invalid("outputs", f"unknown output {shown(out.name)}; this model has '{OUTPUT_NAME}'")
    return ids


def infer_response(req: kpb.ModelInferRequest, model_name: str, logits: np.ndarray) -> kpb.ModelInferResponse:
    """logits [batch, seq, vocab] float32 -> ModelInferResponse with raw little-endian contents."""
    assert logits.dtype == np.float32 and logits.ndim == 3 and math.prod(logits.shape) > 0
    resp = kpb.ModelInferResponse(model_name=model_name, model_version="1", id=req.id)
    resp.outputs.add(name=OUTPUT_NAME, datatype="FP32", shape=list(logits.shape))
    resp.raw_output_contents.append(logits.astype("<f4").tobytes())
    return resp
