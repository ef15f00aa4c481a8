"""The one place a secret a client sent is compared with the one configured: the bearer token (HTTP and gRPC
fronts, and the deployment behind Serve's own gRPC proxy), the admin token, and the expert transport's cluster secret.

Why one helper: a plain `==` stops at the first differing character, so its time tells a caller how much of a guess
was right; `hmac.compare_digest` on bytes takes the same time whatever matches. Every path used to do this on its own,
and two did it with `!=` (issue 30). tests/unit/test_token_compare.py asserts no other compare remains.

Why here (experts/): the lowest layer; both the expert transport and router_service import it. Standard library only.
"""

from __future__ import annotations

import hmac

BEARER = "bearer"  # the scheme name is case-insensitive (RFC 9110 section 11.1); the token itself is not


def _as_bytes(value: str | bytes) -> bytes:
    # surrogatepass: a header aiohttp decoded with surrogateescape (bytes that are not UTF-8) still encodes, so a
    # hostile Authorization header is a mismatch, not a UnicodeEncodeError (a 500).
    return value if isinstance(value, bytes) else value.encode("utf-8", "surrogatepass")


def secret_matches(sent: str | bytes | None, expected: str | bytes) -> bool:
    """`sent` (what a caller gave; None or a non-string: nothing) equals `expected`, in time independent of where
    they differ (it depends only on the lengths)."""
    if not isinstance(sent, str | bytes):
        return False
    return hmac.compare_digest(_as_bytes(sent), _as_bytes(expected))


def bearer_matches(header: str | bytes | None, token: str) -> bool:
    """`header` (an Authorization header or `authorization` metadata value) is `Bearer <token>`."""
    if isinstance(header, bytes):
        header = header.decode("latin-1")  # one byte per character: the split below cannot fail
    if not isinstance(header, str):
        return False
    scheme, _, credentials = header.partition(" ")
    # The scheme is public (always "Bearer"); only the credentials go through the constant-time compare.
    scheme_ok = scheme.lower() == BEARER
    return secret_matches(credentials, token) and scheme_ok
