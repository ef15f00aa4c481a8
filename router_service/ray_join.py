"""Joining an existing Ray cluster, token authentication included, with one clear line when it cannot work.

A Ray 2.60 cluster with token authentication refuses every unauthenticated GCS call. Ray 2.60 turns it on only when
asked: `RAY_AUTH_MODE=token` in the environment of `ray start`, or a token that already exists when `ray start
--head` runs with RAY_AUTH_MODE unset (a worker's `ray start --address` never turns it on by itself); `ray.init()`
starting a local cluster is the one default-on case (unless RAY_AUTH_MODE is set). Ray's cluster launcher (`ray up`)
sets nothing, and KubeRay only with `authOptions: {mode: token}` (KubeRay >= 1.5.1); cluster/configs/ turn it on in
both (RAY_AUTH_MODE=token in every `ray up` container, authOptions in the RayService). Ray 2.61 turns it on for all
clusters. A driver joins only when *it* runs in token mode and has the token (`RAY_AUTH_TOKEN`, the file at
`RAY_AUTH_TOKEN_PATH`, or `~/.ray/auth_token`); otherwise `ray.init` retries for ~20 s, printing a screen of
`InvalidAuthToken` warnings, and ends in a ConnectionError that names neither cause.

So before `ray.init`, one GCS call (`GetClusterId`, no auth needed on an open cluster) tells an open cluster from a
token-protected one from nothing listening, and a token we found from a wrong one. A token-protected cluster with a
working token gets `RAY_AUTH_MODE=token` in this process's environment (Ray reads it there; workers we start inherit
it, and Ray's cached configuration is refreshed), so the user only has to provide the token the way Ray documents.
Ray itself turns a driver's token mode on from an existing token only when `ray.init` looks for a local cluster
(address None or "auto"), never for an explicit address.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from ..experts.errors import ConfigError

_HOST_PORT = re.compile(r"^[A-Za-z0-9.\-]+:\d+$|^\[[0-9A-Fa-f:]+\]:\d+$")
_GET_CLUSTER_ID = "/ray.rpc.NodeInfoGcsService/GetClusterId"


def find_auth_token(env: dict[str, str] | None = None, home: Path | None = None) -> tuple[str, str] | None:
    """(token, where it came from) as Ray looks for it: RAY_AUTH_TOKEN, the file at RAY_AUTH_TOKEN_PATH,
    ~/.ray/auth_token; None when there is none. (Ray aborts when RAY_AUTH_TOKEN_PATH names an unreadable or empty
    file; here ~/.ray/auth_token is still tried, and a token the cluster refuses gets prepare_join's one line.)"""
    env = os.environ if env is None else env
    if env.get("RAY_AUTH_TOKEN", "").strip():
        return env["RAY_AUTH_TOKEN"].strip(), "RAY_AUTH_TOKEN"
    candidates = []
    if env.get("RAY_AUTH_TOKEN_PATH"):
        candidates.append(Path(env["RAY_AUTH_TOKEN_PATH"]).expanduser())
    candidates.append((home or Path.home()) / ".ray" / "auth_token")
    for path in candidates:
        try:
            token = path.read_text().strip()
        except OSError:
            continue
        if token:
            return token, str(path)
    return None


def probe_gcs(address: str, token: str | None = None, timeout_s: float = 5.0) -> str:
    """'open' (answers without a token, or accepts `token`), 'needs_token' (refuses the call: no or wrong token),
    or 'unreachable' (nothing answers in time)."""
    import grpc

    metadata = [("authorization", f"Bearer {token}")] if token else None
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_unary(_GET_CLUSTER_ID, request_serializer=lambda b: b, response_deserializer=lambda b: b)
        try:
            call(b"", timeout=timeout_s, metadata=metadata, wait_for_ready=False)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
                return "needs_token"
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                return "unreachable"
            return "open"  # some other answer: a GCS is there and did not refuse us for auth
    return "open"


def prepare_join(address: str, field: str = "ray.address", env: dict[str, str] | None = None,
                 home: Path | None = None) -> None:
    """Check that `address` (host:port of a GCS) can be joined, and switch this process to token mode when the
    cluster needs it. Raises ConfigError naming `field` with one line saying what to do. Addresses that are not
    host:port ('auto', 'ray://...') are left to Ray."""
    if not _HOST_PORT.match(address):
        return
    env = os.environ if env is None else env
    state = probe_gcs(address)
    if state == "unreachable":
        raise ConfigError(field, f"no Ray cluster answers at {address} (is `ray start --head` running there, and is "
                                 f"the GCS port reachable from this machine?)")
    if state == "open":
        return
    found = find_auth_token(env, home)
    if found is None:
        raise ConfigError(field, f"the Ray cluster at {address} uses token authentication and no token was found: "
                                 f"set RAY_AUTH_TOKEN (or RAY_AUTH_TOKEN_PATH, or put it in ~/.ray/auth_token); "
                                 f"`ray get-auth-token` on the head node prints it")
    token, where = found
    if probe_gcs(address, token) != "open":
        raise ConfigError(field, f"the Ray cluster at {address} rejected the token from {where}; use the token of "
                                 f"that cluster (`ray get-auth-token` on its head node)")
    env["RAY_AUTH_MODE"] = "token"
    if env is os.environ:
        _refresh_ray_config()


def _refresh_ray_config() -> None:
    """Ray caches its configuration (auth mode included) when first imported; re-read it from the environment, as
    Ray's own `_enable_token_auth` does, so the `ray.init` that follows runs in token mode."""
    from ray._raylet import Config

    Config.initialize("")
