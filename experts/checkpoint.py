"""Read tensors from a Hugging Face checkpoint folder by their on-disk names.

Only `safetensors` is supported: it lets an expert actor open the files lazily and read exactly the tensors of
the shards it hosts (memory-mapped, one tensor at a time), never the whole file.
"""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from .config import MoEModelConfig, load_model_config
from .errors import CheckpointError
from .hub_ranges import DTYPE_BYTES as _DTYPE_BYTES
from .hub_ranges import HEADER_PREFIX_BYTES, header_length

INDEX_FILE = "model.safetensors.index.json"
READ_THREADS = 4  # files of a sharded checkpoint read at once


@contextmanager
def _opened(path: Path, device: str | torch.device = "cpu") -> Iterator:
    """safe_open whose failures (corrupt header, truncated file) become a CheckpointError naming the file."""
    try:
        with safe_open(str(path), framework="pt", device=str(device)) as handle:
            yield handle
    except SafetensorError as exc:
        raise CheckpointError(f"{path}: not a readable safetensors file ({exc})") from exc


def _tensor(handle, path: Path, key: str, header_only: bool = False):
    try:
        return handle.get_slice(key) if header_only else handle.get_tensor(key)
    except SafetensorError as exc:
        raise CheckpointError(f"{path}: tensor '{key}' cannot be read ({exc})") from exc


