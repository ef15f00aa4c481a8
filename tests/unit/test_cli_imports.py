"""The command line answers --help and refuses a bad configuration without importing torch, Ray or gRPC.

Each case runs `expertmesh.ops.cli.main` in a fresh interpreter and reports, at exit, which of those packages are
in sys.modules: importing torch alone costs seconds on a loaded machine, and a user who mistyped a setting should get
the one-line error at once (ops/cli.py; the configuration tree is pure, tests/unit/test_pure_modules.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

HEAVY = ("torch", "ray", "grpc")

# argv[1]: JSON list of CLI arguments. Prints one JSON line on stderr's last line: exit status, heavy packages loaded.
_RUN = r"""
import json, sys
argv, heavy_names = json.loads(sys.argv[1]), set(json.loads(sys.argv[2]))
sys.argv = ["expertmesh", *argv]
try:
    from expertmesh.ops.cli import main
    code = main(argv)
except SystemExit as exc:
    code = exc.code
heavy = sorted({name.split(".")[0] for name in sys.modules} & heavy_names)
print(json.dumps({"code": code, "heavy": heavy, "modules": len(sys.modules)}), file=sys.stderr)
"""


def run_cli(*argv: str) -> tuple[dict, str]:
    """(the report, what the command printed on stderr before it)."""
    result = subprocess.run([sys.executable, "-c", _RUN, json.dumps(list(argv)), json.dumps(HEAVY)],
                            capture_output=True, text=True, timeout=120)
    lines = result.stderr.strip().splitlines()
    assert lines, result.stdout[-2000:]
    return json.loads(lines[-1]), "\n".join(lines[:-1])


@pytest.mark.parametrize("argv", [["--help"], ["serve", "--help"], ["plan-cluster", "--help"], ["drill", "--help"]])
def test_help_imports_no_torch_ray_or_grpc(argv):
    report, _ = run_cli(*argv)
    assert report["code"] == 0
    assert report["heavy"] == [], f"expertmesh {' '.join(argv)} imports {report['heavy']}"


@pytest.mark.parametrize("text, field", [
    ("model: {dtype: bogus}\n", "model.dtype"),
    ("router: {transprot: grpc}\n", "router.transprot"),
    ("failover: {shed: {max_share: 2}}\n", "failover.shed.max_share"),
    ("router: {batcher: {max_active: 0}}\n", "router.batcher.max_active"),
    ("controller: {elastic: {autoscale: {max_gpus: 0, target_load_per_replica: 1}}}\n",
     "controller.elastic.autoscale.max_gpus"),
    ("observability: {load: {bucket_s: 0}}\n", "observability.load.bucket_s"),
])
def test_a_bad_config_is_refused_in_one_line_naming_the_field_without_heavy_imports(tmp_path: Path, text, field):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    report, stderr = run_cli("serve", "--config", str(path))
    assert report["code"] == 2
    assert stderr.startswith(f"error: {field}: "), stderr
    assert len(stderr.splitlines()) == 1, stderr  # one line, no traceback
    assert report["heavy"] == [], f"refusing {field} imports {report['heavy']}"


@pytest.mark.parametrize("command", [["generate", "--local", "--token-ids", "1,2"],
                                     ["score", "--local", "--token-ids", "1,2"]])
def test_in_process_commands_check_the_config_before_the_data_plane(tmp_path: Path, command):
    path = tmp_path / "bad.yaml"
    path.write_text("experts: {quant: int3}\n")
    report, stderr = run_cli(*command, "--config", str(path))
    assert report["code"] == 2 and stderr.startswith("error: experts.quant: "), stderr
    assert report["heavy"] == [], report
