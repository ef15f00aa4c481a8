"""`expertmesh front`: expertmesh's gRPC (and HTTP) front for a mesh that `serve deploy` or KubeRay runs, so its
streams resume on a live router replica when theirs dies (router_service/front_only.py)."""

from __future__ import annotations

import argparse

from .mesh_flags import add_mesh_flags, mesh_config_from_args


def add_parser(sub) -> None:
    p = sub.add_parser("front", help="serve the gRPC/HTTP fronts (resuming streams, TLS, token) for a mesh that "
                                     "`serve deploy` runs on the Ray cluster at --address")
    add_mesh_flags(p, groups=("server",), extra=("ray.address", "mesh.id", "model.name"))


def run(args: argparse.Namespace) -> int:
    import asyncio

    config = mesh_config_from_args(args)
    from ...router_service.front_only import front_forever

    asyncio.run(front_forever(config))
    return 0
