"""The embedded model's text corpus and its train / held-out split: the Python standard library's own source.

Shared by ops/train/train_demo.py (which trains on one part and reports perplexity on the other) and the drill (which
scores held-out text under faults), so both read exactly the same held-out files. Imports only the standard
library: the drill needs the split on machines without torch or transformers.
"""

from __future__ import annotations

import sysconfig
import zlib
from collections.abc import Iterator
from pathlib import Path

SKIP_DIRS = {"site-packages", "test", "tests", "idlelib", "lib2to3"}
MAX_FILE_BYTES = 200_000  # a few huge generated tables would otherwise dominate the corpus
SPLIT = "held-out iff zlib.crc32(relative posix path) % 20 == 0"


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_held_out(rel: Path) -> bool:
    # crc32 of the relative path is stable across machines and Python runs (unlike hash()).
    return zlib.crc32(rel.as_posix().encode()) % 20 == 0


def corpus_files(root: Path) -> Iterator[tuple[Path, bool]]:
    """(path, held out?) for every corpus file under `root`, in sorted order."""
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if SKIP_DIRS & set(rel.parts[:-1]) or path.stat().st_size > MAX_FILE_BYTES:
            continue
        yield path, is_held_out(rel)


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def load_corpus() -> tuple[list[str], list[str], Path]:
    """Return (train texts, held-out texts, stdlib root), split by a hash of the path, not by listing order."""
    root = stdlib_root()
    train: list[str] = []
    held_out: list[str] = []
    for path, held in corpus_files(root):
        (held_out if held else train).append(_read(path))
    return train, held_out, root


def load_held_out() -> tuple[list[str], Path]:
    """(held-out texts, stdlib root): the held-out part of load_corpus() without reading the training files."""
    root = stdlib_root()
    return [_read(path) for path, held in corpus_files(root) if held], root
