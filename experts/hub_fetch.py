"""Range reads of a Hub repo's `.safetensors` files, cached per node: a process downloads the bytes of the tensors it
reads and nothing else, however the repo's files mix layers (Mixtral's and Qwen3's published shards hold attention
and experts of several layers each).

Per file, the header first (two range requests: the 8-byte length, then the JSON), then each wanted piece — a whole
tensor or one row of a stacked [E, ...] tensor — through range requests that merge touching pieces
(experts/hub_ranges.py plans them). Requests are `hf_hub_url(repo, file, revision=<commit>)` GETs with a `Range`
header through huggingface_hub's own session (`http_stream_backoff`, `build_hf_headers`), the way its `HfFileSystem`
reads ranges, so `HF_ENDPOINT`, `HF_TOKEN` (gated repos), proxies and the Hub's CDN redirects behave as they do for
`hf_hub_download`. The body is streamed to disk, never held whole in memory.

The node's cache lives beside huggingface_hub's own, keyed by repo, commit, file and piece:

    $HF_HUB_CACHE/models--org--name/tensors/<commit>/<file>/.header               the file's header (JSON bytes)
    $HF_HUB_CACHE/models--org--name/tensors/<commit>/<file>/<tensor>[@row].safetensors

Each piece is a one-tensor safetensors file, written to a temporary name and renamed when complete, so a reader
never sees half a piece and a restarted actor on the node reads it from disk. Concurrent processes on the node
(actors hosting replicas of one shard, an actor and the router reading one file's header) do not fetch a piece
twice: each piece has a lock file; a process claims the pieces it can lock at once, fetches them, and only then
waits on pieces another process holds (never waiting while holding, so two processes cannot deadlock), fetching
any that the other left missing (it died).
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path, PurePosixPath

from .errors import CheckpointError
from .hub_ranges import (
    HEADER_PREFIX_BYTES,
    Piece,
    Span,
    TensorEntry,
    header_length,
    parse_header,
    piece_file_header,
    piece_file_name,
    plan_spans,
)
from .hub_token import download_token

log = logging.getLogger(__name__)
FETCH_THREADS = 4  # range requests in flight per process (a CDN serves each at a per-connection rate)
MAX_GAP_BYTES = 0  # pieces are merged into one request only when they touch: no byte is fetched that is not read
MAX_SPAN_BYTES = 1 << 30  # long runs of touching pieces are split so several requests stream at once
ATTEMPTS = 3  # a range whose stream breaks is fetched again this many times in all
CHUNK_BYTES = 1 << 20
CLAIM_BATCH = 256  # pieces locked (and fetched) at once


def tensor_cache_dir(repo_id: str, commit: str) -> Path:
    """This node's piece cache for `repo_id` at `commit` (under HF_HUB_CACHE, next to the repo's snapshots)."""
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    return Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo_id, repo_type="model") / "tensors" / commit


def offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def not_cached(where: str, filename: str) -> CheckpointError:
    return CheckpointError(f"{where}: {filename} is not in this node's Hugging Face cache and it cannot be "
                           f"downloaded (offline, HF_HUB_OFFLINE=1, or no network)")


def hub_error(exc: BaseException, where: str, filename: str) -> CheckpointError | None:
    """One CheckpointError line for a huggingface_hub error, or None when `exc` is not one."""
    from huggingface_hub.errors import (
        EntryNotFoundError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if isinstance(exc, LocalEntryNotFoundError | OfflineModeIsEnabled):
        return not_cached(where, filename)
    if isinstance(exc, RepositoryNotFoundError):  # GatedRepoError included
        return CheckpointError(f"{where}: no such repository on the Hugging Face Hub (or it is gated: set HF_TOKEN)")
    if isinstance(exc, RevisionNotFoundError):
        return CheckpointError(f"{where}: no such revision")
    if isinstance(exc, EntryNotFoundError):
        return CheckpointError(f"{where}: the repository has no file {filename}")
    if isinstance(exc, HfHubHTTPError):
        return CheckpointError(f"{where}: downloading {filename} failed ({exc})")
    return None


class HubRanges:
    """The `.safetensors` files of one repo at one commit, read by ranges into this node's cache."""

    def __init__(self, repo_id: str, commit: str, root: Path | None = None, threads: int = FETCH_THREADS,
                 where: str | None = None):
        """where: how errors name the repo (default repo@commit; open_checkpoint passes what the user gave)."""
        self.repo_id = repo_id
        self.commit = commit
        self.root = root if root is not None else tensor_cache_dir(repo_id, commit)
        self.threads = threads
        self.where = where or f"{repo_id}@{commit[:12]}"
        self._headers: dict[str, tuple[dict[str, TensorEntry], int]] = {}
        self._mutex = threading.Lock()

    # ---- headers -----------------------------------------------------------------------------------------------

    def header(self, filename: str) -> dict[str, TensorEntry]:
        """name -> TensorEntry of `filename`, from this process, the node's cache, or two range requests."""
        return self._header(filename)[0]

    def header_bytes(self, filename: str) -> int:
        """Bytes of the file before its tensors (prefix + JSON): what reading its header costs."""
        return HEADER_PREFIX_BYTES + self._header(filename)[1]

    def _header(self, filename: str) -> tuple[dict[str, TensorEntry], int]:
        with self._mutex:
            if filename in self._headers:
                return self._headers[filename]
        path = self.file_dir(filename) / ".header"
        if not path.is_file():
            if offline():
                raise not_cached(self.where, filename)
            with _lock(path):
                if not path.is_file():
                    n = header_length(self._read(filename, 0, HEADER_PREFIX_BYTES))
                    _write_atomic(path, self._read(filename, HEADER_PREFIX_BYTES, HEADER_PREFIX_BYTES + n))
        raw = path.read_bytes()
        try:
            parsed = (parse_header(raw), len(raw))
        except ValueError as exc:
            raise CheckpointError(f"{self.where}: {filename} is not a readable safetensors file ({exc})") from None
        with self._mutex:
            self._headers[filename] = parsed
        return parsed

    # ---- pieces ------------------------------------------------------------------------------------------------

    def file_dir(self, filename: str) -> Path:
        parts = PurePosixPath(filename).parts
        if not parts or filename.startswith("/") or ".." in parts:
            raise CheckpointError(f"{self.where}: file name {filename!r} leaves the repository")
        return self.root.joinpath(*parts)

    def piece_path(self, filename: str, piece: Piece) -> Path:
        return self.file_dir(filename) / piece_file_name(piece)

    def fetch(self, wanted: dict[str, Iterable[Piece]]) -> dict[tuple[str, Piece], Path]:
        """{file: pieces} -> {(file, piece): cache path}, fetching what the node's cache lacks."""
        paths = {(filename, piece): self.piece_path(filename, piece)
                 for filename, pieces in wanted.items() for piece in pieces}
        missing = [key for key, path in paths.items() if not path.is_file()]
        if not missing:
            return paths
        if offline():
            raise not_cached(self.where, missing[0][0])
        theirs: list[tuple[str, Piece]] = []
        missing.sort(key=_order)
        for i in range(0, len(missing), CLAIM_BATCH):  # a batch at a time: each held lock is an open file
            held, busy = _claim(missing[i:i + CLAIM_BATCH], paths)
            theirs += busy
            try:
                self._fetch_pieces([key for key in held if not paths[key].is_file()], paths)
            finally:
                for lock in held.values():
                    lock.release()
        for key in theirs:  # another process on this node is fetching these: wait, then fill what it left
            with _lock(paths[key]):
                if not paths[key].is_file():
                    self._fetch_pieces([key], paths)
        return paths

    def _fetch_pieces(self, keys: list[tuple[str, Piece]], paths: dict[tuple[str, Piece], Path]) -> None:
        by_file: dict[str, dict[Piece, tuple[int, int]]] = {}
        for filename, piece in keys:
            entry = self._entry(filename, piece[0])
            start, end = entry.piece_range(piece[1])
            if end == start:  # an empty tensor: its file needs no request
                _write_atomic(paths[(filename, piece)], piece_file_header(piece[0], entry, piece[1]))
                continue
            by_file.setdefault(filename, {})[piece] = (start, end)
        jobs = [(filename, span) for filename, ranges in by_file.items()
                for span in plan_spans(ranges, MAX_GAP_BYTES, MAX_SPAN_BYTES)]
        if not jobs:
            return
        if len(jobs) == 1:
            self._fetch_span(*jobs[0], paths)
            return
        with ThreadPoolExecutor(max_workers=min(self.threads, len(jobs))) as pool:
            for done in [pool.submit(self._fetch_span, filename, span, paths) for filename, span in jobs]:
                done.result()  # the first error, naming its file

    def _entry(self, filename: str, name: str) -> TensorEntry:
        entries = self.header(filename)
        if name not in entries:
            raise CheckpointError(f"{self.where}: tensor '{name}' is not in {filename} (its index says it is)")
        return entries[name]

    def _fetch_span(self, filename: str, span: Span, paths: dict[tuple[str, Piece], Path]) -> None:
        """One range request, streamed into the span's piece files (committed only when every byte arrived)."""
        for attempt in range(1, ATTEMPTS + 1):
            writers = [_PieceWriter(paths[(filename, piece)], piece_file_header(piece[0],
                                    self._entry(filename, piece[0]), piece[1]), start, end)
                       for piece, start, end in span.pieces]
            try:
                pos = span.start
                with self._stream(filename, span.start, span.end) as chunks:
                    for chunk in chunks:
                        for writer in writers:
                            writer.feed(pos, chunk)
                        pos += len(chunk)
                if pos != span.end:
                    raise _Broken(f"{pos - span.start} of {span.nbytes} bytes arrived")
                for writer in writers:
                    writer.commit()
                return
            except CheckpointError:
                raise
            except Exception as exc:  # noqa: BLE001  a broken stream (network), whatever the HTTP library calls it
                if attempt == ATTEMPTS:
                    raise CheckpointError(f"{self.where}: reading bytes {span.start}-{span.end - 1} of {filename} "
                                          f"failed ({type(exc).__name__}: {exc})") from None
                log.warning("%s: bytes %d-%d of %s: %s; trying again", self.where, span.start, span.end - 1,
                            filename, exc)
            finally:
                for writer in writers:
                    writer.discard()

    # ---- HTTP --------------------------------------------------------------------------------------------------

    def _read(self, filename: str, start: int, end: int) -> bytes:
        with self._stream(filename, start, end) as chunks:
            data = b"".join(chunks)
        if len(data) != end - start:
            raise CheckpointError(f"{self.where}: {filename} is shorter than a safetensors header says "
                                  f"({len(data)} of {end - start} bytes at {start})")
        return data

    @contextmanager
    def _stream(self, filename: str, start: int, end: int) -> Iterator[Iterator[bytes]]:
        """Bytes [start, end) of the file as chunks; a server that ignores the Range (200, or another range) is an
        error rather than a whole-file download."""
        from huggingface_hub import constants, hf_hub_url
        from huggingface_hub.utils import build_hf_headers, hf_raise_for_status, http_stream_backoff

        url = hf_hub_url(self.repo_id, filename, revision=self.commit)
        # identity: a compressed body would make the byte counts meaningless; the token as for hf_hub_download: the
        # process's HF_TOKEN, else the one the mesh's driver published (experts/hub_token.py), else the login
        headers = build_hf_headers(library_name="expertmesh", token=download_token(),
                                   headers={"Range": f"bytes={start}-{end - 1}", "Accept-Encoding": "identity"})
        try:
            with http_stream_backoff("GET", url, headers=headers, timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT,
                                     retry_on_status_codes=(429, 500, 502, 503, 504)) as response:
                hf_raise_for_status(response)
                got = response.headers.get("Content-Range", "")
                if response.status_code != 206 or not got.startswith(f"bytes {start}-{end - 1}/"):
                    raise CheckpointError(f"{self.where}: the server did not answer a range request for {filename} "
                                          f"(HTTP {response.status_code}, Content-Range {got!r}); a node fetches only "
                                          f"its tensors' bytes and will not download whole files instead")
                yield response.iter_bytes(chunk_size=CHUNK_BYTES)
        except CheckpointError:
            raise
        except Exception as exc:  # noqa: BLE001
            mapped = hub_error(exc, self.where, filename)
            if mapped is None:
                raise
            raise mapped from None


