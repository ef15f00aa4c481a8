"""`expertmesh serve`: serve a checkpoint over gRPC until Ctrl-C / SIGTERM (router_service/server.py)."""

from __future__ import annotations

import argparse

from .mesh_flags import add_mesh_flags, mesh_config_from_args


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve a checkpoint over gRPC until Ctrl-C / SIGTERM")
    add_mesh_flags(p)


def run(args: argparse.Namespace) -> int:
    import asyncio

    # Checked before the server module (Ray, Serve, gRPC, torch) is imported: a bad setting is refused in its one
    # line without paying for them.
    config = mesh_config_from_args(args)
    from ...router_service.server import serve_forever

    asyncio.run(serve_forever(config))
    return 0
