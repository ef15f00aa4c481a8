"""Checks of the gRPC front's settings that can fail before anything starts: the TLS pair, the host and the port.

Why: a junk certificate used to be found by gRPC only when the front bound its port, after Ray and every actor had
started (tens of seconds), and then as a traceback ("Failed to bind"). These run first and raise ValueError
("field: message"), which the configuration tree turns into one line naming `server.<field>` and exit status 2.
Standard library only (ssl, socket): config.py is a pure module.
"""

from __future__ import annotations

import errno
import socket
import ssl


def _no_password() -> bytes:
    raise ValueError("encrypted")


def _why(exc: ssl.SSLError) -> str:
    return f" ({exc.reason})" if exc.reason else ""  # OpenSSL's reason code when it has one, e.g. NO_START_LINE


def check_tls_pair(cert: str, key: str) -> None:
    """`cert` is a PEM certificate (chain) and `key` the PEM private key that belongs to it, unencrypted (gRPC
    takes the key's bytes, with no password). OpenSSL checks all three when it loads them."""
    for name, path in (("tls_cert", cert), ("tls_key", key)):
        try:
            text = open(path, "rb").read(1 << 20)
        except OSError as exc:
            raise ValueError(f"{name}: cannot read {path}: {exc.strerror}") from None
        if b"-----BEGIN " not in text:
            raise ValueError(f"{name}: {path} is not PEM (no '-----BEGIN' line)")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_verify_locations(cafile=cert)  # parses every certificate in the file, nothing else
    except ssl.SSLError as exc:
        raise ValueError(f"tls_cert: {cert} holds no valid PEM certificate{_why(exc)}") from None
    try:
        context.load_cert_chain(cert, key, password=_no_password)
    except ValueError:
        raise ValueError(f"tls_key: {key} is encrypted; give an unencrypted PEM key") from None
    except ssl.SSLError as exc:
        if exc.reason == "KEY_VALUES_MISMATCH":
            raise ValueError(f"tls_key: {key} is not the private key of the certificate in {cert}") from None
        raise ValueError(f"tls_key: {key} holds no valid PEM private key{_why(exc)}") from None


def check_can_listen(host: str, port: int) -> None:
    """`host` resolves to an address of this machine and `port` is free there (port 0: any free port, nothing to
    check). Binds a plain socket and closes it at once; the front binds for real moments later."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ValueError(f"host: cannot resolve {host!r}: {exc.strerror}") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC does: a closed port in TIME_WAIT is free
        try:
            sock.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise ValueError(f"port: {port} is already in use on {host}") from None
            if exc.errno == errno.EADDRNOTAVAIL:
                raise ValueError(f"host: {host} is not an address of this machine") from None
            if exc.errno == errno.EACCES:
                raise ValueError(f"port: not allowed to listen on {port} (below 1024 needs privileges)") from None
            raise ValueError(f"port: cannot listen on {host}:{port}: {exc.strerror}") from None
