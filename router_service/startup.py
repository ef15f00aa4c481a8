"""The one start-up path: configuration -> Ray -> expert pool -> controller. Every entry point goes through it:

    ExpertMesh (router_service/mesh.py)       start_mesh(config)                 + a Router in the calling process
    expertmesh serve (router_service/server.py)  start_mesh(config)              + Serve router deployment + gRPC front
    Serve YAML / KubeRay (deployment.build_app)  start_mesh(config, detached=True) + the router deployment
    expertmesh drill                            runs `expertmesh serve --config <its MeshConfig as JSON>`

So a checkpoint check, a placement file, elasticity, tracing or a dtype behave the same whichever way one starts.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import ray

from ..cluster.controller import start_controller
from ..cluster.naming import DEFAULT_MESH_ID, NAMESPACE, MeshNames, is_expert_actor_name
from ..cluster.pool_spec import PoolSpec
from ..cluster.router_gpus import NO_RESERVATION, RouterReservation, expert_nodes
from ..cluster.table_store import read_table
from ..experts.checkpoint import CheckpointReader
from ..experts.hub_token import publish_hub_token
from ..experts.model_source import dense_tensors, open_checkpoint
from ..experts.transport_secret import transport_secret
from ..experts.weights import check_checkpoint
from .config import EMBEDDED_RAY_SYSTEM_CONFIG, MeshConfig, RayConfig
from .expert_pool import ExpertPool, cluster_nodes
from .gpu_fit import fit_gpu_memory, keep_router_gpus
from .pool_layout import pool_layout
from .ray_join import prepare_join

log = logging.getLogger(__name__)
# Live runtimes (by id) on a Ray this process started: several meshes (mesh ids) may share it, and the last to stop
# shuts it down, so closing one ExpertMesh leaves another of this process serving.
_RAY_SHARERS: set[int] = set()


def connect_ray(config: RayConfig, namespace: str = NAMESPACE) -> bool:
    """Start or join Ray unless this process already did; True when this call started the connection. namespace:
    the driver's (its mesh's); the mesh's actors name theirs explicitly, so a driver may serve several meshes."""
    if ray.is_initialized():
        return False
    if config.address == "local":
        # "local" never joins a cluster that some earlier run left recorded on this machine, and its Ray listens on
        # loopback only (README: Security).
        with _loopback_node():
            ray.init(address="local", namespace=namespace, num_cpus=config.num_cpus, include_dashboard=False,
                     logging_level=logging.WARNING, _system_config=dict(EMBEDDED_RAY_SYSTEM_CONFIG))
    else:
        prepare_join(config.address)  # token authentication, or one line saying why the cluster cannot be joined
        ray.init(address=config.address, namespace=namespace, logging_level=logging.WARNING)
    return True


@contextlib.contextmanager
def _loopback_node() -> Iterator[None]:
    """Start a single-machine Ray with 127.0.0.1 as its node IP, so every server Ray binds to the node IP (GCS,
    raylet, object manager, workers, dashboard agent, runtime-env agent; the metrics export port, which has no
    authentication, binds to loopback only when the node IP is loopback) is reachable from this machine only.

    Ray 2.60 has no option for it: `ray.init(_node_ip_address="127.0.0.1")` and `ray start --node-ip-address`
    replace loopback with the routable IP. Only its single-machine mode (the default on macOS and Windows, or
    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 before Ray is imported) keeps it; that mode is read from
    `ray_constants.ENABLE_RAY_CLUSTER` when ray.init picks the node IP, so it is switched for this call only. Ray
    processes get the node IP on their command lines. Should a Ray release drop the constant, Ray starts as before,
    on the routable IP (a warning says so)."""
    from ray._private import ray_constants

    if not hasattr(ray_constants, "ENABLE_RAY_CLUSTER"):
        log.warning("this Ray has no single-machine mode: the local Ray listens on the routable node IP")
        yield
        return
    before = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = before


@dataclass
class MeshRuntime:
    """What `start_mesh` started; `stop()` takes it down in reverse order."""

    config: MeshConfig
    reader: CheckpointReader  # the checkpoint's config and dense weights, for an in-process router
    owns_ray: bool  # this process started (or joined) Ray for its meshes, so the last of them to stop disconnects
    spec: PoolSpec | None = None  # the expert actors: name -> shards, model, dtype (what routers connect to)
    pool: ExpertPool | None = None
    controller: ray.actor.ActorHandle | None = None
    # The GPUs and CPUs the expert pool left to Serve router replicas (cluster/router_gpus.py); the controller
    # plans around it too.
    reservation: RouterReservation = NO_RESERVATION

    def stop(self, keep_ray: bool = False) -> None:
        """Controller, then the actors a live remap added (the pool did not start those), then the pool, then Ray
        (when start_mesh connected it, keep_ray is False and no other mesh of this process uses it). Safe to call
        twice."""
        if not ray.is_initialized():
            _RAY_SHARERS.discard(id(self))
            return
        if self.controller is not None:
            stop_controller(self.config.mesh.id)
            self.controller = None
        if self.pool is not None:
            # Only a runtime that started its pool: a start refused because the mesh id is taken must not stop the
            # running mesh's actors.
            stop_remapped_actors(self.config.mesh.id)
            self.pool.shutdown()
            self.pool = None
        if self.owns_ray:
            _RAY_SHARERS.discard(id(self))
            if not keep_ray and not _RAY_SHARERS:  # no other mesh of this process still uses it
                ray.shutdown()
            self.owns_ray = False


