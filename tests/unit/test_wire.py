"""Tensors on the wire of the gRPC transport and across Ray (HostTensor): every carried dtype round-trips bit for bit
(bf16 and fp16 included, which numpy cannot hold), decoding is zero-copy, and errors name the problem."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from expertmesh.experts import wire
from expertmesh.experts.arrays import CARRIED_DTYPES, HostTensor, pack, to_tensor
from expertmesh.protos import expert_transport_pb2 as pb
from expertmesh.router_service.config import ConfigError, MeshConfig


def _sample(dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    if dtype is torch.bool:
        return torch.rand(5, 7, generator=gen) > 0.5
    if not dtype.is_floating_point:
        info = torch.iinfo(dtype)
        return torch.randint(info.min, info.max, (5, 7), generator=gen, dtype=torch.int64).to(dtype)
    x = (torch.randn(5, 7, generator=gen) * 100).to(dtype)
    x[0, 0], x[0, 1], x[0, 2] = float("nan"), float("inf"), -0.0  # the bit patterns a cast through float32 could lose
    return x


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and pack(a).bits.tobytes() == pack(b).bits.tobytes()


@pytest.mark.parametrize("name", CARRIED_DTYPES)
def test_round_trip_of_every_dtype_is_bit_exact(name):
    x = _sample(getattr(torch, name))
    msg = pb.Tensor.FromString(wire.encode(x).SerializeToString())  # through real bytes
    assert msg.dtype == name  # the tag is the torch name
    y = wire.decode(msg)
    assert _same_bits(x, y)


@pytest.mark.parametrize("name", ["bfloat16", "float16", "float32"])
def test_host_tensor_views_bytes_without_numpy_floats(name):
    """A HostTensor carries the bytes as integers of the element size; no numpy float (there is no bf16) is made."""
    x = _sample(getattr(torch, name))
    packed = pack(x)
    assert packed.bits.dtype.kind == "i" and packed.bits.dtype.itemsize == x.element_size()
    back = to_tensor(packed)
    assert _same_bits(x, back)
    assert back.data_ptr() == x.data_ptr()  # a view both ways, no copy


def test_non_contiguous_and_empty_tensors():
    x = torch.arange(24, dtype=torch.bfloat16).reshape(4, 6)[:, ::2]  # a strided view
    assert torch.equal(wire.decode(wire.encode(x)), x)
    back = wire.decode(wire.encode(torch.zeros(0, 16, dtype=torch.float16)))
    assert back.shape == (0, 16) and back.dtype == torch.float16


def test_decode_is_a_read_only_view_and_moves_on_request():
    msg = wire.encode(torch.ones(2, 3))
    assert not wire.decode_host(msg).bits.flags.writeable
    y = wire.decode(msg, device="cpu")
    assert torch.equal(y, torch.ones(2, 3))


def test_size_mismatch_unknown_tags_and_wrong_carriers_are_refused():
    msg = wire.encode(torch.ones(2, 3))
    msg.shape[:] = [2, 4]
    with pytest.raises(ValueError, match=r"shape \[2, 4\] needs 32 bytes, got 24"):
        wire.decode(msg)
    for tag in ("<f4", "complex64", ""):  # a numpy tag (the old wire format) is refused by name, not misread
        with pytest.raises(ValueError, match="is not one of"):
            wire.decode(pb.Tensor(dtype=tag, shape=[1], data=b"\0\0\0\0"))
    with pytest.raises(ValueError):
        pack(torch.zeros(2, dtype=torch.complex64))
    with pytest.raises(ValueError, match="travels as"):
        to_tensor(HostTensor("bfloat16", np.zeros(3, np.int32)))


def test_batch_round_trip_with_trace():
    x = torch.arange(12, dtype=torch.bfloat16).reshape(3, 4)
    carrier = {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}
    batch = pb.ExpertBatch.FromString(wire.encode_batch(2, [5, 1], [2, 1], pack(x), carrier).SerializeToString())
    layer, experts, counts, y, trace = wire.decode_batch(batch)
    assert (layer, experts, counts, trace) == (2, [5, 1], [2, 1], carrier)
    assert _same_bits(to_tensor(y), x)
    assert wire.decode_batch(wire.encode_batch(0, [3], [3], pack(x)))[4] is None  # untraced: None, as for Ray calls


def test_prefetch_hints_ride_with_a_batch_and_reach_the_forward():
    x = torch.ones(2, 4)
    seen = {}

    def forward(layer, experts, counts, rows, **extra):
        seen.update(extra, layer=layer)
        return rows

    batch = pb.ExpertBatch.FromString(
        wire.encode_batch(1, [0], [2], pack(x), prefetch=[(2, 5), (2, 7)]).SerializeToString())
    assert wire.decode_prefetch(batch) == [(2, 5), (2, 7)]
    wire.forward_batch(forward, batch)
    assert seen == {"layer": 1, "prefetch": [(2, 5), (2, 7)]}  # no trace key: the batch had none
    seen.clear()
    wire.forward_batch(forward, wire.encode_batch(1, [0], [2], pack(x), {"traceparent": "t"}))
    assert seen == {"layer": 1, "trace": {"traceparent": "t"}}  # no prefetch key: the batch had none


def test_batch_counts_must_cover_the_rows():
    with pytest.raises(ValueError, match="do not cover"):
        wire.encode_batch(0, [1, 2], [1, 1], pack(torch.zeros(3, 4)))


def test_mesh_config_names_a_bad_transport():
    with pytest.raises(ConfigError) as err:
        MeshConfig().replace(**{"router.transport": "carrier-pigeon"}).validate()
    assert err.value.field == "router.transport"
    for name in ("refs", "grpc", "compiled"):
        MeshConfig().replace(**{"router.transport": name}).validate()
