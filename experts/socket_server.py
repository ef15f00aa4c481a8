"""The actor side of the socket transport: the same Forward as the gRPC server, over one plain TCP connection per
router, framed and authenticated by the standard library's `multiprocessing.connection`.

Why a second server: on the 2-core box an empty gRPC round trip between two Python processes takes ~0.6-0.8 ms
unary (~0.47 ms on an open bidirectional stream), a framed TCP one ~0.03 ms; a decode step makes one round per MoE
layer, so gRPC alone cost ~3 ms of a 15 ms embedded-model step (README: Transports). The messages are the gRPC
transport's protobufs (ExpertBatch in, ExpertOutput out; an `error` instead of `y` when the forward failed), so both
servers decode and encode the same bytes and the results are bit-identical.

A connection is served by one thread that answers its requests in order (the router relies on that: replies come
back in the order it sent, so a connection needs no request ids). It listens on the node's cluster address only;
before a single request is read, both ends prove they hold the cluster secret (experts/transport_secret.py) with
`multiprocessing.connection`'s HMAC challenge in each direction, so a caller without it is dropped and the secret
never crosses the wire.
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge

from ..protos import expert_transport_pb2 as pb
from . import wire
from .grpc_server import Forward

log = logging.getLogger(__name__)

AUTH_TIMEOUT_S = 10.0  # a peer that does not finish the challenge within this is dropped (and frees its thread)


def secure_connection(sock: socket.socket, secret: bytes, server: bool) -> Connection:
    """A framed connection over a connected TCP socket (it takes the socket's descriptor), after the mutual HMAC
    challenge (the server challenges first, as `Listener`/`Client` do). Raises multiprocessing.AuthenticationError
    when the peer lacks the secret, OSError/EOFError when it stalls past AUTH_TIMEOUT_S or hangs up."""
    sock.settimeout(None)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # one small frame per layer: never wait to coalesce
    conn = Connection(sock.detach())
    try:
        _receive_timeout(conn.fileno(), AUTH_TIMEOUT_S)
        if server:
            deliver_challenge(conn, secret)
            answer_challenge(conn, secret)
        else:
            answer_challenge(conn, secret)
            deliver_challenge(conn, secret)
        _receive_timeout(conn.fileno(), 0.0)  # served requests may be far apart
    except BaseException:
        conn.close()
        raise
    return conn


def _receive_timeout(fd: int, seconds: float) -> None:
    """SO_RCVTIMEO on a blocking descriptor (0: none): a read that waits longer fails with OSError (EAGAIN)."""
    sock = socket.socket(fileno=fd)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO,
                        struct.pack("ll", int(seconds), int(seconds % 1 * 1_000_000)))
    finally:
        sock.detach()  # the descriptor stays the Connection's


def answer(forward: Forward, request: bytes) -> bytes:
    """One serialized ExpertBatch -> one serialized ExpertOutput (the forward's error as text, never a raise)."""
    try:
        y = wire.forward_batch(forward, pb.ExpertBatch.FromString(request))
        return pb.ExpertOutput(y=wire.encode_host(y)).SerializeToString()
    except Exception as exc:  # the router retries elsewhere; say what failed
        return pb.ExpertOutput(error=f"{type(exc).__name__}: {exc}").SerializeToString()


class ExpertSocketServer:
    """Serves `forward` on host:<free port> (host: the node's cluster IP, never 0.0.0.0) to peers holding
    `secret`; `address` is what routers dial."""

    def __init__(self, forward: Forward, host: str, secret: str):
        if not secret:
            raise ValueError("secret: the expert transport needs a non-empty cluster secret")
        self.forward = forward
        self._secret = secret.encode()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.bind((host, 0))
        self._listener.listen(64)
        port = self._listener.getsockname()[1]
        self.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self.refused = 0  # peers dropped for failing the challenge (tests check it)
        self._closed = False
        threading.Thread(target=self._accept, name="expert-socket-accept", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(sock,), name="expert-socket", daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        try:
            conn = secure_connection(sock, self._secret, server=True)
        except Exception as exc:  # wrong or missing secret, or a peer that stalled
            self.refused += 1
            log.warning("expert socket transport: dropped a peer that failed the secret challenge: %r", exc)
            return
        try:
            while True:
                conn.send_bytes(answer(self.forward, conn.recv_bytes()))
        except (EOFError, OSError):
            pass  # the router closed (or dropped, after a timeout) this connection
        finally:
            conn.close()

    def stop(self) -> None:
        self._closed = True
        self._listener.close()