def start_mesh(config: MeshConfig, detached: bool = False, reuse: bool = False,
               serve_routers: bool = True) -> MeshRuntime:
    """Validate `config`, check the checkpoint (naming file and key) before anything starts, connect Ray, start the
    expert pool (default layout, placement file or elastic layout) and, unless config.controller.enabled is False,
    the controller. detached/reuse: for a Serve-config deployment, whose builder process exits (actors and
    controller outlive it; a redeploy adopts the running ones). serve_routers: Serve router replicas will be
    deployed after this, so the pool leaves them the GPUs router.gpus asks for (False for ExpertMesh, whose router
    runs in the calling process and is not placed by Ray)."""
    config.validate()
    # Of a Hub repo this process fetches config, tokenizer, index and the safetensors headers (the dense tensors only
    # if it routes itself, ExpertMesh); each node fetches the bytes of its own processes' tensors.
    reader = open_checkpoint(config.model.source, config.model.revision, dense_tensors)
    check_checkpoint(reader)  # fail here, naming file and key, before any actor starts (headers only)
    # A Ray another mesh of this process started is shared with it (a Ray the caller started stays the caller's).
    started = connect_ray(config.ray, MeshNames.of(config.mesh.id).namespace)
    if started:
        _RAY_SHARERS.clear()  # runtimes left from a Ray connection that is gone
    owns_ray = started or bool(_RAY_SHARERS)
    runtime = MeshRuntime(config, reader, owns_ray)
    if owns_ray:
        _RAY_SHARERS.add(id(runtime))
    try:
        transport_secret()  # the expert transport's cluster secret exists before any actor or router needs it
        publish_hub_token()  # this driver's HF_TOKEN, for nodes started without one (gated repos)
        elastic = config.controller.elastic
        nodes = cluster_nodes()
        # Whole GPUs (and CPUs) for the router replicas that must place at start; the pool plans onto the rest.
        reservation = keep_router_gpus(config, nodes) if serve_routers else NO_RESERVATION
        groups, slots = pool_layout(reader.config, config.experts.replicas_per_expert,
                                    config.experts.num_cpus_per_actor, config.experts.placement, elastic,
                                    config.experts.layout, nodes=expert_nodes(nodes, reservation))
        # On GPU nodes: the pool fits by bytes, or the autoscaler adds GPUs, or one line says what is missing.
        slots, runtime.reservation = fit_gpu_memory(config, reader, groups, slots, reservation)
        tracing = config.tracing
        runtime.spec = PoolSpec(config.model.source, config.model.dtype, groups,
                                tracing=tracing.as_dict() if tracing.enabled else None,
                                # the commit `model.revision` resolved to: every actor and router, restored ones
                                # too, reads the same weights even if the branch moves (and finds its node's cache
                                # without asking the Hub)
                                revision=reader.commit or config.model.revision, memory_gb=config.experts.memory_gb,
                                eviction=config.experts.eviction,
                                quant=config.experts.quant, gpu_without_cuda=config.devices.gpu_without_cuda,
                                mesh_id=config.mesh.id)
        runtime.pool = ExpertPool(runtime.spec, config.experts.num_cpus_per_actor, config.experts.start_timeout_s,
                                  detached=detached, reuse=reuse, slots=slots)
        if config.controller.enabled:
            runtime.controller = start_controller(runtime.spec, runtime.pool.slots, config.controller,
                                                  fresh=not reuse, reservation=runtime.reservation)
    except BaseException:
        runtime.stop()
        raise
    return runtime


def stop_remapped_actors(mesh_id: str = DEFAULT_MESH_ID) -> None:
    """Stop the expert actors a live remap or a restore of mesh `mesh_id` started (the pool stops the ones it started
    itself): those in the mesh's table, and every other expert actor in the mesh's namespace, because a remap the
    stopped controller was in the middle of has started its new actors before the table names them."""
    names = MeshNames.of(mesh_id)
    try:
        record = read_table(mesh_id)
        running = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                   if a["namespace"] == names.namespace and is_expert_actor_name(a["name"])]
    except Exception:  # no table store (Ray going down): nothing a remap could have added is reachable anyway
        return
    for name in sorted(set((record or {}).get("actor_shards", {})) | set(running)):
        try:
            ray.kill(ray.get_actor(name, namespace=names.namespace), no_restart=True)
        except ValueError:
            pass


def stop_controller(mesh_id: str = DEFAULT_MESH_ID) -> None:
    names = MeshNames.of(mesh_id)
    try:
        ray.kill(ray.get_actor(names.controller, namespace=names.namespace), no_restart=True)
    except ValueError:
        pass
