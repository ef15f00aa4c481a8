"""`expertmesh front`: expertmesh's gRPC front (and, with server.http_port, the HTTP front) for a mesh that `serve
deploy` / `serve run` / a KubeRay RayService already runs, so clients of such a cluster get what `expertmesh serve`
clients get: streams (and read-only unary calls) that resume on a live router replica when theirs dies, TLS, the
bearer token, a chosen listen address.

Why: behind Ray Serve's own gRPC proxy a router replica killed mid-stream fails its streams. Ray 2.60's router
retries a request only while no replica has accepted it (serve/_private/router.py `route_and_send_request`,
replica_result.py: a stream's UNAVAILABLE becomes ActorUnavailableError before acceptance); after that the error
reaches the proxy, which ends the call with it. Serve's proxy has no hook to resume, and which tokens the client has
is known only where they are relayed. This process relays them, so it resumes (grpc_front.py, http_resume.py).

It starts nothing on the cluster: it joins Ray (ray.address), takes a handle to the mesh's router deployment (app
`expertmesh`, or `expertmesh-<mesh.id>`), and serves until SIGINT/SIGTERM. Run it anywhere that reaches the cluster
(the head node, or a pod beside it) and point clients at it instead of Serve's proxy; Serve's proxy keeps working.

Several meshes (models) on one cluster: `--mesh-id a --mesh-id b`, or `--all-meshes` (every `expertmesh` /
`expertmesh-<id>` Serve application running when the front starts). One front then serves them all, each request
going to the mesh its `model` names (router_service/model_routes.py); each mesh keeps its own resuming streams.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence

from ray import serve

from ..cluster.naming import MeshNames, mesh_ids_of_apps
from .config import ConfigError, MeshConfig
from .front_ready import announce_ready, wait_for_stop_signal
from .grpc_front import start_front
from .http_front import start_http_front
from .model_routes import model_routes
from .startup import connect_ray

DEPLOYMENT = "router"  # the router deployment's name in every mesh's Serve application (deployment.py)


def meshes_on_cluster(address: str) -> list[str]:
    """The mesh ids of the expertmesh Serve applications running on the joined cluster, sorted (the default mesh
    first); ConfigError naming ray.address when there is none."""
    apps = sorted(serve.status().applications)
    found = mesh_ids_of_apps(apps)
    if not found:
        raise ConfigError("ray.address", f"no expertmesh mesh runs on the Ray cluster at {address} (its Serve "
                                         f"applications: {', '.join(apps) or 'none'}); deploy one first, or name "
                                         "the mesh with --mesh-id")
    return found


async def front_forever(config: MeshConfig, ready_line: bool = True, mesh_ids: Sequence[str] = (),
                        all_meshes: bool = False) -> None:
    """Serve the fronts for the mesh `config.mesh.id` (mesh_ids empty, all_meshes False: the single-mesh front) or
    for several: `mesh_ids`, or every mesh on the cluster (all_meshes)."""
    config.validate()
    if config.ray.address == "local":
        raise ConfigError("ray.address", "expertmesh front joins the Ray cluster that runs the mesh: pass --address "
                                         "HOST:PORT (its GCS address)")
    if all_meshes and mesh_ids:
        raise ConfigError("mesh.id", "give --mesh-id or --all-meshes, not both")
    for mesh_id in mesh_ids:
        try:
            MeshNames.of(mesh_id)
        except ValueError as exc:
            raise ConfigError("mesh.id", str(exc)) from None
    several = all_meshes or len(mesh_ids) > 1
    if several and config.model.name:
        raise ConfigError("model.name", "a front over several meshes serves each under the name its mesh serves; "
                                        "drop --model-name (set it where each mesh is deployed)")
    config.server.check_can_listen()  # a port in use fails here, in a line, before Ray is joined
    names = MeshNames.of(mesh_ids[0] if mesh_ids else config.mesh.id)
    connect_ray(config.ray, namespace=names.namespace)
    server = http_runner = None
    try:
        if several:
            ids = meshes_on_cluster(config.ray.address) if all_meshes else list(mesh_ids)
            # Handles to deployments this process did not deploy: Serve finds each by app and name (it waits for
            # the application to exist; `serve status` shows whether it does).
            handles = {m: serve.get_deployment_handle(DEPLOYMENT, app_name=MeshNames.of(m).app_name) for m in ids}
            served = await asyncio.gather(*(h.served_model_name.remote() for h in handles.values()))
            routes = model_routes(zip(handles, served, strict=True))  # a name two meshes serve: ConfigError
            by_model = {model: handles[mesh_id] for model, mesh_id in routes.items()}
            server, port = await start_front(by_model, config.server)
            http_port = None
            if config.server.http_port is not None:
                http_runner, http_port = await start_http_front(by_model, config.server)
            model_name = ",".join(by_model)  # one word: the ready line's model field
        else:
            handle = serve.get_deployment_handle(DEPLOYMENT, app_name=names.app_name)
            # The name the deployed routers serve under (the HTTP front refuses other names), unless given here.
            model_name = config.model.name or await handle.served_model_name.remote()
            server, port = await start_front(handle, config.server)
            http_port = None
            if config.server.http_port is not None:
                http_runner, http_port = await start_http_front(handle, config.server, model_name)
        if ready_line:  # the same lines as `expertmesh serve`'s, so the same scripts and tests wait for them
            announce_ready(config.server, model_name, port, http_port)
        await wait_for_stop_signal()
        print("expertmesh: shutting down the front", file=sys.stderr, flush=True)
    finally:
        if http_runner is not None:
            await http_runner.cleanup()
        if server is not None:
            await server.stop(grace=5)
