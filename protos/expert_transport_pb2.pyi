from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class ExpertBatch(_message.Message):
    __slots__ = ("layer", "experts", "counts", "x", "trace", "prefetch")
    class TraceEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    LAYER_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    X_FIELD_NUMBER: _ClassVar[int]
    TRACE_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_FIELD_NUMBER: _ClassVar[int]
    layer: int
    experts: _containers.RepeatedScalarFieldContainer[int]
    counts: _containers.RepeatedScalarFieldContainer[int]
    x: Tensor
    trace: _containers.ScalarMap[str, str]
    prefetch: _containers.RepeatedCompositeFieldContainer[ShardId]
    def __init__(self, layer: _Optional[int] = ..., experts: _Optional[_Iterable[int]] = ..., counts: _Optional[_Iterable[int]] = ..., x: _Optional[_Union[Tensor, _Mapping]] = ..., trace: _Optional[_Mapping[str, str]] = ..., prefetch: _Optional[_Iterable[_Union[ShardId, _Mapping]]] = ...) -> None: ...

class ShardId(_message.Message):
    __slots__ = ("layer", "expert")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    EXPERT_FIELD_NUMBER: _ClassVar[int]
    layer: int
    expert: int
    def __init__(self, layer: _Optional[int] = ..., expert: _Optional[int] = ...) -> None: ...

class ExpertOutput(_message.Message):
    __slots__ = ("y", "error")
    Y_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    y: Tensor
    error: str
    def __init__(self, y: _Optional[_Union[Tensor, _Mapping]] = ..., error: _Optional[str] = ...) -> None: ...
