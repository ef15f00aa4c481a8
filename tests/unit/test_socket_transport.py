"""The socket transport without Ray: an actor's server (experts/socket_server.py) over a fake forward, and the
router's SocketTransport dialled at it directly. Replies in order, errors as messages, a timeout that drops the
connection (never reads a late reply as the next call's), and the secret challenge."""

from __future__ import annotations

import socket
import time
from multiprocessing import AuthenticationError
from types import SimpleNamespace

import pytest
import torch

from expertmesh.experts import socket_server, wire
from expertmesh.experts.arrays import pack, to_tensor
from expertmesh.experts.socket_server import ExpertSocketServer
from expertmesh.router_service.transports.socket import SocketTransport, split_address
from tests.socket_peer import dial

SECRET = "s3cret"


def doubling(layer, experts, counts, x, trace=None):
    """A stand-in expert: 2 * x (+ layer, so calls are told apart); layer 99 fails, layer 98 is slow."""
    if layer == 99:
        raise ValueError("layer 99 is not hosted here")
    if layer == 98:
        time.sleep(0.5)
    return pack(to_tensor(x) * 2 + layer)


@pytest.fixture
def server():
    srv = ExpertSocketServer(doubling, "127.0.0.1", SECRET)
    yield srv
    srv.stop()


def batch(layer: int, rows: torch.Tensor):
    return wire.encode_batch(layer, [0], [rows.shape[0]], pack(rows))


def test_answers_in_order_and_reports_a_failed_forward_as_an_error(server):
    x = torch.randn(5, 8)
    with dial(server.address, SECRET.encode()) as peer:
        for layer in (1, 2, 99, 3):  # pipelined: all sent before any is read
            peer.send(batch(layer, x))
        for layer in (1, 2):
            assert torch.equal(wire.decode(peer.receive().y), x * 2 + layer)
        failed = peer.receive()
        assert failed.error == "ValueError: layer 99 is not hosted here" and not failed.HasField("y")
        assert torch.equal(wire.decode(peer.receive().y), x * 2 + 3)


def test_a_peer_without_the_secret_is_dropped(server, monkeypatch):
    with pytest.raises(AuthenticationError):
        dial(server.address, b"wrong")
    # A peer that connects and never answers the challenge does not hold its thread for ever.
    monkeypatch.setattr(socket_server, "AUTH_TIMEOUT_S", 0.2)
    idle = socket.create_connection(split_address(server.address))
    deadline = time.monotonic() + 10
    while server.refused < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    idle.close()
    assert server.refused == 2
    with dial(server.address, SECRET.encode()) as peer:  # and the server still serves
        assert torch.equal(wire.decode(peer.forward(batch(0, torch.ones(1, 2))).y), torch.full((1, 2), 2.0))


def test_the_server_refuses_an_empty_secret():
    with pytest.raises(ValueError, match="secret"):
        ExpertSocketServer(doubling, "127.0.0.1", "")


def transport_at(server) -> SocketTransport:
    transport = SocketTransport({"a": SimpleNamespace(_actor_id="a-1")}, secret=SECRET)
    transport._dial("a", server.address)
    return transport


def test_transport_matches_replies_to_calls_in_flight_and_maps_errors(server):
    transport = transport_at(server)
    x = torch.randn(3, 4)
    first = transport.submit("a", 1, [0], [3], pack(x))
    failed = transport.submit("a", 99, [0], [3], pack(x))
    second = transport.submit("a", 2, [0], [3], pack(x))
    # Gathered out of order (the overlap schedule's second micro-batch first): each gets its own reply.
    (got_second,) = transport.gather_settled([second], timeout=10)
    got_first, error = transport.gather_settled([first, failed], timeout=10)
    assert torch.equal(got_first, x * 2 + 1) and torch.equal(got_second, x * 2 + 2)
    assert isinstance(error, RuntimeError) and "layer 99 is not hosted here" in str(error)
    assert not transport.connections["a"].in_flight
    transport.close()


def test_a_timeout_drops_the_connection_and_fails_every_call_on_it(server):
    transport = transport_at(server)
    conn = transport.connections["a"]
    slow = transport.submit("a", 98, [0], [1], pack(torch.ones(1, 2)))
    behind = transport.submit("a", 1, [0], [1], pack(torch.ones(1, 2)))
    started = time.monotonic()
    (error,) = transport.gather_settled([slow], timeout=0.1)
    assert isinstance(error, TimeoutError) and time.monotonic() - started < 0.45
    assert "a" not in transport.connections and conn.broken is not None
    (after,) = transport.gather_settled([behind], timeout=10)
    assert isinstance(after, TimeoutError)  # its reply would come after the slow one's: never read


def test_prefetch_hints_ride_with_the_call():
    seen = []

    def recording(layer, experts, counts, x, trace=None, prefetch=None):
        seen.append(prefetch)
        return x

    srv = ExpertSocketServer(recording, "127.0.0.1", SECRET)
    try:
        transport = transport_at(srv)
        assert transport.takes_prefetch
        calls = [transport.submit("a", 0, [0], [1], pack(torch.ones(1, 2)), prefetch=[(1, 3)]),
                 transport.submit("a", 0, [0], [1], pack(torch.ones(1, 2)))]
        assert all(isinstance(y, torch.Tensor) for y in transport.gather_settled(calls, timeout=10))
        assert seen == [[(1, 3)], None]
        transport.close()
    finally:
        srv.stop()
