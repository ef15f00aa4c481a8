"""A Hugging Face Hub cache populated from a local checkpoint folder, laid out as huggingface_hub lays it out
(models--org--name/{refs,snapshots}), so the Hub code path runs offline (HF_HUB_OFFLINE=1) in tests."""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Iterable
from pathlib import Path


def populate_hub_cache(cache: Path, repo_id: str, folder: Path, revision: str = "main",
                       only: Iterable[str] | None = None) -> Path:
    """Copy `folder`'s files (or just `only`) into `cache` as revision `revision` of `repo_id`; returns the
    snapshot folder. The commit hash is derived from the repo id and revision, so it is stable across runs."""
    commit = hashlib.sha1(f"{repo_id}@{revision}".encode()).hexdigest()
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    names = set(only) if only is not None else {p.name for p in folder.iterdir() if p.is_file()}
    for name in names:
        shutil.copy(folder / name, snapshot / name)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / revision).write_text(commit)
    return snapshot
