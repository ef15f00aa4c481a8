"""The gRPC front's settings checked before anything starts (router_service/server_checks.py, through
ServerConfig): a junk or mismatched TLS pair, an unresolvable host, a port in use. Each error names the field."""

from __future__ import annotations

import socket

import pytest

from expertmesh.router_service.config import ConfigError, MeshConfig, ServerConfig
from tests.served import self_signed_cert


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tls")
    (root / "a").mkdir()
    (root / "b").mkdir()
    return self_signed_cert(root / "a"), self_signed_cert(root / "b"), root


def server_error(**settings) -> ConfigError:
    with pytest.raises(ConfigError) as err:
        MeshConfig().replace(**{f"server.{k}": v for k, v in settings.items()}).validate()
    return err.value


def test_a_good_pair_validates(pairs):
    (cert, key), _, _ = pairs
    MeshConfig().replace(**{"server.tls_cert": str(cert), "server.tls_key": str(key)}).validate()


def test_junk_pem_names_the_file_it_is_in(pairs):
    (cert, key), _, root = pairs
    junk = root / "junk.pem"
    junk.write_text("-----BEGIN CERTIFICATE-----\nnot a certificate\n-----END CERTIFICATE-----\n")
    not_pem = root / "notes.txt"
    not_pem.write_text("hello")
    assert server_error(tls_cert=str(junk), tls_key=str(key)).field == "server.tls_cert"
    assert server_error(tls_cert=str(not_pem), tls_key=str(key)).field == "server.tls_cert"
    assert server_error(tls_cert=str(key), tls_key=str(key)).field == "server.tls_cert"  # a key is no certificate
    assert server_error(tls_cert=str(cert), tls_key=str(junk)).field == "server.tls_key"
    assert server_error(tls_cert=str(cert), tls_key=str(cert)).field == "server.tls_key"  # a certificate is no key


def test_a_key_of_another_certificate_is_refused(pairs):
    (cert, _), (_, other_key), _ = pairs
    err = server_error(tls_cert=str(cert), tls_key=str(other_key))
    assert err.field == "server.tls_key" and "not the private key" in err.message


def test_message_size_has_bounds_and_responses_get_at_least_64_mib():
    assert server_error(max_message_bytes=1 << 31).field == "server.max_message_bytes"
    assert ServerConfig().max_response_bytes == 64 << 20
    assert ServerConfig(max_message_bytes=100 << 20).max_response_bytes == 100 << 20


def test_a_port_in_use_and_a_host_that_is_not_here_are_named():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(ConfigError) as err:
            ServerConfig(port=port).check_can_listen()
        assert err.value.field == "server.port" and str(port) in err.value.message
    with pytest.raises(ConfigError) as err:
        ServerConfig(host="no-such-host.invalid").check_can_listen()
    assert err.value.field == "server.host"
    with pytest.raises(ConfigError) as err:
        ServerConfig(host="192.0.2.1").check_can_listen()  # TEST-NET-1: never an address of this machine
    assert err.value.field == "server.host"
    ServerConfig(port=0).check_can_listen()  # any free port: nothing to check
