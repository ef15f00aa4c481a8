"""`expertmesh front`: expertmesh's gRPC (and HTTP) front for a mesh that `serve deploy` or KubeRay runs, so its
streams resume on a live router replica when theirs dies (router_service/front_only.py); or one front for several
meshes on the cluster (repeated --mesh-id, or --all-meshes), choosing each request's mesh by its model."""

from __future__ import annotations

import argparse

from .mesh_flags import add_mesh_flags, mesh_config_from_args


def add_parser(sub) -> None:
    p = sub.add_parser("front", help="serve the gRPC/HTTP fronts (resuming streams, TLS, token) for a mesh that "
                                     "`serve deploy` runs on the Ray cluster at --address, or for several")
    add_mesh_flags(p, groups=("server",), extra=("ray.address", "model.name"))
    # Repeatable here (the mesh.id field names one mesh): the meshes this front serves.
    p.add_argument("--mesh-id", dest="front_mesh_ids", action="append", default=None, metavar="ID",
                   help="a mesh to serve (default: the config's mesh.id, else 'default'); repeat it to serve "
                        "several meshes from one front, each request going to the mesh that serves its `model`")
    p.add_argument("--all-meshes", action="store_true",
                   help="serve every mesh running on the cluster when the front starts (the Serve applications "
                        "named expertmesh and expertmesh-<id>); model names must be unique across them")


def run(args: argparse.Namespace) -> int:
    import asyncio

    config = mesh_config_from_args(args)
    from ...router_service.front_only import front_forever

    asyncio.run(front_forever(config, mesh_ids=args.front_mesh_ids or (), all_meshes=args.all_meshes))
    return 0
