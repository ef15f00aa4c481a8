"""What a served instance listens on, read from the real processes (issue 18 item 13; README: Security).

`expertmesh serve` with its embedded Ray and the gRPC expert transport: every TCP port that it, its Ray (GCS,
raylet, object manager, agents, metrics export) and its actors listen on is bound to loopback, except the
inter-deployment gRPC server of each Serve replica, which Ray binds to every interface and which refuses callers
without Ray's token. Linux only: sockets are read from /proc.
"""

from __future__ import annotations

import ipaddress
import os
import sys
from pathlib import Path

import grpc
import pytest

from expertmesh.protos import inference_pb2 as pb
from expertmesh.protos import inference_pb2_grpc

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads sockets from /proc")

LISTEN = "0A"  # TCP state in /proc/net/tcp*


@pytest.fixture(scope="module")
def served(shared_server):
    return shared_server  # the session's tiny Mixtral (tests/shared_server.py), the default expert transport: socket


def _descendants(root: int) -> set[int]:
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                # comm (field 2) may hold spaces and parentheses: the parent pid follows the last ')'.
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # gone meanwhile
    found, frontier = {root}, [root]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, ppid in parents.items() if ppid == parent and pid not in found]
        found.update(children)
        frontier.extend(children)
    return found


def _hex_address(text: str) -> str:
    """/proc/net/tcp's little-endian hex address (IPv4, or IPv6 as four 32-bit words) as an IP string."""
    raw = bytes.fromhex(text)
    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(raw))


def listening_sockets(root: int) -> list[tuple[str, int, str]]:
    """(host, port, command line) of every TCP socket that `root` or a descendant listens on."""
    inodes: dict[str, str] = {}
    for pid in _descendants(root):
        try:
            command = Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ").strip()
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes[target[8:-1]] = command
        except OSError:
            continue
    found = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{root}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == LISTEN and fields[9] in inodes:
                host, port = fields[1].split(":")
                found.append((_hex_address(host), int(port, 16), inodes[fields[9]]))
    return found


def _is_loopback(host: str) -> bool:
    address = ipaddress.ip_address(host)
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


def test_everything_but_serves_replica_port_listens_on_loopback(served):
    with grpc.insecure_channel(served.target) as channel:  # a generation over the socket expert transport
        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, 3]), max_tokens=3)
        assert len(list(inference_pb2_grpc.InferenceStub(channel).Generate(request, timeout=60))) == 4
    sockets = listening_sockets(served.proc.pid)
    commands = " ".join(command for _, _, command in sockets)
    for part in ("gcs_server", "raylet", "ExpertActor", "ServeReplica"):
        assert part in commands, f"no listening socket of {part} found: {sockets}"
    exposed = [(host, port, command) for host, port, command in sockets if not _is_loopback(host)]
    assert exposed and all("ServeReplica" in command for _, _, command in exposed), exposed


def test_serves_replica_port_refuses_callers_without_the_ray_token(served):
    ports = [port for host, port, command in listening_sockets(served.proc.pid)
             if not _is_loopback(host) and "ServeReplica" in command]
    assert ports
    for port in ports:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            with pytest.raises(grpc.RpcError) as err:
                channel.unary_unary("/ray.serve.ASGIService/HandleRequest")(b"", timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
