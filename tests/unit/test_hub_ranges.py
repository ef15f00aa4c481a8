"""Range planning for Hub downloads (experts/hub_ranges.py): headers, pieces, merged requests. Pure: no I/O."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save

from expertmesh.experts.hub_ranges import (
    Span,
    TensorEntry,
    header_length,
    parse_header,
    piece_file_header,
    piece_file_name,
    plan_spans,
)


def _file(tensors: dict[str, torch.Tensor]) -> bytes:
    return save(tensors)


def test_header_entries_carry_absolute_offsets_that_slice_the_tensors_bytes():
    tensors = {"b": torch.arange(6, dtype=torch.float32).reshape(2, 3), "a": torch.ones(4, dtype=torch.bfloat16),
               "c": torch.arange(5, dtype=torch.int64)}
    data = _file(tensors)
    n = header_length(data[:8])
    entries = parse_header(data[8:8 + n])
    assert set(entries) == {"a", "b", "c"}
    for name, tensor in tensors.items():
        e = entries[name]
        assert e.shape == tuple(tensor.shape) and e.nbytes == tensor.numel() * tensor.element_size()
        got = torch.frombuffer(bytearray(data[e.start:e.end]), dtype=tensor.dtype).reshape(tensor.shape)
        assert torch.equal(got, tensor)


def test_rows_of_a_stacked_tensor_are_contiguous_ranges():
    e = TensorEntry("F32", (4, 3, 2), start=100, end=100 + 4 * 3 * 2 * 4)
    assert e.piece_range(None) == (100, 196)
    assert [e.piece_range(r) for r in range(4)] == [(100, 124), (124, 148), (148, 172), (172, 196)]
    assert e.piece_shape(2) == (3, 2) and e.piece_shape(None) == (4, 3, 2)
    with pytest.raises(IndexError):
        e.piece_range(4)


def test_bad_headers_are_refused():
    with pytest.raises(ValueError, match="header length"):
        header_length(struct.pack("<Q", 1 << 40))
    with pytest.raises(ValueError, match="not JSON"):
        parse_header(b"{not json")
    with pytest.raises(ValueError, match="bytes for F32"):
        parse_header(json.dumps({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}).encode())
    with pytest.raises(ValueError, match="no valid"):
        parse_header(json.dumps({"x": {"dtype": "F32"}}).encode())
    assert parse_header(json.dumps({"__metadata__": {"format": "pt"}}).encode()) == {}


def test_touching_pieces_share_a_request_and_gaps_split_them():
    ranges = {("w1", None): (100, 200), ("w2", None): (200, 300), ("w3", None): (300, 350),  # one expert's three
              ("other", None): (400, 500), ("rows", 0): (600, 610), ("rows", 1): (610, 620), ("rows", 3): (630, 640)}
    spans = plan_spans(ranges)
    assert [(s.start, s.end) for s in spans] == [(100, 350), (400, 500), (600, 620), (630, 640)]
    assert [p for p, _, _ in spans[0].pieces] == [("w1", None), ("w2", None), ("w3", None)]
    assert sum(s.nbytes for s in spans) == sum(end - start for start, end in ranges.values())  # nothing extra
    # A gap allowance fetches (and drops) the bytes between pieces to save requests.
    assert [(s.start, s.end) for s in plan_spans(ranges, max_gap=50)] == [(100, 500), (600, 640)]
    # A cap on a request's size keeps long runs in several requests.
    assert [(s.start, s.end) for s in plan_spans(ranges, max_span=200)] == [
        (100, 300), (300, 350), (400, 500), (600, 620), (630, 640)]


def test_overlapping_and_empty_pieces():
    spans = plan_spans({("t", None): (0, 100), ("t", 1): (50, 100), ("empty", None): (100, 100)})
    assert spans == [Span(0, 100, ((("t", None), 0, 100), (("t", 1), 50, 100)))]
    assert plan_spans({}) == []


def test_a_piece_file_is_a_one_tensor_safetensors_file(tmp_path):
    stacked = torch.arange(4 * 3 * 2, dtype=torch.float32).reshape(4, 3, 2)
    data = _file({"model.layers.0.mlp.experts.gate_up_proj": stacked})
    name = "model.layers.0.mlp.experts.gate_up_proj"
    entry = parse_header(data[8:8 + header_length(data[:8])])[name]
    for row in (None, 2):
        start, end = entry.piece_range(row)
        head = piece_file_header(name, entry, row)
        assert len(head) % 8 == 0
        path = tmp_path / piece_file_name((name, row))
        path.write_bytes(head + data[start:end])
        with safe_open(str(path), framework="pt") as f:
            got = f.get_tensor(name)
        assert torch.equal(got, stacked if row is None else stacked[row])
    assert piece_file_name(("a/../b", 3)) == "a%2F..%2Fb@3.safetensors"
