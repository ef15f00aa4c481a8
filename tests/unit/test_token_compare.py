"""The one token compare (experts/token_compare.py): what matches and what does not, hostile header bytes answered
as a mismatch rather than an exception, and no other compare of a client's secret left in the code."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from expertmesh.experts.token_compare import bearer_matches, secret_matches

ROOT = Path(__file__).resolve().parents[2]


def test_the_bearer_header_matches_only_its_token():
    assert bearer_matches("Bearer s3cret", "s3cret")
    assert bearer_matches("bearer s3cret", "s3cret") and bearer_matches("BEARER s3cret", "s3cret")  # scheme: any case
    for header in ("Bearer s3cre", "Bearer s3cret ", "Bearer S3CRET", "Bearers3cret", "Basic s3cret", "s3cret",
                   "Bearer  s3cret", "", None, 17, b"Bearer wrong"):
        assert not bearer_matches(header, "s3cret"), header
    assert bearer_matches(b"Bearer s3cret", "s3cret")


@pytest.mark.parametrize("header", ["Bearer \udcff\udcfe", "Bearer \ud800", "Bearer clé", "\x00" * 5000])
def test_hostile_header_text_is_a_mismatch_not_an_error(header):
    """aiohttp decodes header bytes that are not UTF-8 with surrogateescape; encoding such a str strictly raised
    UnicodeEncodeError (a 500 on the HTTP front)."""
    assert not bearer_matches(header, "s3cret")


def test_secrets_compare_whole_and_typed():
    assert secret_matches("clé", "clé") and secret_matches(b"k", b"k") and secret_matches("k", b"k")
    for sent in ("cle", "", None, 3, ["clé"], "clé\x00"):
        assert not secret_matches(sent, "clé"), sent


# Paths that handle a client's secret: every compare there goes through the helper.
AUTH_PATHS = ["router_service", "experts", "cluster", "ops"]
HELPER = ROOT / "experts" / "token_compare.py"
SUSPECT = [
    re.compile(r"(==|!=)\s*f?['\"]Bearer"),  # a header compared with == / != against "Bearer ..."
    re.compile(r"['\"]Bearer [^'\"]*['\"]\s*(==|!=)"),
    re.compile(r"(==|!=)\s*[\w.]*(auth_token|admin_token|_secret|secret)\b"),
    re.compile(r"\b[\w.]*(auth_token|admin_token|_secret|secret)\s*(==|!=)\s*(?!None\b)"),
    re.compile(r"compare_digest"),  # only the helper calls it
]
# A configuration check comparing two of the server's own settings (no client input, no timing to learn from).
ALLOWED = {("router_service/config.py", "self.admin_token == self.auth_token")}


def test_no_other_token_compare_remains():
    found = []
    for folder in AUTH_PATHS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path == HELPER:
                continue
            rel = path.relative_to(ROOT).as_posix()
            for number, line in enumerate(path.read_text().splitlines(), 1):
                code = line.split("#", 1)[0]
                if any(p.search(code) for p in SUSPECT) and not any(rel == f and s in code for f, s in ALLOWED):
                    found.append(f"{rel}:{number}: {line.strip()}")
    assert not found, "compare secrets with experts/token_compare.py:\n" + "\n".join(found)


def test_the_suspect_patterns_catch_the_compares_they_replaced():
    """The scan above cannot pass vacuously: each of the removed forms is caught."""
    for line in ('if metadata.get("authorization") != f"Bearer {self.auth_token}":',
                 'if metadata.get("authorization") != f"Bearer {token}":',
                 "if not hmac.compare_digest(given.encode(), expected):",
                 "if sent == self.admin_token:"):
        assert any(p.search(line) for p in SUSPECT), line
