#!/usr/bin/env bash
# Creates .venv and installs expertmesh with its test tools. Idempotent; safe to re-run.
# torch is installed first and on its own: a plain `torch` requirement on a machine without torch pulls a
# multi-GB CUDA build. Override with TORCH_SPEC, e.g. TORCH_SPEC="torch --index-url <your CUDA wheel index>".
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/python -m pip install -q $TORCH_SPEC
.venv/bin/python -m pip install -q -e ".[test]"
echo "expertmesh installed in .venv ($(.venv/bin/python -c 'import torch, ray; print("torch", torch.__version__, "ray", ray.__version__)'))"
