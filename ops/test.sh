#!/usr/bin/env bash
# The full test suite, what CI runs (.ci/run) and what the README's test command calls after ops/setup.sh.
# Two pytest runs instead of one `pytest`: the unit tests (pure logic, no Ray, 2,400+) spread over every core with
# pytest-xdist, then the integration and GPU tests one after another in one process, because those share one local
# Ray and one server between modules (tests/session_groups.py) and time their kills and restores on the machine's
# cores. On CI's 2 cores the unit half drops from ~3.5 to ~2 minutes. Extra arguments go to both runs.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/pytest tests/unit -n auto -p no:cacheprovider "$@"
.venv/bin/pytest tests/integration tests/gpu -p no:cacheprovider "$@"
