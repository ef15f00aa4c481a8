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
"""

from __future__ import annotations

import sys

from ray import serve

from ..cluster.naming import MeshNames
from .config import ConfigError, MeshConfig
from .front_ready import announce_ready, wait_for_stop_signal
from .grpc_front import start_front
from .http_front import start_http_front
from .startup import connect_ray

DEPLOYMENT = "router"  # the router deployment's name in every mesh's Serve application (deployment.py)


async def front_forever(config: MeshConfig, ready_line: bool = True) -> None:
    config.validate()
    if config.ray.address == "local":
        raise ConfigError("ray.address", "expertmesh front joins the Ray cluster that runs the mesh: pass --address "
                                         "HOST:PORT (its GCS address)")
    config.server.check_can_listen()  # a port in use fails here, in a line, before Ray is joined
    names = MeshNames.of(config.mesh.id)
    connect_ray(config.ray, namespace=names.namespace)
    # A handle to a deployment this process did not deploy: Serve finds it by app and name (it waits for the
    # application to exist; `serve status` shows whether it does).
    handle = serve.get_deployment_handle(DEPLOYMENT, app_name=names.app_name)
    server = http_runner = None
    try:
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
