"""Each entry point takes the one configuration tree: a setting from a config file (and a flag over it) reaches a
served expertmesh started from the command line. The Serve YAML path is tests/integration/test_serve_config.py,
the drill's tests/unit/test_drill_report.py (serve_args) and tests/integration/test_drill_scale.py, the Python API's
every ExpertMesh test."""

from __future__ import annotations

import json
import subprocess
import sys

import yaml

from expertmesh.ops.cli import main
from tests.served import ONE_ACTOR, start_server


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "expertmesh.ops.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_serve_takes_a_config_file_and_flags_override_it(checkpoints, tmp_path, capsys):
    config = tmp_path / "mesh.yaml"
    config.write_text(yaml.safe_dump({
        "model": {"path": str(checkpoints["mixtral"]), "name": "from-file"},
        "failover": {"no_replica_policy": "degrade"},
        "controller": {"restore": False},
        "router": {"batcher": {"max_active": 4}},
    }))
    server = start_server(*ONE_ACTOR, "--config", str(config), "--model-name", "from-flag")
    try:
        assert main(["status", "--target", server.target, "--json"]) == 0
        state = json.loads(capsys.readouterr().out)
        assert state["model"] == "from-flag"  # the flag over the file
        assert state["no_replica_policy"] == "degrade"  # the file over the default
        assert main(["generate", "--target", server.target, "--token-ids", "1,2,3", "--max-tokens", "3", "--json"]) == 0
        assert len(json.loads(capsys.readouterr().out)["token_ids"]) == 3
    finally:
        server.stop()


def test_a_bad_config_file_fails_before_anything_starts_naming_the_field(tmp_path):
    config = tmp_path / "mesh.yaml"
    config.write_text(yaml.safe_dump({"router": {"transprot": "grpc"}}))
    result = cli("serve", "--config", str(config), timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("error: router.transprot: unknown setting")
    assert "Traceback" not in result.stderr and "Started a local Ray" not in result.stderr