class CheckpointReader:
    """Maps tensor names to the `.safetensors` file that holds them, and reads them one by one."""

    commit: str | None = None  # the Hub commit read (experts/hub_reader.py); None for a folder

    def __init__(self, model_dir: str | Path, partial: bool = False):
        """partial: the folder holds only some of the files its index lists (a Hub snapshot fetched for one
        process's tensors, experts/model_source.py); a missing file is an error only when one of its tensors is read.
        """
        self.model_dir = Path(model_dir)
        self.partial = partial
        if not self.model_dir.is_dir():
            raise CheckpointError(f"{self.model_dir}: model folder does not exist")
        self.config: MoEModelConfig = load_model_config(self.model_dir)
        self._where: dict[str, Path] = self._index()

    def _index(self) -> dict[str, Path]:
        index = self.model_dir / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as exc:
                raise CheckpointError(f"{index}: not a valid safetensors index (key 'weight_map')") from exc
            where = {key: self.model_dir / name for key, name in weight_map.items()}
            for path in set(where.values()):
                if not path.is_file() and not self.partial:
                    raise CheckpointError(f"{index}: shard file {path.name} listed in 'weight_map' is missing")
            return where
        files = sorted(self.model_dir.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{self.model_dir}: no *.safetensors files (and no {INDEX_FILE})")
        where: dict[str, Path] = {}
        for path in files:
            with _opened(path) as handle:
                for key in handle.keys():
                    where[key] = path
        return where

    @staticmethod
    def config_only(model_dir: str | Path) -> MoEModelConfig:
        """The model's config from a folder that may hold no weights at all (planning before a download)."""
        return load_model_config(Path(model_dir))

    def has(self, key: str) -> bool:
        return key in self._where

    def file_of(self, key: str) -> Path:
        if key not in self._where:
            files = sorted({p.name for p in self._where.values()})
            raise CheckpointError(f"{self.model_dir}: tensor '{key}' is missing (searched {', '.join(files)})")
        return self._where[key]

    def _read_path(self, key: str) -> Path:
        """The local file read_many opens for `key` (a Hub reader's cached piece; experts/hub_reader.py)."""
        return self.file_of(key)

    def read(self, key: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """One tensor by name; `shape`, when given, is checked so a wrong config fails here, naming file and key."""
        return self.read_many({key: shape})[key]

    def read_many(
        self, wanted: dict[str, tuple[int, ...] | None], progress: str | None = None,
        on_bytes: Callable[[int], None] | None = None, device: str | torch.device = "cpu",
    ) -> dict[str, torch.Tensor]:
        """Tensors by name, grouped per file so each file is opened once, files read in parallel (a few threads:
        a sharded checkpoint on a cloud disk reads faster with several requests in flight), each tensor straight
        onto `device` (safetensors copies from the mapped file to the GPU without a host copy of the whole file).
        on_bytes(n) is called after each tensor (load progress). Shows a progress bar on a terminal."""
        by_file: dict[Path, list[str]] = {}
        for key in wanted:
            by_file.setdefault(self._read_path(key), []).append(key)
        for path, keys in by_file.items():
            if not path.is_file():
                raise CheckpointError(f"{path}: file holding tensor '{keys[0]}' is missing (not fetched here)")
        out: dict[str, torch.Tensor] = {}
        bar = tqdm(
            total=len(wanted), desc=progress or "loading weights", unit="tensor",
            disable=progress is None or not sys.stderr.isatty(), leave=False,
        )
        lock = threading.Lock()

        def read_file(path: Path, keys: list[str]) -> None:
            with _opened(path, device) as handle:
                for key in keys:
                    tensor = _tensor(handle, path, key)
                    expected = wanted[key]
                    if expected is not None and tuple(tensor.shape) != tuple(expected):
                        raise CheckpointError(
                            f"{path}: tensor '{key}' has shape {tuple(tensor.shape)}, "
                            f"expected {tuple(expected)} from config.json"
                        )
                    with lock:
                        out[key] = tensor
                        bar.update(1)
                        if on_bytes is not None:
                            on_bytes(tensor.numel() * tensor.element_size())

        with bar:
            if len(by_file) == 1:
                read_file(*next(iter(by_file.items())))
            else:
                with ThreadPoolExecutor(max_workers=min(READ_THREADS, len(by_file))) as pool:
                    for done in [pool.submit(read_file, path, keys) for path, keys in by_file.items()]:
                        done.result()  # the first error, naming its file and key
        return out

    def read_rows(
        self, wanted: dict[str, tuple[tuple[int, ...], list[int]]], progress: str | None = None
    ) -> dict[tuple[str, int], torch.Tensor]:
        """Rows of stacked tensors: {name: (expected full shape, indices on axis 0)} -> {(name, index): tensor}.

        Only the requested rows are read (`get_slice(name)[i]`, never the whole tensor), so an actor hosting a few
        experts of a fused [E, ...] tensor reads those experts' bytes and nothing else. The full shape is checked
        from the header first, so a wrong config fails here naming the file and key.
        """
        by_file: dict[Path, list[str]] = {}
        for key in wanted:
            by_file.setdefault(self.file_of(key), []).append(key)
        out: dict[tuple[str, int], torch.Tensor] = {}
        bar = tqdm(
            total=sum(len(rows) for _, rows in wanted.values()), desc=progress or "loading weights", unit="slice",
            disable=progress is None or not sys.stderr.isatty(), leave=False,
        )
        with bar:
            for path, keys in by_file.items():
                with _opened(path) as handle:
                    for key in keys:
                        expected, rows = wanted[key]
                        view = _tensor(handle, path, key, header_only=True)
                        shape = tuple(view.get_shape())
                        if shape != tuple(expected):
                            raise CheckpointError(
                                f"{path}: tensor '{key}' has shape {shape}, expected {tuple(expected)} from config.json"
                            )
                        for row in rows:
                            out[(key, row)] = view[row]
                            bar.update(1)
        return out

    def check_shapes(self, wanted: dict[str, tuple[int, ...]]) -> None:
        """Check that every tensor exists with its expected shape, reading headers only (no tensor data).

        The router runs this before it starts any actor, so a bad checkpoint fails in one clear error here
        rather than in many actors.
        """
        by_file: dict[Path, list[str]] = {}
        for key in wanted:
            by_file.setdefault(self.file_of(key), []).append(key)
        for path, keys in by_file.items():
            if self.partial and not path.is_file():
                continue  # not fetched by this process: the name is in the index; its reader checks the shape
            with _opened(path) as handle:
                for key in keys:
                    shape = tuple(_tensor(handle, path, key, header_only=True).get_shape())
                    if shape != tuple(wanted[key]):
                        raise CheckpointError(
                            f"{path}: tensor '{key}' has shape {shape}, expected {tuple(wanted[key])} from config.json"
                        )

    def nbytes(self, keys: Iterable[str]) -> int:
        """Bytes of these tensors as stored (headers only; files this process did not fetch count 0)."""
        by_file: dict[Path, list[str]] = {}
        for key in keys:
            by_file.setdefault(self.file_of(key), []).append(key)
        total = 0
        for path, names in by_file.items():
            if not path.is_file():
                continue
            with _opened(path) as handle:
                for key in names:
                    view = _tensor(handle, path, key, header_only=True)
                    numel = 1
                    for n in view.get_shape():
                        numel *= n
                    total += numel * _DTYPE_BYTES.get(view.get_dtype(), 4)
        return total

    def header_bytes(self) -> int:
        """Bytes of every `.safetensors` file's header (files absent here count 0): what a process that reads only
        headers stores of the weights."""
        total = 0
        for path in set(self._where.values()):
            if path.is_file():
                with path.open("rb") as f:
                    total += HEADER_PREFIX_BYTES + header_length(f.read(HEADER_PREFIX_BYTES))
        return total

    def keys(self) -> Iterable[str]:
        return self._where.keys()
