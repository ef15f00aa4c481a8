"""The embedded default model: a small MoE trained on offline text (ops/train/train_demo.py) and shipped in the package,
so expertmesh serves with no download. A configuration whose model.path is null serves it."""

from __future__ import annotations

from pathlib import Path

EMBEDDED_MODEL_DIR = Path(__file__).resolve().parent / "default_model"  # config.json, safetensors, tokenizer.json
EMBEDDED_MODEL_NAME = "expertmesh-demo"  # the name clients use for it
