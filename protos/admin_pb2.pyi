from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class RouterStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RouterStats(_message.Message):
    __slots__ = ("live_kv_caches", "active_sequences", "waiting_requests", "steps", "max_batch_seen", "replica")
    LIVE_KV_CACHES_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SEEN_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    live_kv_caches: int
    active_sequences: int
    waiting_requests: int
    steps: int
    max_batch_seen: int
    replica: str
    def __init__(self, live_kv_caches: _Optional[int] = ..., active_sequences: _Optional[int] = ..., waiting_requests: _Optional[int] = ..., steps: _Optional[int] = ..., max_batch_seen: _Optional[int] = ..., replica: _Optional[str] = ...) -> None: ...
