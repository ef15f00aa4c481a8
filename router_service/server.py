"""`expertmesh serve`: start (or join) Ray, start the expert pool, deploy the router on Serve, open the gRPC front,
serve until SIGINT/SIGTERM, then shut everything down in reverse order.

Serve runs with its proxies disabled: clients reach the routers only through the front (localhost by default,
optional TLS and bearer token). Operators who want Serve's own gRPC proxy deploy `deployment.build_app` with a
Serve config instead.
"""

from __future__ import annotations

import asyncio
import logging
import math
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

import ray
from ray import serve

from ..cluster.controller import ControllerConfig, start_controller
from ..cluster.naming import CONTROLLER_NAME, NAMESPACE
from ..cluster.pool_spec import PoolSpec
from ..cluster.table_store import read_table
from ..experts.checkpoint import CheckpointReader
from ..experts.telemetry import TracingConfig
from ..experts.tokenizer import DEFAULT_MODEL_DIR
from ..experts.weights import check_checkpoint
from .batching import BatcherConfig
from .deployment import RouterDeployment, RouterSettings
from .dispatch import FailoverConfig
from .engine import connect_ray
from .expert_pool import ExpertPool
from .grpc_front import FrontSettings, start_front
from .pool_layout import pool_layout
from .transports.base import check_transport

log = logging.getLogger(__name__)
APP_NAME = "expertmesh"
DEFAULT_MODEL_NAME = "expertmesh-demo"


@dataclass
class ServeConfig:
    model_dir: str | None = None
    address: str = "local"
    front: FrontSettings = FrontSettings()
    model_name: str | None = None  # default: the checkpoint folder's name; "expertmesh-demo" for the embedded one
    replicas_per_expert: int = 1
    router_replicas: int = 1
    router_autoscale: tuple[int, int] | None = None  # (min, max) replicas; Serve scales on ongoing requests
    capacity_factor: float | None = None
    batcher: BatcherConfig = BatcherConfig()
    failover: FailoverConfig = FailoverConfig()
    controller: ControllerConfig = ControllerConfig()
    num_cpus_per_actor: float | None = None
    router_threads: int = 1
    tracing: TracingConfig = TracingConfig()  # routers and expert actors (README: Metrics and traces)
    transport: str = "refs"  # expert transport: "refs" | "grpc" | "compiled" (README: Transports)
    overlap: bool = False  # ping-pong two micro-batches per step (README: Transports / Overlap)
    placement: str | None = None  # PLACEMENT.json from `expertmesh plan`: one actor per GPU from it

    def validate(self) -> ServeConfig:
        if self.model_dir is not None and not Path(self.model_dir).is_dir():
            raise ValueError(f"model: {self.model_dir} is not a folder")
        if self.replicas_per_expert < 1:
            raise ValueError(f"replicas_per_expert: must be ≥ 1, got {self.replicas_per_expert}")
        if self.router_replicas < 1:
            raise ValueError(f"router_replicas: must be ≥ 1, got {self.router_replicas}")
        if self.router_autoscale is not None:
            low, high = self.router_autoscale
            if not 1 <= low <= high:
                raise ValueError(f"router_autoscale: need 1 ≤ min ≤ max, got {low}:{high}")
        if self.capacity_factor is not None and not (self.capacity_factor > 0 and math.isfinite(self.capacity_factor)):
            raise ValueError(f"capacity_factor: must be a positive finite number, got {self.capacity_factor}")
        self.front.validate()
        self.batcher.validate()
        self.failover.validate()
        self.controller.validate()
        self.tracing.validate()
        check_transport(self.transport)
        if self.overlap and self.capacity_factor is not None:
            raise ValueError("overlap: cannot be combined with capacity_factor "
                             "(capacity is per step; micro-batches would change which tokens overflow)")
        if (self.placement is not None or self.controller.elastic is not None) and self.replicas_per_expert != 1:
            raise ValueError("replicas_per_expert: a planned placement sets the replicas; leave it at 1")
        return self

    @property
    def resolved_model_dir(self) -> Path:
        return (Path(self.model_dir) if self.model_dir else DEFAULT_MODEL_DIR).resolve()

    @property
    def resolved_model_name(self) -> str:
        if self.model_name:
            return self.model_name
        return DEFAULT_MODEL_NAME if self.model_dir is None else self.resolved_model_dir.name


