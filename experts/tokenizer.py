"""Text <-> token ids through the checkpoint's own `tokenizer.json` (Hugging Face `tokenizers`)."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer


def load_tokenizer(model_dir: str | Path) -> Tokenizer | None:
    """The folder's tokenizer, or None when the checkpoint ships none (token ids still work)."""
    path = Path(model_dir) / "tokenizer.json"
    return Tokenizer.from_file(str(path)) if path.is_file() else None
