"""Flags of the commands that talk to a running server over gRPC."""

from __future__ import annotations

import argparse
import os

DEFAULT_TARGET = "127.0.0.1:9000"


def token_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--token-ids must be comma-separated integers, got {text!r}") from exc


def add_client_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=DEFAULT_TARGET, help=f"gRPC server (default {DEFAULT_TARGET})")
    p.add_argument("--auth-token", dest="client_token", default=os.environ.get("EXPERTMESH_TOKEN"),
                   help="bearer token (default: $EXPERTMESH_TOKEN)")
    p.add_argument("--tls-ca", metavar="PEM", help="CA certificate to verify a TLS server")
    p.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def add_local_flag(p: argparse.ArgumentParser) -> None:
    """--local plus the in-process mesh settings (the configuration tree's flags without the server's)."""
    from .mesh_flags import IN_PROCESS_GROUPS, add_mesh_flags

    p.add_argument("--local", action="store_true",
                   help="no server: start the mesh and route in this process (embedded Ray, or --address)")
    add_mesh_flags(p, IN_PROCESS_GROUPS)
