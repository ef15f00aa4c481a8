"""A multi-node `ray.cluster_utils.Cluster` whose worker nodes declare GPUs (no real ones), with this driver joined."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import ray
from ray.cluster_utils import Cluster

from expertmesh.cluster.naming import NAMESPACE
from expertmesh.experts.devices import DevicesConfig

# The nodes' GPUs are declared, not real, and this box's torch sees no CUDA: an expert actor or router replica Ray
# gives one of them refuses to start unless told to compute on the CPU (README: Data types and devices). Every test
# that runs actors or routers on such nodes says so with one of these.
FAKE_GPUS = {"gpu_without_cuda": "cpu"}  # the `devices` section of a MeshConfig tree
FAKE_GPU_DEVICES = DevicesConfig(**FAKE_GPUS)
FAKE_GPU_FLAGS = ("--gpu-without-cuda", "cpu")  # the same for `expertmesh serve`


@contextmanager
def cluster_with_gpus(*gpus_per_node: int, cpus_per_node: int = 2, dashboard: bool = False) -> Iterator[Cluster]:
    """A CPU-only head (2 CPUs) and one worker per entry of gpus_per_node; shut down, driver detached, after.
    dashboard: start Ray's dashboard (its state API, `ray.util.state`, needs it); off, a process less to start."""
    cluster, _ = start_cluster({"num_cpus": 2, "num_gpus": 0, "include_dashboard": dashboard},
                               [{"num_cpus": cpus_per_node, "num_gpus": gpus} for gpus in gpus_per_node])
    ray.init(address=cluster.address, namespace=NAMESPACE)
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


# What ray.init raises when a fresh local node failed to come up (both retried once, after a pause).
_START_FAILURES = ("timed out during startup", "Timed out waiting for file")


def start_cluster(head: dict, workers: list[dict]) -> tuple[Cluster, list]:
    """A `Cluster` with a head started from `head` (add_node's arguments) and a worker per entry of `workers`, all
    registered; -> (cluster, worker nodes). Tried once more, on a fresh cluster after a pause, when a node fails to
    come up (_START_FAILURES): seen in a CI run (stop 35) where a worker's raylet printed "double free or corruption
    (fasttop)" and the node "timed out during startup", erroring a whole module; a native crash in Ray."""
    for attempt in (1, 2):
        cluster = None
        try:
            cluster = Cluster(initialize_head=True, head_node_args=head)
            nodes = [cluster.add_node(**worker) for worker in workers]
            cluster.wait_for_nodes()
            return cluster, nodes
        except Exception as exc:  # noqa: BLE001 - Ray raises a bare Exception for this
            if cluster is not None:
                cluster.shutdown()
            if attempt == 2 or not any(sign in str(exc) for sign in _START_FAILURES):
                raise
            time.sleep(5)
    raise AssertionError("unreachable")


def init_local_ray(**kwargs) -> None:
    """ray.init(address="local", **kwargs), tried once more when the new node times out starting: on the loaded
    2-core CI machine a module's Ray sometimes starts while the previous module's processes are still exiting
    (seen once in a fresh-clone run: "The current node timed out during startup"; not reproducible alone), or when
    its GCS server dies before writing its port (seen once in CI, stop 36: the GCS printed "double free or corruption
    (fasttop)" and ray.init raised "Timed out waiting for file .../gcs_server_port_...": a native crash in Ray)."""
    if ray.is_initialized():  # the session's shared Ray (tests/shared_ray.py), should its users not be grouped
        ray.shutdown()
    try:
        ray.init(address="local", **kwargs)
    except Exception as exc:  # noqa: BLE001 - Ray raises a bare Exception for this
        if not any(sign in str(exc) for sign in _START_FAILURES):
            raise
        ray.shutdown()
        time.sleep(5)
        ray.init(address="local", **kwargs)
