"""Tensors on the wire of the internal gRPC transport: a dtype tag, the shape, and the raw bytes in C order.

The tag is the torch dtype name ("float32", "bfloat16", "float16", ...; experts/arrays.py CARRIED_DTYPES), so bf16
and fp16 travel bit-exactly without numpy's dtype system (which has no bfloat16). Bytes are little-endian (every
platform torch builds for). Pure (no Ray, no gRPC channel): encoding copies the tensor's bytes once into the message;
decoding views the message's bytes without copying (read-only, like Ray's object store gives), then moves them to a
device only when asked.
"""

from __future__ import annotations

import numpy as np
import torch

from ..protos import expert_transport_pb2 as pb
from .arrays import HostTensor, bits_dtype, pack, to_tensor


def encode_host(packed: HostTensor) -> pb.Tensor:
    """HostTensor -> Tensor message."""
    return pb.Tensor(dtype=packed.dtype, shape=list(packed.shape), data=packed.bits.tobytes())


def decode_host(tensor: pb.Tensor) -> HostTensor:
    """Tensor message -> HostTensor viewing the message's bytes. Raises ValueError on an unknown dtype tag or a size
    mismatch."""
    bits = bits_dtype(tensor.dtype)  # ValueError naming the tag if we do not carry it
    shape = tuple(int(n) for n in tensor.shape)
    expected = int(np.prod(shape, dtype=np.int64)) * bits.itemsize
    if len(tensor.data) != expected:
        raise ValueError(f"tensor of dtype {tensor.dtype} and shape {list(shape)} needs {expected} bytes, "
                         f"got {len(tensor.data)}")
    return HostTensor(tensor.dtype, np.frombuffer(tensor.data, dtype=bits).reshape(shape))


def encode(tensor: torch.Tensor) -> pb.Tensor:
    """A tensor on any device -> Tensor message (a device tensor is copied to host first)."""
    return encode_host(pack(tensor.detach().to("cpu")))


def decode(tensor: pb.Tensor, device: str | torch.device | None = None) -> torch.Tensor:
    """Tensor message -> tensor: a read-only view of the message's bytes, or a copy on `device` when given."""
    host = to_tensor(decode_host(tensor))
    return host if device is None else host.to(device)


def encode_batch(layer: int, experts: list[int], counts: list[int], x: HostTensor,
                 trace: dict[str, str] | None = None,
                 prefetch: list[tuple[int, int]] | None = None) -> pb.ExpertBatch:
    """prefetch: (layer, expert) shards to load ahead (offload), riding with this call."""
    if sum(counts) != x.shape[0] or len(counts) != len(experts):
        raise ValueError(f"counts {counts} for experts {experts} do not cover x of {x.shape[0]} rows")
    hints = [pb.ShardId(layer=int(lyr), expert=int(e)) for lyr, e in prefetch or ()]
    return pb.ExpertBatch(layer=layer, experts=experts, counts=counts, x=encode_host(x), trace=trace or {},
                          prefetch=hints)


def decode_batch(batch: pb.ExpertBatch) -> tuple[int, list[int], list[int], HostTensor, dict[str, str] | None]:
    """-> (layer, experts, counts, x, trace or None)."""
    return (batch.layer, list(batch.experts), [int(c) for c in batch.counts], decode_host(batch.x),
            dict(batch.trace) or None)


def decode_prefetch(batch: pb.ExpertBatch) -> list[tuple[int, int]] | None:
    """The (layer, expert) prefetch hints riding with a batch, None when there are none."""
    return [(s.layer, s.expert) for s in batch.prefetch] or None


def forward_batch(forward, batch: pb.ExpertBatch) -> HostTensor:
    """Run an actor's forward(layer, experts, counts, x, trace=, prefetch=) on a received batch (what both of the
    actor's transport servers do); trace and prefetch are passed only when the batch has them."""
    layer, experts, counts, x, trace = decode_batch(batch)
    extra = {}
    if trace:
        extra["trace"] = trace
    hints = decode_prefetch(batch)
    if hints:
        extra["prefetch"] = hints
    return forward(layer, experts, counts, x, **extra)
