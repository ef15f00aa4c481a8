"""Telling a Hugging Face repo id ("org/name") from a folder, without importing the checkpoint readers.

The configuration checks `model.path` with these before anything starts (router_service/config.py); fetching is
experts/model_source.py's job, which re-exports both names.
"""

from __future__ import annotations

import re
from pathlib import Path

_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*/[A-Za-z0-9_.\-]+$")


def is_repo_id(source: str) -> bool:
    """True for 'org/name' that is not an existing path (a folder named like a repo id wins, as in transformers)."""
    return bool(_REPO_ID.match(source)) and not Path(source).expanduser().exists()


def source_problem(source: str) -> str | None:
    """Why `source` cannot be a checkpoint source (for the configuration's one-line error), or None."""
    if Path(source).expanduser().is_dir() or is_repo_id(source):
        return None
    return f"{source} is neither a folder nor a Hugging Face repo id (org/name)"
