"""Who may call Kill/Drain/UndrainReplica (router_service/admin_auth.py): nobody without a configured admin token,
and only a caller sending that token, under its own metadata key, when there is one."""

from __future__ import annotations

from expertmesh.router_service.admin_auth import (
    ADMIN_TOKEN_KEY,
    DESTRUCTIVE_ADMIN_METHODS,
    admin_denial,
    admin_metadata,
)


def test_without_a_configured_admin_token_every_destructive_call_is_refused_saying_how_to_enable_them():
    for metadata in ({}, {ADMIN_TOKEN_KEY: "anything"}, {"authorization": "Bearer anything"}):
        message = admin_denial(None, metadata)
        assert message is not None and "--admin-token" in message and ADMIN_TOKEN_KEY in message


def test_the_configured_token_lets_a_call_through_and_nothing_else_does():
    assert admin_denial("adm1n", dict(admin_metadata("adm1n"))) is None
    for metadata in ({}, {ADMIN_TOKEN_KEY: "wrong"}, {ADMIN_TOKEN_KEY: "adm1n "}, {ADMIN_TOKEN_KEY: ""},
                     {"authorization": "Bearer adm1n"}):  # the bearer header is not the admin token's place
        assert admin_denial("adm1n", metadata) == f"{ADMIN_TOKEN_KEY}: missing or wrong admin token", metadata


def test_a_non_ascii_token_compares_without_error():
    assert admin_denial("clé", {ADMIN_TOKEN_KEY: "clé"}) is None
    assert admin_denial("clé", {ADMIN_TOKEN_KEY: "cle"}) is not None


def test_the_destructive_methods_are_the_three_that_change_capacity():
    assert DESTRUCTIVE_ADMIN_METHODS == {"KillReplica", "DrainReplica", "UndrainReplica"}
    assert admin_metadata(None) == ()
