"""Held-out perplexity of a model, one function for every benchmark and drill that needs a quality figure.

The text is the drill's (ops/drill/workload.py:held_out_chunk): the first tokens of the embedded model's held-out
split (ops/train/corpus.py, the split ops/train/train_demo.py trained and evaluated with), files joined by <|eos|>,
cut into windows of PPL_WINDOW tokens; each window is scored on its own (no context across windows), every position but
the first predicting the next token, as train_demo's `evaluate` does (which reports it over the whole held-out split in
experts/default_model/training_report.json).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from .drill.workload import PPL_TOKENS, PPL_WINDOW, held_out_chunk

Scorer = Callable[[list[list[int]]], Sequence[torch.Tensor]]  # windows of ids -> logits [T, V] per window


def as_scorer(model) -> Scorer:
    """A scorer from what the caller holds: anything with `score_batch(list[list[int]])` (ExpertMesh, Router),
    an in-process MoEDecoder (`forward(list[Tensor])`, e.g. load_reference_model's), or such a callable itself."""
    if hasattr(model, "score_batch"):
        return model.score_batch
    if hasattr(model, "forward"):
        return lambda windows: model.forward([torch.tensor(w) for w in windows])
    return model


def held_out_perplexity(model, model_dir: str | None = None, tokens: int = PPL_TOKENS, window: int = PPL_WINDOW,
                        batch: int = 8, ids: list[int] | None = None) -> dict:
    """Perplexity of `model` (see as_scorer) on the held-out text of `model_dir`'s tokenizer (None: the embedded
    model): the first `tokens` tokens (whole windows). ids: score these ids instead (whole windows of them).

    Returns {"perplexity", "loss" (mean NLL, nats), "tokens_scored", "windows", "window"}."""
    score = as_scorer(model)
    if ids is None:
        ids, _ = held_out_chunk(model_dir, tokens - tokens % window if window <= tokens else window)
    windows = [ids[i:i + window] for i in range(0, len(ids) - window + 1, window)]
    if not windows:
        raise ValueError(f"perplexity: fewer than one window ({window}) of held-out tokens")
    nll, scored = 0.0, 0
    for start in range(0, len(windows), batch):
        chunk = windows[start:start + batch]
        for w, logits in zip(chunk, score(chunk)):
            target = torch.tensor(w[1:])  # [W-1]
            nll += F.cross_entropy(logits[:-1].double(), target, reduction="sum").item()
            scored += len(w) - 1
    return {"perplexity": math.exp(nll / scored), "loss": nll / scored, "tokens_scored": scored,
            "windows": len(windows), "window": window}
