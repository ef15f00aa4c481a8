"""Tensors on the wire for the internal gRPC transport: raw C-order bytes plus dtype and shape.

Pure (no Ray, no gRPC channel): `encode` copies the array's bytes once into the message; `decode` wraps the
message's bytes without copying (a read-only array, like Ray's object store gives).
"""

from __future__ import annotations

import numpy as np

from ..protos import expert_transport_pb2 as pb


def encode(array: np.ndarray) -> pb.Tensor:
    """array (any shape, a numeric numpy dtype) -> Tensor message."""
    if array.dtype.hasobject:
        raise TypeError(f"cannot send an array of dtype {array.dtype} as raw bytes")
    return pb.Tensor(dtype=array.dtype.str, shape=list(array.shape), data=np.ascontiguousarray(array).tobytes())


def decode(tensor: pb.Tensor) -> np.ndarray:
    """Tensor message -> read-only array viewing the message's bytes. Raises ValueError on a size mismatch."""
    dtype = np.dtype(tensor.dtype)
    shape = tuple(int(n) for n in tensor.shape)
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(tensor.data) != expected:
        raise ValueError(f"tensor of dtype {tensor.dtype} and shape {list(shape)} needs {expected} bytes, "
                         f"got {len(tensor.data)}")
    return np.frombuffer(tensor.data, dtype=dtype).reshape(shape)


def encode_batch(layer: int, experts: list[int], counts: list[int], x: np.ndarray,
                 trace: dict[str, str] | None = None) -> pb.ExpertBatch:
    if sum(counts) != x.shape[0] or len(counts) != len(experts):
        raise ValueError(f"counts {counts} for experts {experts} do not cover x of {x.shape[0]} rows")
    return pb.ExpertBatch(layer=layer, experts=experts, counts=counts, x=encode(x), trace=trace or {})


def decode_batch(batch: pb.ExpertBatch) -> tuple[int, list[int], list[int], np.ndarray, dict[str, str] | None]:
    """-> (layer, experts, counts, x, trace or None)."""
    return (batch.layer, list(batch.experts), [int(c) for c in batch.counts], decode(batch.x),
            dict(batch.trace) or None)
