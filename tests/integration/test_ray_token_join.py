"""`expertmesh serve --address` against a real `ray start --head --block` with Ray token authentication on (started
and stopped by this module, not an in-process Cluster): with the token it joins, serves and answers; without it, one
line and exit 2 instead of a screen of InvalidAuthToken retries."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from expertmesh.ops.server_process import start_server
from expertmesh.router_service.ray_join import probe_gcs
from tests.served import generate_ids
from tests.traffic import wait_for

RAY = str(Path(sys.executable).with_name("ray"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def token_cluster(tmp_path_factory):
    """(GCS address, token) of a head node started with RAY_AUTH_MODE=token, its token in its own HOME."""
    from ray._private.services import get_node_ip_address

    home = tmp_path_factory.mktemp("ray-home")
    env = {**os.environ, "HOME": str(home), "RAY_AUTH_MODE": "token"}
    env.pop("RAY_AUTH_TOKEN", None)
    subprocess.run([RAY, "get-auth-token", "--generate"], env=env, check=True, capture_output=True, timeout=60)
    token = (home / ".ray" / "auth_token").read_text().strip()
    port = _free_port()
    log = (home / "head.log").open("w")
    head = subprocess.Popen([RAY, "start", "--head", "--block", f"--port={port}", "--num-cpus=4",
                             "--include-dashboard=false", "--disable-usage-stats"],
                            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    address = f"{get_node_ip_address()}:{port}"
    try:
        wait_for(lambda: probe_gcs(address, token, timeout_s=2) == "open" or head.poll() is not None, timeout=120,
                 what="the token-auth head node")
        assert head.poll() is None, (home / "head.log").read_text()[-3000:]
        yield address, token
    finally:
        os.killpg(head.pid, signal.SIGTERM)  # `ray start --block` stops its Ray processes on SIGTERM
        try:
            head.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait()


def _env_without_token(home: Path) -> dict[str, str]:
    env = {**os.environ, "HOME": str(home)}
    for name in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_MODE"):
        env.pop(name, None)
    return env


def test_the_cluster_refuses_calls_without_its_token(token_cluster):
    address, token = token_cluster
    assert probe_gcs(address) == "needs_token"
    assert probe_gcs(address, "not-" + token) == "needs_token"


def test_serve_without_the_token_says_so_in_one_line(token_cluster, tmp_path):
    address, _ = token_cluster
    done = subprocess.run([sys.executable, "-m", "expertmesh.ops.cli", "serve", "--address", address, "--port", "0"],
                          env=_env_without_token(tmp_path), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "token authentication" in lines[0] and "RAY_AUTH_TOKEN" in lines[0], done.stderr
    assert "InvalidAuthToken" not in done.stderr and "Traceback" not in done.stderr


def test_serve_with_the_token_joins_and_answers(token_cluster, tmp_path):
    address, token = token_cluster
    env = {**_env_without_token(tmp_path), "RAY_AUTH_TOKEN": token}  # the token only, as Ray documents it
    server = start_server(["--address", address, "--cpus-per-actor", "0.25"], log_path=tmp_path / "serve.log",
                          timeout=300, env=env)
    try:
        with grpc.insecure_channel(server.target) as channel:
            assert len(generate_ids(channel, [1, 2, 3], 4)) == 4
    finally:
        assert server.stop() == 0, server.log()
