"""A checkpoint reader over a Hugging Face Hub repo at one commit that downloads only the tensors it reads.

The small files (config.json, tokenizer files, the safetensors index) are whole files in the node's Hub cache
snapshot (experts/model_source.py fetches them with hf_hub_download). Tensors are fetched when they are read —
`read_many` a whole tensor, `read_rows` rows of a stacked one — by range requests into the node's piece cache
(experts/hub_fetch.py), and read back from there with `safe_open` like any checkpoint file. `check_shapes` and
`nbytes` need headers only. So whatever the process — the driver checking shapes, the router loading the dense
weights, an expert actor loading its shards — its download is the bytes it reads, plus headers.

A `.safetensors` file that is whole in the snapshot (a cache someone pre-populated, e.g. for HF_HUB_OFFLINE=1) is
read in place, as from a folder.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from tqdm import tqdm

from .checkpoint import INDEX_FILE, CheckpointReader, _opened, _tensor
from .errors import CheckpointError
from .hub_fetch import HubRanges, offline
from .hub_ranges import TensorEntry

SINGLE_FILE = "model.safetensors"
HEADER_THREADS = 16  # header reads in flight: two small requests per file, bound by latency (DeepSeek-V3: 163 files)


class HubCheckpointReader(CheckpointReader):
    """CheckpointReader's surface over a Hub repo at one commit: tensors fetched by ranges when read."""

    def __init__(self, snapshot: Path, repo_id: str, commit: str, ranges: HubRanges | None = None,
                 where: str | None = None):
        """snapshot: the Hub cache's snapshot folder of `commit` (config.json in it, the index when the repo is
        sharded); ranges: where pieces come from and are cached (default: this node's cache); where: how errors
        name the repo (default repo@commit)."""
        self.repo_id = repo_id
        self.commit = commit
        self.ranges = ranges if ranges is not None else HubRanges(repo_id, commit, where=where)
        self._pieces: dict[str, Path] = {}  # whole tensors fetched by this reader -> their cached piece file
        self._whole: dict[Path, bool] = {}  # snapshot file -> whether it is there whole (read in place)
        super().__init__(snapshot, partial=True)

    def _index(self) -> dict[str, Path]:
        if (self.model_dir / INDEX_FILE).is_file() or (self.model_dir / SINGLE_FILE).is_file():
            return super()._index()
        # One unsharded file, not downloaded: its tensor names are its header's.
        return {key: self.model_dir / SINGLE_FILE for key in self.ranges.header(SINGLE_FILE)}

    # ---- where a tensor is -------------------------------------------------------------------------------------

    def remote_file(self, key: str) -> str | None:
        """The repo file holding `key` when it is read by ranges; None when the file is whole in the snapshot."""
        path = self.file_of(key)
        whole = self._whole.get(path)
        if whole is None:
            whole = self._whole[path] = path.is_file()
        return None if whole else path.relative_to(self.model_dir).as_posix()

    def entry(self, key: str) -> TensorEntry:
        """dtype, shape and byte range of a tensor read by ranges (its file's header)."""
        filename = self.remote_file(key)
        assert filename is not None, key
        entries = self.ranges.header(filename)
        if key not in entries:
            raise CheckpointError(f"{self.ranges.where}: {filename}: tensor '{key}' is missing (the index names it)")
        return entries[key]

    def prepare(self, keys: Iterable[str]) -> None:
        """Fetch (in parallel) the headers of the remote files holding `keys`, so an unreadable or uncached file
        fails now, in one line naming it."""
        files = sorted({f for key in keys if (f := self.remote_file(key)) is not None})
        if len(files) <= 1:
            for filename in files:
                self.ranges.header(filename)
            return
        with ThreadPoolExecutor(max_workers=min(HEADER_THREADS, len(files))) as pool:
            for done in [pool.submit(self.ranges.header, filename) for filename in files]:
                done.result()

    def _split(self, keys: Iterable[str]) -> tuple[list[str], dict[str, list[str]]]:
        """(keys in whole local files, {remote file: keys})."""
        local, remote = [], {}
        for key in keys:
            filename = self.remote_file(key)
            if filename is None:
                local.append(key)
            else:
                remote.setdefault(filename, []).append(key)
        return local, remote

    # ---- reads -------------------------------------------------------------------------------------------------

    def _read_path(self, key: str) -> Path:
        return self._pieces.get(key) or self.file_of(key)

    def read_many(self, wanted: dict[str, tuple[int, ...] | None], progress: str | None = None, on_bytes=None,
                  device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
        """As CheckpointReader.read_many, after fetching the tensors this node's cache lacks (each read from its
        piece file; shapes are checked against the header before any byte is fetched)."""
        _, remote = self._split(k for k in wanted if k not in self._pieces)
        if remote:
            self.prepare(k for keys in remote.values() for k in keys)
            self.check_shapes({k: wanted[k] for keys in remote.values() for k in keys if wanted[k] is not None})
            got = self.ranges.fetch({filename: [(key, None) for key in keys] for filename, keys in remote.items()})
            for (_, (key, _)), path in got.items():
                self._pieces[key] = path
        return super().read_many(wanted, progress=progress, on_bytes=on_bytes, device=device)

    def read_rows(self, wanted: dict[str, tuple[tuple[int, ...], list[int]]], progress: str | None = None
                  ) -> dict[tuple[str, int], torch.Tensor]:
        """As CheckpointReader.read_rows: only the requested rows are fetched (one piece per row)."""
        local, remote = self._split(wanted)
        out = super().read_rows({k: wanted[k] for k in local}, progress=progress) if local else {}
        if not remote:
            return out
        self.prepare(k for keys in remote.values() for k in keys)
        self.check_shapes({k: wanted[k][0] for keys in remote.values() for k in keys})
        for key in (k for keys in remote.values() for k in keys):
            bad = [row for row in wanted[key][1] if not 0 <= row < self.entry(key).shape[0]]
            if bad:
                raise CheckpointError(f"{self.ranges.where}: tensor '{key}' has no row {bad[0]}")
        got = self.ranges.fetch({filename: [(key, row) for key in keys for row in wanted[key][1]]
                                 for filename, keys in remote.items()})
        bar = tqdm(total=len(got), desc=progress or "loading weights", unit="slice",
                   disable=progress is None or not sys.stderr.isatty(), leave=False)
        with bar:
            for (_, (key, row)), path in got.items():
                with _opened(path) as handle:
                    out[(key, row)] = _tensor(handle, path, key)
                bar.update(1)
        return out

    # ---- headers only ------------------------------------------------------------------------------------------

    def check_shapes(self, wanted: dict[str, tuple[int, ...]]) -> None:
        local, remote = self._split(wanted)
        super().check_shapes({k: wanted[k] for k in local})
        self.prepare(k for keys in remote.values() for k in keys if self._header_reachable(self.remote_file(k)))
        for filename, keys in remote.items():
            if not self._header_reachable(filename):
                continue  # offline and not cached here: as for a partial folder, its reader checks it
            for key in keys:
                shape = self.entry(key).shape
                if shape != tuple(wanted[key]):
                    raise CheckpointError(f"{self.ranges.where}: {filename}: tensor '{key}' has shape {shape}, "
                                          f"expected {tuple(wanted[key])} from config.json")

    def nbytes(self, keys: Iterable[str]) -> int:
        local, remote = self._split(keys)
        total = super().nbytes(local)
        self.prepare(k for ks in remote.values() for k in ks if self._header_reachable(self.remote_file(k)))
        for filename, names in remote.items():
            if self._header_reachable(filename):  # else counts 0, as a file a partial folder lacks
                total += sum(self.entry(key).nbytes for key in names)
        return total

    def header_bytes(self) -> int:
        files = {path.relative_to(self.model_dir).as_posix() for path in self._where.values() if not path.is_file()}
        self.prepare(key for key in self.keys() if self.remote_file(key) in files)
        return super().header_bytes() + sum(self.ranges.header_bytes(f) for f in files
                                            if self._header_reachable(f))

    def _header_reachable(self, filename: str | None) -> bool:
        return filename is not None and (not offline() or (self.ranges.file_dir(filename) / ".header").is_file())