async def serve_forever(config: ServeConfig, ready_line: bool = True) -> None:
    config.validate()
    reader = CheckpointReader(config.resolved_model_dir)
    check_checkpoint(reader)
    owns_ray = connect_ray(config.address)
    pool = None
    server = None
    try:
        groups, slots = pool_layout(reader.config, config.replicas_per_expert, config.num_cpus_per_actor,
                                    config.placement, config.controller.elastic_config())
        spec = PoolSpec(str(config.resolved_model_dir), "float32", groups,
                        tracing=config.tracing.as_dict() if config.tracing.enabled else None)
        pool = ExpertPool(spec, config.num_cpus_per_actor, slots=slots)
        start_controller(spec, pool.slots, config.controller)
        settings = RouterSettings(
            pool=RouterSettings.pool_dict(spec), model_name=config.resolved_model_name,
            capacity_factor=config.capacity_factor, batcher=vars(config.batcher).copy(),
            torch_threads=config.router_threads, failover=vars(config.failover).copy(), transport=config.transport,
            overlap=config.overlap,
            tracing=config.tracing.as_dict() if config.tracing.enabled else {},
        )
        serve.start(proxy_location="Disabled")
        options: dict = {"num_replicas": config.router_replicas}
        if config.router_autoscale is not None:
            low, high = config.router_autoscale
            options = {"autoscaling_config": {"min_replicas": low, "max_replicas": high,
                                              "target_ongoing_requests": 32}}
        handle = serve.run(RouterDeployment.options(**options).bind(vars(settings)), name=APP_NAME,
                           route_prefix=None, blocking=False)
        server, port = await start_front(handle, config.front)
        scheme = "tls" if config.front.tls_cert else "plaintext"
        if ready_line:
            # Tests and scripts wait for this exact line.
            print(f"expertmesh serving {config.resolved_model_name} on {config.front.host}:{port} ({scheme})",
                  flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        supervisor = loop.create_task(_supervise_controller(spec, pool.slots,
                                                            config.controller))
        await stop.wait()
        supervisor.cancel()
        print("expertmesh: shutting down", file=sys.stderr, flush=True)
    finally:
        if server is not None:
            await server.stop(grace=5)
        if ray.is_initialized():
            stop_controller()
            stop_remapped_actors()
        if ray.is_initialized():
            try:
                serve.shutdown()
            except Exception:  # Serve may never have started
                log.debug("serve.shutdown failed", exc_info=True)
        if pool is not None:
            pool.shutdown()
        if owns_ray and ray.is_initialized():
            ray.shutdown()


async def _supervise_controller(spec: PoolSpec, slots, config: ControllerConfig, every_s: float = 2.0) -> None:
    """Keep the controller running: Ray restarts it after a crash or node loss (max_restarts=-1), and this loop
    recreates it if it was killed outright, then (re)starts its watch. Its own record in the GCS KV store means a
    new incarnation carries on with the same epoch and placement."""
    while True:
        await asyncio.sleep(every_s)
        try:
            handle = ray.get_actor(CONTROLLER_NAME, namespace=NAMESPACE)
            await asyncio.wait_for(handle.start.remote(), timeout=30)
        except ValueError:
            log.warning("controller is gone; starting a new one")
            try:
                await asyncio.get_running_loop().run_in_executor(
                    None, lambda: start_controller(spec, slots, config, fresh=False))
            except Exception:  # e.g. the replacement was killed while starting: try again next round
                log.warning("could not start a controller; will retry", exc_info=True)
        except Exception:
            log.warning("controller did not answer; will retry", exc_info=True)


def stop_remapped_actors() -> None:
    """Stop the expert actors a live remap started (the pool stops the ones it started itself)."""
    try:
        record = read_table()
    except Exception:
        return
    for name in (record or {}).get("actor_shards", {}):
        try:
            ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)
        except ValueError:
            pass


def stop_controller() -> None:
    try:
        ray.kill(ray.get_actor(CONTROLLER_NAME, namespace=NAMESPACE), no_restart=True)
    except ValueError:
        pass
