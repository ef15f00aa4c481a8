"""Who may call the destructive Admin RPCs (KillReplica, DrainReplica, UndrainReplica). Pure; no gRPC.

They take capacity away (or put it back), so the ordinary bearer token (`server.auth_token`, often shared by every
client) is not enough: they need a second secret, `server.admin_token`, sent as `x-expertmesh-admin-token` metadata.
With no admin token configured they are refused outright -- an unprotected default must not let any local client
drain the only replica of an expert. Read-only Admin calls (GetRouterStats, GetClusterState) keep the bearer rule.

Both the gRPC front and the deployment (behind Serve's own gRPC proxy) ask `admin_denial`; the caller turns a
message into PERMISSION_DENIED.
"""

from __future__ import annotations

from collections.abc import Mapping

from ..experts.token_compare import secret_matches

ADMIN_TOKEN_KEY = "x-expertmesh-admin-token"  # gRPC metadata key (lower case, as gRPC requires)
DESTRUCTIVE_ADMIN_METHODS = frozenset({"KillReplica", "DrainReplica", "UndrainReplica"})
DISABLED_MESSAGE = (f"destructive Admin calls are disabled on this server; start it with --admin-token TOKEN "
                    f"(or $EXPERTMESH_ADMIN_TOKEN, or server.admin_token) and send the token as "
                    f"'{ADMIN_TOKEN_KEY}' metadata")


def admin_denial(configured: str | None, metadata: Mapping[str, str]) -> str | None:
    """None when the call may proceed; otherwise why not (the PERMISSION_DENIED message).

    configured: the server's admin token (None: destructive calls are off); metadata: the call's metadata."""
    if configured is None:
        return DISABLED_MESSAGE
    sent = metadata.get(ADMIN_TOKEN_KEY)
    # Constant-time: the time taken must not tell a caller how much of the token it got right.
    if not secret_matches(sent, configured):
        return f"{ADMIN_TOKEN_KEY}: missing or wrong admin token"
    return None


def admin_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """The metadata a client sends with a destructive Admin call."""
    return ((ADMIN_TOKEN_KEY, token),) if token else ()
