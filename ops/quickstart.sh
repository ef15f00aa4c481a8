#!/usr/bin/env bash
# The README's main job: serve the embedded default model over gRPC on localhost, answer one request, stop.
# Usage: bash ops/quickstart.sh ["prompt text"]   (run ops/setup.sh first)
set -euo pipefail
cd "$(dirname "$0")/.."
PROMPT=${1:-"def parse(self, text):"}
LOG=$(mktemp -t expertmesh-serve.XXXXXX)
.venv/bin/expertmesh serve --port 0 >"$LOG" 2>"$LOG.err" &
SERVER=$!
trap 'kill -INT $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
echo "starting expertmesh (embedded Ray, expert actors laid out for this machine's cores; logs: $LOG.err) ..." >&2
for _ in $(seq 300); do
  grep -q "expertmesh serving" "$LOG" && break
  kill -0 $SERVER 2>/dev/null || { cat "$LOG.err" >&2; exit 1; }
  sleep 1
done
grep "expertmesh serving" "$LOG" >&2 || { echo "server did not start" >&2; exit 1; }
TARGET=$(grep -o '[0-9.]*:[0-9]*' "$LOG" | head -n 1)
.venv/bin/expertmesh generate --target "$TARGET" --prompt "$PROMPT" --max-tokens 48
