"""The Python API: start (or join) Ray, start the expert pool, and route requests from this process.

    from expertmesh.router_service.engine import ExpertMesh, MeshConfig
    with ExpertMesh(MeshConfig()) as mesh:             # embedded default model, embedded Ray
        print(mesh.generate(prompt="def ", max_tokens=20).text)
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import ray

from ..cluster.controller import ControllerConfig, start_controller
from ..cluster.elastic import ElasticConfig
from ..cluster.naming import NAMESPACE
from ..cluster.pool_spec import PoolSpec
from ..experts.checkpoint import CheckpointReader
from ..experts.telemetry import TracingConfig
from ..experts.tokenizer import DEFAULT_MODEL_DIR
from ..experts.weights import check_checkpoint
from .dispatch import FailoverConfig
from .expert_pool import ExpertPool
from .observability import ObservabilityConfig
from .pool_layout import pool_layout
from .router import Generation, RequestError, Router
from .transports.base import TRANSPORTS

__all__ = ["ExpertMesh", "MeshConfig", "Generation", "RequestError"]
DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class MeshConfig:
    model_dir: str | None = None  # None: the embedded default model shipped in the package
    address: str = "local"  # "local" starts an embedded Ray; otherwise the address of a cluster to join
    replicas_per_expert: int = 1
    dtype: str = "float32"
    capacity_factor: float | None = None  # None: no cap, no token is ever moved or dropped
    num_cpus_per_actor: float | None = None  # None: share each node's CPUs among its actors (≤ 1 each)
    actor_start_timeout_s: float = 180.0
    ray_num_cpus: int | None = None  # only for an embedded Ray
    restore_experts: bool = False  # run the controller, which restores killed expert actors
    failover: FailoverConfig = field(default_factory=FailoverConfig)
    transport: str = "refs"  # how expert calls travel: "refs" | "grpc" | "compiled" (README: Transports)
    overlap: bool = False  # ping-pong two micro-batches per step, expert rounds under dense work (README: Overlap)
    tracing: TracingConfig = field(default_factory=TracingConfig)  # off by default (README: Metrics and traces)
    observability: ObservabilityConfig = field(default_factory=ObservabilityConfig)  # load window, metrics
    placement: str | None = None  # a PLACEMENT.json (`expertmesh plan`): start one actor per GPU from it
    elastic: ElasticConfig | None = None  # rebalance / autoscale replicas from load (runs the controller)

    def validate(self) -> MeshConfig:
        for name in ("tracing", "observability"):
            try:
                getattr(self, name).validate()
            except ValueError as exc:
                raise RequestError(name, str(exc)) from None
        if self.transport not in TRANSPORTS:
            raise RequestError("transport", f"must be one of {TRANSPORTS}, got {self.transport!r}")
        if self.model_dir is not None and not Path(self.model_dir).is_dir():
            raise RequestError("model_dir", f"{self.model_dir} is not a folder")
        if not isinstance(self.replicas_per_expert, int) or self.replicas_per_expert < 1:
            raise RequestError("replicas_per_expert", f"must be an integer ≥ 1, got {self.replicas_per_expert!r}")
        if self.dtype not in DTYPES:
            raise RequestError("dtype", f"must be one of {DTYPES}, got {self.dtype!r}")
        if self.capacity_factor is not None and not (
            self.capacity_factor > 0 and math.isfinite(self.capacity_factor)
        ):
            raise RequestError("capacity_factor", f"must be a positive finite number, got {self.capacity_factor}")
        if self.overlap and self.capacity_factor is not None:
            raise RequestError("overlap", "cannot be combined with capacity_factor (capacity is per step; "
                                          "micro-batches would change which tokens overflow)")
        if self.num_cpus_per_actor is not None and not self.num_cpus_per_actor > 0:
            raise RequestError("num_cpus_per_actor", f"must be > 0, got {self.num_cpus_per_actor}")
        if self.elastic is not None:
            try:
                self.elastic.validate()
            except ValueError as exc:
                raise RequestError("elastic", str(exc)) from None
        if (self.placement is not None or self.elastic is not None) and self.replicas_per_expert != 1:
            raise RequestError("replicas_per_expert", "a planned placement sets the replicas; leave it at 1")
        return self

    @property
    def resolved_model_dir(self) -> Path:
        return (Path(self.model_dir) if self.model_dir else DEFAULT_MODEL_DIR).resolve()


def connect_ray(address: str, num_cpus: int | None = None) -> bool:
    """Start or join Ray unless this process already did; True when this call started the connection."""
    if ray.is_initialized():
        return False
    if address == "local":
        # "local" never joins a cluster that some earlier run left recorded on this machine.
        ray.init(address="local", namespace=NAMESPACE, num_cpus=num_cpus, include_dashboard=False,
                 logging_level=logging.WARNING)
    else:
        ray.init(address=address, namespace=NAMESPACE, logging_level=logging.WARNING)
    return True


class ExpertMesh:
    """Expert pool + a router in this process."""

    def __init__(self, config: MeshConfig | None = None):
        self.config = (config or MeshConfig()).validate()
        reader = CheckpointReader(self.config.resolved_model_dir)
        check_checkpoint(reader)  # fail here, naming file and key, before any actor starts
        self._owns_ray = connect_ray(self.config.address, self.config.ray_num_cpus)
        tracing = self.config.tracing
        groups, slots = pool_layout(reader.config, self.config.replicas_per_expert, self.config.num_cpus_per_actor,
                                    self.config.placement, self.config.elastic)
        spec = PoolSpec(str(self.config.resolved_model_dir), self.config.dtype, groups,
                        tracing=tracing.as_dict() if tracing.enabled else None)
        self.pool: ExpertPool | None = None
        self.controller = None
        try:
            self.pool = ExpertPool(spec, self.config.num_cpus_per_actor, self.config.actor_start_timeout_s,
                                   slots=slots)
            controller_config = ControllerConfig(
                elastic=asdict(self.config.elastic) if self.config.elastic is not None else None)
            self.controller = (start_controller(spec, self.pool.slots, controller_config)
                               if self.config.restore_experts or self.config.elastic is not None else None)
            self.router = Router(spec, self.pool.actors, self.config.capacity_factor, reader=reader,
                                 failover=self.config.failover, transport=self.config.transport,
                                 overlap=self.config.overlap,
                                 observability=self.config.observability, tracing=tracing)
        except BaseException:
            self.shutdown()
            raise

    # The router's surface, for callers and tests.
    @property
    def model(self):
        return self.router.model

    @property
    def backend(self):
        return self.router.backend

    @property
    def model_config(self):
        return self.router.model_config

    @property
    def actors(self):
        return self.pool.actors

    @property
    def slots(self):
        return self.pool.slots

    def actor_info(self) -> list[dict]:
        return self.pool.info()

    def score(self, token_ids: list[int]):
        return self.router.score(token_ids)

    def score_batch(self, batch: list[list[int]]):
        return self.router.score_batch(batch)

    def generate(self, *args, **kwargs) -> Generation:
        return self.router.generate(*args, **kwargs)

    def shutdown(self) -> None:
        added: list[str] = []
        if getattr(self, "router", None) is not None:
            self.router.close()  # a compiled graph goes before its actors
            added = [n for n in self.router.table.actors if self.pool is None or n not in self.pool.actors]
        if self.controller is not None:
            ray.kill(self.controller, no_restart=True)
            self.controller = None
        for name in added:  # replicas a live remap added: the pool did not start them, so it does not stop them
            try:
                ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)
            except ValueError:
                pass
        if self.pool is not None:
            self.pool.shutdown()
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()
            self._owns_ray = False

    def __enter__(self) -> ExpertMesh:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
