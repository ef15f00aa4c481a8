"""What a drill sends: its fixed prompts, and the held-out text it scores for perplexity (degrade policy)."""

from __future__ import annotations

import json
import platform
from pathlib import Path

from ..train.corpus import load_held_out

PPL_WINDOW = 256  # tokens per Score call
PPL_TOKENS = 2048  # held-out tokens per perplexity pass
# Fixed prompts (code, like the embedded model's training text); encoded with the checkpoint's tokenizer.
PROMPT_TEXTS = (
    "def parse(self, text):", "import os\nimport sys\n", "class Config(object):\n    def __init__(self",
    "for i in range(len(", "    return self._", "if __name__ == '__main__':\n", "try:\n    import ",
    "    def __repr__(self):\n        return", "from collections import", "with open(path) as f:\n",
    "raise ValueError(", "    @property\n    def", "def test_", "# Copyright", "self.assertEqual(", "while True:\n",
)  # fmt: skip


def model_dir_path(model_dir: str | None) -> Path:
    from ...experts.embedded_model import EMBEDDED_MODEL_DIR

    return Path(model_dir) if model_dir else EMBEDDED_MODEL_DIR


def make_prompts(model_dir: str | None) -> list[list[int]]:
    """The drill's fixed prompts as token ids: PROMPT_TEXTS through the checkpoint's tokenizer, or (no tokenizer)
    short deterministic id sequences within the vocabulary."""
    from ...experts.tokenizer import load_tokenizer

    folder = model_dir_path(model_dir)
    tok = load_tokenizer(folder)
    if tok is not None:
        return [tok.encode(text).ids for text in PROMPT_TEXTS]
    vocab = int(json.loads((folder / "config.json").read_text())["vocab_size"])
    bound = max(2, min(vocab, 256)) - 1
    return [[1 + (7 + 13 * k + 31 * i + (i * k) % 17) % bound for k in range(4 + i % 5)]
            for i in range(len(PROMPT_TEXTS))]


def held_out_chunk(model_dir: str | None, n_tokens: int = PPL_TOKENS) -> tuple[list[int], dict]:
    """The first `n_tokens` (whole windows) of the embedded model's held-out text (ops/train/corpus.py's split, files
    concatenated with <|eos|> between them, as ops/train/train_demo.py builds it), and where they came from."""
    from ...experts.tokenizer import load_tokenizer

    tok = load_tokenizer(model_dir_path(model_dir))
    if tok is None:
        raise ValueError("perplexity: the checkpoint has no tokenizer.json")
    held, root = load_held_out()
    eos = tok.token_to_id("<|eos|>")
    ids: list[int] = []
    for text in held:
        ids.extend(tok.encode(text).ids)
        if eos is not None:
            ids.append(eos)
        if len(ids) >= n_tokens:
            break
    ids = ids[: n_tokens // PPL_WINDOW * PPL_WINDOW]
    return ids, {"source": "expertmesh.ops.train.corpus.load_held_out", "stdlib_path": str(root),
                 "held_out_files": len(held), "tokens": len(ids), "window": PPL_WINDOW,
                 "python": platform.python_version()}


def training_perplexity(model_dir: str | None) -> float | None:
    """The held-out perplexity the checkpoint's training report gives (None: no such report)."""
    try:
        report = json.loads((model_dir_path(model_dir) / "training_report.json").read_text())
        return report["evaluation"]["held_out_perplexity"]
    except Exception:
        return None
