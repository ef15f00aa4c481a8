"""Finding Ray's auth token the way Ray does, and the one-line errors of prepare_join (the GCS probe faked)."""

from __future__ import annotations

import pytest

from expertmesh.experts.errors import ConfigError
from expertmesh.router_service import ray_join
from expertmesh.router_service.ray_join import find_auth_token, prepare_join


def test_token_from_env_then_path_then_home(tmp_path):
    home = tmp_path / "home"
    (home / ".ray").mkdir(parents=True)
    (home / ".ray" / "auth_token").write_text("from-home\n")
    other = tmp_path / "tok"
    other.write_text("from-path")
    assert find_auth_token({}, home) == ("from-home", str(home / ".ray" / "auth_token"))
    assert find_auth_token({"RAY_AUTH_TOKEN_PATH": str(other)}, home) == ("from-path", str(other))
    assert find_auth_token({"RAY_AUTH_TOKEN": " t0k ", "RAY_AUTH_TOKEN_PATH": str(other)}, home) == ("t0k",
                                                                                                     "RAY_AUTH_TOKEN")
    assert find_auth_token({}, tmp_path / "nobody") is None


def _fake_gcs(monkeypatch, needs: str | None, reachable: bool = True):
    """A GCS that wants token `needs` (None: open)."""
    def probe(address, token=None, timeout_s=5.0):
        if not reachable:
            return "unreachable"
        return "open" if needs is None or token == needs else "needs_token"
    monkeypatch.setattr(ray_join, "probe_gcs", probe)


def test_open_cluster_joins_without_token_mode(monkeypatch, tmp_path):
    _fake_gcs(monkeypatch, None)
    env: dict[str, str] = {}
    prepare_join("10.0.0.1:6379", env=env, home=tmp_path)
    assert "RAY_AUTH_MODE" not in env


def test_token_cluster_with_the_token_switches_this_process_to_token_mode(monkeypatch, tmp_path):
    _fake_gcs(monkeypatch, "s3cret")
    env = {"RAY_AUTH_TOKEN": "s3cret"}
    prepare_join("head:6379", env=env, home=tmp_path)
    assert env["RAY_AUTH_MODE"] == "token"


@pytest.mark.parametrize("env, words", [
    ({}, "uses token authentication and no token was found"),
    ({"RAY_AUTH_TOKEN": "wrong"}, "rejected the token from RAY_AUTH_TOKEN"),
])
def test_token_cluster_without_a_working_token_says_what_to_set(monkeypatch, tmp_path, env, words):
    _fake_gcs(monkeypatch, "s3cret")
    with pytest.raises(ConfigError) as err:
        prepare_join("head:6379", env=env, home=tmp_path)
    assert err.value.field == "ray.address" and words in str(err.value) and "\n" not in str(err.value)
    assert "RAY_AUTH_MODE" not in env


def test_nothing_listening_is_one_line_and_other_addresses_are_left_to_ray(monkeypatch, tmp_path):
    _fake_gcs(monkeypatch, None, reachable=False)
    with pytest.raises(ConfigError, match="no Ray cluster answers at 127.0.0.1:1"):
        prepare_join("127.0.0.1:1", env={}, home=tmp_path)
    for address in ("auto", "ray://head:10001"):
        prepare_join(address, env={}, home=tmp_path)  # not probed (the fake would say unreachable)


def test_the_real_probe_sees_nothing_on_a_closed_port():
    assert ray_join.probe_gcs("127.0.0.1:9", timeout_s=2.0) == "unreachable"
