"""A bare client of an expert socket server (experts/socket_server.py) for tests: dial, authenticate, send one
ExpertBatch and read its ExpertOutput, as the router's SocketTransport does but without Ray."""

from __future__ import annotations

import socket
from multiprocessing.connection import Connection

from expertmesh.experts.socket_server import secure_connection
from expertmesh.protos import expert_transport_pb2 as pb
from expertmesh.router_service.transports.socket import split_address


class Peer:
    def __init__(self, conn: Connection):
        self.conn = conn

    def send(self, batch: pb.ExpertBatch) -> None:
        self.conn.send_bytes(batch.SerializeToString())

    def receive(self, timeout: float = 30.0) -> pb.ExpertOutput:
        assert self.conn.poll(timeout), "no reply"
        return pb.ExpertOutput.FromString(self.conn.recv_bytes())

    def forward(self, batch: pb.ExpertBatch) -> pb.ExpertOutput:
        self.send(batch)
        return self.receive()

    def __enter__(self) -> Peer:
        return self

    def __exit__(self, *exc) -> None:
        self.conn.close()


def dial(address: str, secret: bytes) -> Peer:
    """Raises multiprocessing.AuthenticationError when the server does not take `secret`."""
    return Peer(secure_connection(socket.create_connection(split_address(address), timeout=10), secret, server=False))