class _Broken(Exception):
    """A stream that ended early (retried)."""


class _PieceWriter:
    """One piece's cache file, filled from a span's stream: a temporary file renamed into place once complete."""

    def __init__(self, path: Path, header: bytes, start: int, end: int):
        self.path, self.start, self.end = path, start, end
        path.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = path.with_name(f"{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")
        self.file = self.tmp.open("wb")
        self.file.write(header)
        self.written = 0

    def feed(self, pos: int, chunk: bytes) -> None:
        """`chunk` holds file bytes [pos, pos + len): keep the part inside this piece."""
        lo, hi = max(pos, self.start), min(pos + len(chunk), self.end)
        if lo < hi:
            self.file.write(memoryview(chunk)[lo - pos:hi - pos])
            self.written += hi - lo

    def commit(self) -> None:
        if self.written != self.end - self.start:
            raise _Broken(f"{self.path.name}: {self.written} of {self.end - self.start} bytes")
        self.file.close()
        os.replace(self.tmp, self.path)

    def discard(self) -> None:
        if not self.file.closed:
            self.file.close()
        self.tmp.unlink(missing_ok=True)


def _lock(path: Path, timeout: float = -1):
    """The node-wide lock of one cache entry (a file beside it; flock, so it is released when its process dies)."""
    from filelock import FileLock

    path.parent.mkdir(parents=True, exist_ok=True)
    return FileLock(str(path) + ".lock", timeout=timeout)


def _claim(keys: list[tuple[str, Piece]], paths: dict[tuple[str, Piece], Path]):
    """Lock every piece no other process holds now: ({key: held lock}, [keys another process holds])."""
    from filelock import Timeout

    held, theirs = {}, []
    for key in keys:
        lock = _lock(paths[key], timeout=0)
        try:
            lock.acquire()
        except Timeout:
            theirs.append(key)
            continue
        held[key] = lock
    return held, theirs


def _order(key: tuple[str, Piece]) -> tuple[str, str, int]:
    filename, (name, row) = key
    return filename, name, -1 if row is None else row


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
