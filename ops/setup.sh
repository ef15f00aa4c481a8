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
# The HTTP front's tests drive the distribution's headless Chromium (through Selenium) and its Prometheus server
# (tests/browser_and_prometheus.py). Installed here when this runs as root on a Debian/Ubuntu machine; elsewhere those
# tests skip, naming what to install.
if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  missing=""
  command -v chromium >/dev/null || missing="$missing chromium"
  command -v chromedriver >/dev/null || missing="$missing chromium-driver"
  command -v prometheus >/dev/null || missing="$missing prometheus"
  if [ -n "$missing" ]; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing >/dev/null; } \
      || echo "could not install$missing: the browser / Prometheus tests will skip" >&2
  fi
fi
echo "expertmesh installed in .venv ($(.venv/bin/python -c 'import torch, ray; print("torch", torch.__version__, "ray", ray.__version__)'))"
