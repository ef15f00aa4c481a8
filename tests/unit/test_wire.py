"""Tensors on the wire of the gRPC transport: exact round trips, zero-copy decode, and errors that name the problem."""

from __future__ import annotations

import numpy as np
import pytest

from expertmesh.experts import wire
from expertmesh.protos import expert_transport_pb2 as pb
from expertmesh.router_service.config import ConfigError, MeshConfig


@pytest.mark.parametrize("dtype", ["float32", "float16", "float64", "int64", ">f4"])
def test_round_trip_is_bit_exact(dtype):
    x = (np.random.default_rng(0).standard_normal((5, 7)) * 100).astype(dtype)
    x[0, 0] = np.nan if x.dtype.kind == "f" else x[0, 0]
    msg = pb.Tensor.FromString(wire.encode(x).SerializeToString())  # through real bytes
    y = wire.decode(msg)
    assert y.dtype == x.dtype and y.shape == x.shape
    assert x.tobytes() == y.tobytes()


def test_non_contiguous_and_empty_arrays():
    x = np.arange(24, dtype=np.float32).reshape(4, 6)[:, ::2]  # a strided view
    assert np.array_equal(wire.decode(wire.encode(x)), x)
    empty = np.zeros((0, 16), np.float32)
    back = wire.decode(wire.encode(empty))
    assert back.shape == (0, 16) and back.dtype == np.float32


def test_decode_is_a_read_only_view():
    y = wire.decode(wire.encode(np.ones((2, 3), np.float32)))
    assert not y.flags.writeable


def test_size_mismatch_and_object_arrays_are_refused():
    msg = wire.encode(np.ones((2, 3), np.float32))
    msg.shape[:] = [2, 4]
    with pytest.raises(ValueError, match=r"shape \[2, 4\] needs 32 bytes, got 24"):
        wire.decode(msg)
    with pytest.raises(TypeError):
        wire.encode(np.array([object()]))


def test_batch_round_trip_with_trace():
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    carrier = {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}
    batch = pb.ExpertBatch.FromString(wire.encode_batch(2, [5, 1], [2, 1], x, carrier).SerializeToString())
    layer, experts, counts, y, trace = wire.decode_batch(batch)
    assert (layer, experts, counts, trace) == (2, [5, 1], [2, 1], carrier)
    assert np.array_equal(y, x)
    assert wire.decode_batch(wire.encode_batch(0, [3], [3], x))[4] is None  # untraced: None, as for Ray calls


def test_batch_counts_must_cover_the_rows():
    with pytest.raises(ValueError, match="do not cover"):
        wire.encode_batch(0, [1, 2], [1, 1], np.zeros((3, 4), np.float32))


def test_mesh_config_names_a_bad_transport():
    with pytest.raises(ConfigError) as err:
        MeshConfig().replace(**{"router.transport": "carrier-pigeon"}).validate()
    assert err.value.field == "router.transport"
    for name in ("refs", "grpc", "compiled"):
        MeshConfig().replace(**{"router.transport": name}).validate()
