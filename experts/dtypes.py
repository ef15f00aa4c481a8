"""Which dtype a process computes in: `model.dtype` ("auto" or a name) resolved against the checkpoint and the
device, in one pure function, so the router and every expert actor apply the same rule.

    auto      the checkpoint's `torch_dtype` (transformers < 5) or `dtype` (transformers 5) from config.json when the
              process computes on a GPU; float32 on a CPU (CPUs have no fast bf16/fp16 matmul, and float32 keeps the
              distributed result within 1e-4 of `transformers` in float32)
    bfloat16 | float16 | float32   exactly that, on any device
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .setting_choices import DTYPE_CHOICES, DTYPE_NAMES


def checkpoint_dtype(raw_config: dict) -> str | None:
    """The dtype a checkpoint's config.json says its weights are stored in; None when it names none we serve in
    (e.g. float64, or an absent key)."""
    for key in ("dtype", "torch_dtype"):
        value = raw_config.get(key)
        if isinstance(value, str):
            name = value.removeprefix("torch.")
            return name if name in DTYPE_NAMES else None
    return None


def read_checkpoint_dtype(model_dir: str | Path) -> str | None:
    """checkpoint_dtype of `model_dir/config.json` (None when the file is missing or unreadable)."""
    try:
        return checkpoint_dtype(json.loads((Path(model_dir) / "config.json").read_text()))
    except (OSError, json.JSONDecodeError):
        return None


def resolve_dtype(requested: str, stored: str | None, on_gpu: bool) -> str:
    """requested: a DTYPE_CHOICES entry; stored: checkpoint_dtype (None: unknown); on_gpu: this process computes on
    a CUDA device -> the dtype name it loads its weights in and computes in."""
    if requested not in DTYPE_CHOICES:
        raise ValueError(f"dtype: must be one of {DTYPE_CHOICES}, got {requested!r}")
    if requested != "auto":
        return requested
    return (stored or "float32") if on_gpu else "float32"


def torch_dtype(name: str) -> torch.dtype:
    """A DTYPE_NAMES entry -> the torch dtype."""
    if name not in DTYPE_NAMES:
        raise ValueError(f"dtype: must be one of {DTYPE_NAMES}, got {name!r}")
    return getattr(torch, name)
