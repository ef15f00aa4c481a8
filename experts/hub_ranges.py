"""Which bytes of a remote `.safetensors` file a process needs, and in how few requests (pure: no I/O, no torch).

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON (`{name: {"dtype", "shape",
"data_offsets": [begin, end]}}`, offsets counted from the end of the header), then the tensors' bytes. So a reader
that knows the header can fetch any tensor, or any rows of a tensor on its first axis (a stacked expert tensor
[E, ...] keeps each expert's rows contiguous), with one HTTP range request, and adjacent tensors with one request
between them.

A *piece* is what a process caches on its node: a whole tensor `(name, None)` or one row of it on axis 0
`(name, row)`. experts/hub_fetch.py fetches pieces through the spans planned here and stores each piece as a
one-tensor safetensors file (`piece_file_bytes` is its header), so reading it back is plain `safe_open`.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from urllib.parse import quote

HEADER_PREFIX_BYTES = 8  # the little-endian u64 length that opens every safetensors file
MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit; a larger value means the bytes are not a safetensors file
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
               "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8, "F8_E8M0": 1}

Piece = tuple[str, int | None]  # (tensor name, row on axis 0; None: the whole tensor)


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a file's header, with absolute byte offsets in the file."""

    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    def piece_range(self, row: int | None) -> tuple[int, int]:
        """[start, end) of the whole tensor (row None) or of one row on axis 0."""
        if row is None:
            return self.start, self.end
        if not self.shape or not 0 <= row < self.shape[0]:
            raise IndexError(f"row {row} of a tensor of shape {self.shape}")
        size = self.nbytes // self.shape[0]
        return self.start + row * size, self.start + (row + 1) * size

    def piece_shape(self, row: int | None) -> tuple[int, ...]:
        return self.shape if row is None else self.shape[1:]


def header_length(prefix: bytes) -> int:
    """N from a file's first 8 bytes; ValueError when they cannot open a safetensors file."""
    if len(prefix) != HEADER_PREFIX_BYTES:
        raise ValueError(f"expected {HEADER_PREFIX_BYTES} bytes, got {len(prefix)}")
    (n,) = struct.unpack("<Q", prefix)
    if not 2 <= n <= MAX_HEADER_BYTES:
        raise ValueError(f"header length {n} is not that of a safetensors file")
    return n


def parse_header(raw: bytes) -> dict[str, TensorEntry]:
    """The header's JSON (the N bytes after the prefix) -> name -> TensorEntry (absolute offsets)."""
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    base = HEADER_PREFIX_BYTES + len(raw)
    out: dict[str, TensorEntry] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = (int(x) for x in info["data_offsets"])
            dtype, shape = str(info["dtype"]), tuple(int(n) for n in info["shape"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"tensor '{name}' has no valid dtype/shape/data_offsets") from None
        if not 0 <= begin <= end:
            raise ValueError(f"tensor '{name}' has data_offsets [{begin}, {end}]")
        if dtype in DTYPE_BYTES and end - begin != math.prod(shape) * DTYPE_BYTES[dtype]:
            raise ValueError(f"tensor '{name}' has {end - begin} bytes for {dtype} {list(shape)}")
        out[name] = TensorEntry(dtype, shape, base + begin, base + end)
    return out


@dataclass(frozen=True)
class Span:
    """One range request: bytes [start, end) of a file and the pieces (with their own ranges) it carries."""

    start: int
    end: int
    pieces: tuple[tuple[Piece, int, int], ...]  # (piece, start, end), ordered by start

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def plan_spans(ranges: dict[Piece, tuple[int, int]], max_gap: int = 0,
               max_span: int | None = None) -> list[Span]:
    """Merge piece ranges into requests: pieces that touch or overlap, or whose gap is at most `max_gap` bytes (the
    gap is fetched and dropped), share a request unless it would exceed `max_span` bytes. Empty pieces get no
    request (their files are written without one)."""
    items = sorted(((start, end, piece) for piece, (start, end) in ranges.items() if end > start),
                   key=lambda item: (item[0], item[1]))
    spans: list[Span] = []
    cur_start = cur_end = -1
    cur: list[tuple[Piece, int, int]] = []
    for start, end, piece in items:
        merged_end = max(cur_end, end)
        if cur and start - cur_end <= max_gap and (max_span is None or merged_end - cur_start <= max_span):
            cur.append((piece, start, end))
            cur_end = merged_end
            continue
        if cur:
            spans.append(Span(cur_start, cur_end, tuple(cur)))
        cur, cur_start, cur_end = [(piece, start, end)], start, end
    if cur:
        spans.append(Span(cur_start, cur_end, tuple(cur)))
    return spans


def piece_file_header(name: str, entry: TensorEntry, row: int | None) -> bytes:
    """The 8-byte length + JSON header of a one-tensor safetensors file holding `name` (or its row), padded with
    spaces to a multiple of 8 so the data starts aligned, as safetensors writes it."""
    start, end = entry.piece_range(row)
    body = json.dumps({name: {"dtype": entry.dtype, "shape": list(entry.piece_shape(row)),
                              "data_offsets": [0, end - start]}}, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)
    return struct.pack("<Q", len(body)) + body


def piece_file_name(piece: Piece) -> str:
    """A piece's cache file name: the tensor name (quoted, so no name escapes its folder) and its row."""
    name, row = piece
    return quote(name, safe="") + ("" if row is None else f"@{row}") + ".safetensors"
