from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "token_ids", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "stop", "ignore_eos", "model", "resume_token_ids", "min_tokens", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    RESUME_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    token_ids: TokenIds
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    stop: _containers.RepeatedScalarFieldContainer[str]
    ignore_eos: bool
    model: str
    resume_token_ids: _containers.RepeatedScalarFieldContainer[int]
    min_tokens: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    def __init__(self, prompt: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., stop: _Optional[_Iterable[str]] = ..., ignore_eos: _Optional[bool] = ..., model: _Optional[str] = ..., resume_token_ids: _Optional[_Iterable[int]] = ..., min_tokens: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ...) -> None: ...

class TokenChunk(_message.Message):
    __slots__ = ("token_ids", "text")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class LayerRouting(_message.Message):
    __slots__ = ("layer", "tokens_per_expert")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_EXPERT_FIELD_NUMBER: _ClassVar[int]
    layer: int
    tokens_per_expert: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, layer: _Optional[int] = ..., tokens_per_expert: _Optional[_Iterable[int]] = ...) -> None: ...

class RoutingSummary(_message.Message):
    __slots__ = ("layers", "rerouted_tokens", "degraded_tokens", "dropped_tokens", "shed_tokens")
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    REROUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    layers: _containers.RepeatedCompositeFieldContainer[LayerRouting]
    rerouted_tokens: int
    degraded_tokens: int
    dropped_tokens: int
    shed_tokens: int
    def __init__(self, layers: _Optional[_Iterable[_Union[LayerRouting, _Mapping]]] = ..., rerouted_tokens: _Optional[int] = ..., degraded_tokens: _Optional[int] = ..., dropped_tokens: _Optional[int] = ..., shed_tokens: _Optional[int] = ...) -> None: ...

class GenerationDone(_message.Message):
    __slots__ = ("finish_reason", "usage", "routing")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    ROUTING_FIELD_NUMBER: _ClassVar[int]
    finish_reason: str
    usage: Usage
    routing: RoutingSummary
    def __init__(self, finish_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., routing: _Optional[_Union[RoutingSummary, _Mapping]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("token", "done")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    token: TokenChunk
    done: GenerationDone
    def __init__(self, token: _Optional[_Union[TokenChunk, _Mapping]] = ..., done: _Optional[_Union[GenerationDone, _Mapping]] = ...) -> None: ...

class ScoreRequest(_message.Message):
    __slots__ = ("token_ids", "log_probs", "model")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOG_PROBS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    log_probs: bool
    model: str
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., log_probs: _Optional[bool] = ..., model: _Optional[str] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("seq_len", "vocab_size", "values")
    SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    seq_len: int
    vocab_size: int
    values: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, seq_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., values: _Optional[_Iterable[float]] = ...) -> None: ...
