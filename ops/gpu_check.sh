#!/usr/bin/env bash
# The GPU checks (tests/gpu, marker `gpu`) with the installed torch, on a machine with CUDA and without Ray:
#   bash ops/gpu_check.sh [extra pytest args]
# Run from anywhere; it maps the repository's folders under the `expertmesh` namespace (as the installed package
# does) in a scratch folder, so no install is needed. Needs torch with CUDA, pytest, numpy, safetensors, tqdm;
# transformers and protobuf for the tests that use them (those skip without them).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-python3}"
overlay="$(mktemp -d)"
trap 'rm -rf "$overlay"' EXIT
mkdir -p "$overlay/expertmesh"
echo '"""expertmesh (gpu_check overlay)."""' > "$overlay/expertmesh/__init__.py"
for folder in cluster experts router_service protos ops; do
  ln -s "$repo/$folder" "$overlay/expertmesh/$folder"
done
"$python" - <<'PY'
import torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, available: {torch.cuda.is_available()}",
      f"({torch.cuda.get_device_name(0)})" if torch.cuda.is_available() else "")
PY
cd "$repo"
PYTHONPATH="$overlay:$repo${PYTHONPATH:+:$PYTHONPATH}" "$python" -m pytest -m gpu tests/gpu -q -rs -p no:cacheprovider "$@"
