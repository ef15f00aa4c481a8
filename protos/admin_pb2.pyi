from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RouterStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RouterStats(_message.Message):
    __slots__ = ("live_kv_caches", "active_sequences", "waiting_requests", "steps", "max_batch_seen", "replica", "retried_calls", "degraded_slots", "load_json", "dtype", "device", "threads", "preemptions", "kv_blocks_free", "kv_blocks_total", "stage_seconds", "shed_slots", "prefix_query_tokens", "prefix_hit_tokens", "kv_blocks_cached", "expert_shard_calls", "finished_requests", "cuda_graphs", "cuda_graph_buckets", "cuda_graph_replays", "cuda_graph_captures", "cuda_graph_failed_buckets", "prefetch")
    class StageSecondsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    LIVE_KV_CACHES_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SEEN_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    RETRIED_CALLS_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_SLOTS_FIELD_NUMBER: _ClassVar[int]
    LOAD_JSON_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    THREADS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    STAGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SHED_SLOTS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_QUERY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_CACHED_FIELD_NUMBER: _ClassVar[int]
    EXPERT_SHARD_CALLS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    CUDA_GRAPHS_FIELD_NUMBER: _ClassVar[int]
    CUDA_GRAPH_BUCKETS_FIELD_NUMBER: _ClassVar[int]
    CUDA_GRAPH_REPLAYS_FIELD_NUMBER: _ClassVar[int]
    CUDA_GRAPH_CAPTURES_FIELD_NUMBER: _ClassVar[int]
    CUDA_GRAPH_FAILED_BUCKETS_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_FIELD_NUMBER: _ClassVar[int]
    live_kv_caches: int
    active_sequences: int
    waiting_requests: int
    steps: int
    max_batch_seen: int
    replica: str
    retried_calls: int
    degraded_slots: int
    load_json: str
    dtype: str
    device: str
    threads: int
    preemptions: int
    kv_blocks_free: int
    kv_blocks_total: int
    stage_seconds: _containers.ScalarMap[str, float]
    shed_slots: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    kv_blocks_cached: int
    expert_shard_calls: int
    finished_requests: int
    cuda_graphs: str
    cuda_graph_buckets: int
    cuda_graph_replays: int
    cuda_graph_captures: int
    cuda_graph_failed_buckets: int
    prefetch: str
    def __init__(self, live_kv_caches: _Optional[int] = ..., active_sequences: _Optional[int] = ..., waiting_requests: _Optional[int] = ..., steps: _Optional[int] = ..., max_batch_seen: _Optional[int] = ..., replica: _Optional[str] = ..., retried_calls: _Optional[int] = ..., degraded_slots: _Optional[int] = ..., load_json: _Optional[str] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., threads: _Optional[int] = ..., preemptions: _Optional[int] = ..., kv_blocks_free: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., stage_seconds: _Optional[_Mapping[str, float]] = ..., shed_slots: _Optional[int] = ..., prefix_query_tokens: _Optional[int] = ..., prefix_hit_tokens: _Optional[int] = ..., kv_blocks_cached: _Optional[int] = ..., expert_shard_calls: _Optional[int] = ..., finished_requests: _Optional[int] = ..., cuda_graphs: _Optional[str] = ..., cuda_graph_buckets: _Optional[int] = ..., cuda_graph_replays: _Optional[int] = ..., cuda_graph_captures: _Optional[int] = ..., cuda_graph_failed_buckets: _Optional[int] = ..., prefetch: _Optional[str] = ...) -> None: ...

class ClusterStateRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReplicaState(_message.Message):
    __slots__ = ("actor", "expert", "replica", "node_id", "gpu_ids", "device", "alive", "restoring", "generation", "breaker", "calls", "tokens", "drained", "dtype", "load_bytes", "load_total_bytes", "load_error", "tiers_json", "compute_s")
    ACTOR_FIELD_NUMBER: _ClassVar[int]
    EXPERT_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    GPU_IDS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    RESTORING_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    BREAKER_FIELD_NUMBER: _ClassVar[int]
    CALLS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAINED_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    LOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOAD_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOAD_ERROR_FIELD_NUMBER: _ClassVar[int]
    TIERS_JSON_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    actor: str
    expert: int
    replica: int
    node_id: str
    gpu_ids: _containers.RepeatedScalarFieldContainer[str]
    device: str
    alive: bool
    restoring: bool
    generation: int
    breaker: str
    calls: int
    tokens: int
    drained: bool
    dtype: str
    load_bytes: int
    load_total_bytes: int
    load_error: str
    tiers_json: str
    compute_s: float
    def __init__(self, actor: _Optional[str] = ..., expert: _Optional[int] = ..., replica: _Optional[int] = ..., node_id: _Optional[str] = ..., gpu_ids: _Optional[_Iterable[str]] = ..., device: _Optional[str] = ..., alive: _Optional[bool] = ..., restoring: _Optional[bool] = ..., generation: _Optional[int] = ..., breaker: _Optional[str] = ..., calls: _Optional[int] = ..., tokens: _Optional[int] = ..., drained: _Optional[bool] = ..., dtype: _Optional[str] = ..., load_bytes: _Optional[int] = ..., load_total_bytes: _Optional[int] = ..., load_error: _Optional[str] = ..., tiers_json: _Optional[str] = ..., compute_s: _Optional[float] = ...) -> None: ...

class ShardReplicas(_message.Message):
    __slots__ = ("layer", "expert", "replicas")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    EXPERT_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    layer: int
    expert: int
    replicas: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, layer: _Optional[int] = ..., expert: _Optional[int] = ..., replicas: _Optional[_Iterable[str]] = ...) -> None: ...

class ClusterEvent(_message.Message):
    __slots__ = ("time", "kind", "actor", "detail_json")
    TIME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    ACTOR_FIELD_NUMBER: _ClassVar[int]
    DETAIL_JSON_FIELD_NUMBER: _ClassVar[int]
    time: float
    kind: str
    actor: str
    detail_json: str
    def __init__(self, time: _Optional[float] = ..., kind: _Optional[str] = ..., actor: _Optional[str] = ..., detail_json: _Optional[str] = ...) -> None: ...

class ClusterState(_message.Message):
    __slots__ = ("epoch", "controller_alive", "replicas", "shards", "events", "router", "no_replica_policy", "model", "load_json", "control_json", "requested_gpus", "placement_claims")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    CONTROLLER_ALIVE_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    ROUTER_FIELD_NUMBER: _ClassVar[int]
    NO_REPLICA_POLICY_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LOAD_JSON_FIELD_NUMBER: _ClassVar[int]
    CONTROL_JSON_FIELD_NUMBER: _ClassVar[int]
    REQUESTED_GPUS_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_CLAIMS_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    controller_alive: bool
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaState]
    shards: _containers.RepeatedCompositeFieldContainer[ShardReplicas]
    events: _containers.RepeatedCompositeFieldContainer[ClusterEvent]
    router: RouterStats
    no_replica_policy: str
    model: str
    load_json: str
    control_json: str
    requested_gpus: int
    placement_claims: int
    def __init__(self, epoch: _Optional[int] = ..., controller_alive: _Optional[bool] = ..., replicas: _Optional[_Iterable[_Union[ReplicaState, _Mapping]]] = ..., shards: _Optional[_Iterable[_Union[ShardReplicas, _Mapping]]] = ..., events: _Optional[_Iterable[_Union[ClusterEvent, _Mapping]]] = ..., router: _Optional[_Union[RouterStats, _Mapping]] = ..., no_replica_policy: _Optional[str] = ..., model: _Optional[str] = ..., load_json: _Optional[str] = ..., control_json: _Optional[str] = ..., requested_gpus: _Optional[int] = ..., placement_claims: _Optional[int] = ...) -> None: ...

class ReplicaRequest(_message.Message):
    __slots__ = ("actor", "force")
    ACTOR_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    actor: str
    force: bool
    def __init__(self, actor: _Optional[str] = ..., force: _Optional[bool] = ...) -> None: ...

class ReplicaReply(_message.Message):
    __slots__ = ("ok", "message")
    OK_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    message: str
    def __init__(self, ok: _Optional[bool] = ..., message: _Optional[str] = ...) -> None: ...
