"""`expertmesh serve`: the one start-up path (router_service/startup.py), then the router on Ray Serve and the gRPC
front; serve until SIGINT/SIGTERM, then shut everything down in reverse order.

Serve runs with its proxies disabled: clients reach the routers only through the front (localhost by default,
optional TLS and bearer token), and, with server.http_port, the HTTP front (OpenAI API + cluster page,
router_service/http_front.py) on the same deployment handle. Operators who want Serve's own gRPC proxy deploy
`deployment.build_app` with a Serve config instead; both take the same MeshConfig.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from dataclasses import asdict

import ray
from ray import serve

from ..cluster.controller import start_controller
from ..cluster.pool_spec import PoolSpec
from ..cluster.router_gpus import RouterReservation
from ..experts.devices import REFUSAL_FIELD, find_refusal
from ..experts.errors import ConfigError
from .config import MeshConfig
from .deployment import RouterDeployment, router_options
from .front_ready import announce_ready, wait_for_stop_signal
from .grpc_front import start_front
from .http_front import start_http_front
from .startup import MeshRuntime, start_mesh

log = logging.getLogger(__name__)
APP_NAME = "expertmesh"  # the default mesh's Serve application; mesh <id>: expertmesh-<id> (MeshNames.app_name)


async def serve_forever(config: MeshConfig, ready_line: bool = True) -> None:
    config.validate()
    config.server.check_can_listen()  # a port in use fails here, in a line, not after Ray and every actor started
    runtime: MeshRuntime = start_mesh(config)
    server = http_runner = None
    try:
        serve.start(proxy_location="Disabled")
        try:
            handle = serve.run(RouterDeployment.options(**router_options(config)).bind(
                config.to_dict(), asdict(runtime.spec)), name=runtime.spec.names.app_name, route_prefix=None,
                blocking=False)
        except Exception as exc:
            # A router replica given a GPU torch cannot see: its one line, not Serve's traceback around it.
            if (line := router_refusal(exc, runtime.spec.names.app_name)) is not None:
                raise ConfigError(REFUSAL_FIELD, line) from None
            raise
        server, port = await start_front(handle, config.server)
        http_port = None
        if config.server.http_port is not None:
            http_runner, http_port = await start_http_front(handle, config.server, config.model.served_name)
        if ready_line:
            announce_ready(config.server, config.model.served_name, port, http_port)
        loop = asyncio.get_running_loop()
        supervisor = (loop.create_task(_supervise_controller(runtime.spec, runtime.pool.slots, config,
                                                             runtime.reservation))
                      if config.controller.enabled else None)
        await wait_for_stop_signal()
        if supervisor is not None:
            supervisor.cancel()
        print("expertmesh: shutting down", file=sys.stderr, flush=True)
    finally:
        if http_runner is not None:
            await http_runner.cleanup()
        if server is not None:
            await server.stop(grace=5)
        if ray.is_initialized():
            try:
                serve.shutdown()
            except Exception:  # Serve may never have started
                log.debug("serve.shutdown failed", exc_info=True)
        runtime.stop()


def router_refusal(exc: BaseException, app: str) -> str | None:
    """The refusal line of a router replica (experts/devices.py) behind a failed `serve.run`: Serve's exception only
    says the deployment failed; the replica's error is in the deployment's status message."""
    texts = [str(exc)]
    try:
        status = serve.status().applications.get(app)
        if status is not None:
            texts += [status.message, *(d.message for d in status.deployments.values())]
    except Exception:  # noqa: BLE001 - no Serve status to read: only the exception's own text
        log.debug("serve.status failed", exc_info=True)
    return next((line for text in texts if (line := find_refusal(text or "")) is not None), None)


async def _supervise_controller(spec: PoolSpec, slots, config: MeshConfig, reservation: RouterReservation,
                                every_s: float = 2.0) -> None:
    """Keep the controller running: Ray restarts it after a crash or node loss (max_restarts=-1), and this loop
    recreates it if it was killed outright, then (re)starts its watch. Its own record in the GCS KV store means a
    new incarnation carries on with the same epoch and placement."""
    while True:
        await asyncio.sleep(every_s)
        try:
            handle = ray.get_actor(spec.names.controller, namespace=spec.names.namespace)
            await asyncio.wait_for(handle.start.remote(), timeout=30)
        except ValueError:
            log.warning("controller is gone; starting a new one")
            try:
                await asyncio.get_running_loop().run_in_executor(
                    None, lambda: start_controller(spec, slots, config.controller, fresh=False,
                                                   reservation=reservation))
            except Exception:  # e.g. the replacement was killed while starting: try again next round
                log.warning("could not start a controller; will retry", exc_info=True)
        except Exception:
            log.warning("controller did not answer; will retry", exc_info=True)
