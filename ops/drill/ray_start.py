"""The Ray a self-started drill runs on: bound to loopback (nothing of a drill listens beyond this machine) and, for
node kills, with Ray's node health checks shortened so a removed node is declared dead in ~1.2 s instead of ~15 s.

Ray decides when `ray.nodes()` says Alive False from its GCS health checks of each raylet: one every
`health_check_period_ms` (default 3000), each failing after `health_check_timeout_ms` (default 10000), the node
dead after `health_check_failure_threshold` (default 5) failures in a row. expertmesh's node watches (router and
controller, `failover.node_poll_s` / `controller.node_poll_s`) act within one poll of that. A killed raylet's port
refuses at once, so detection is about period x threshold; the timeout matters for a node that hangs. Users set the
same on their own head node (`ray start --head --system-config='{...}'`, README: Failover).

Loopback: Ray 2.60 turns "127.0.0.1" into the machine's routable IP whenever it resolves a node or GCS address
(`resolve_ip_for_localhost`), unless its single-machine mode is on (`ray_constants.ENABLE_RAY_CLUSTER` False, read
from RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 when Ray is imported; router_service/startup.py does the same for an
embedded Ray). `loopback_mode()` turns it on for this process and, through the environment, for the server the
drill starts; `leave_loopback_mode()` puts both back.
"""

from __future__ import annotations

import logging
import os
import time

from ...router_service.config import EMBEDDED_RAY_SYSTEM_CONFIG

LOOPBACK = "127.0.0.1"
_SINGLE_MACHINE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
_saved: list[tuple[str | None, bool]] = []
# 3 failed checks 0.4 s apart: a removed node (its raylet's port refuses at once) is dead ~1.2 s after it went. Each
# check may take 5 s before it counts as failed, so a raylet merely slow on a loaded box is declared dead only after
# ~15 s without an answer: with a 1 s timeout, raylets on this 2-core box at load average ~280 (other Ray clusters
# running) were declared dead while alive ("mistakenly been marked as dead by the GCS").
FAST_HEALTH_CHECKS = {
    "health_check_period_ms": 400,
    "health_check_timeout_ms": 5000,
    "health_check_failure_threshold": 3,
}


def loopback_mode() -> None:
    """Ray's single-machine mode for this process and the processes it starts (see the module's docstring)."""
    from ray._private import ray_constants

    _saved.append((os.environ.get(_SINGLE_MACHINE_ENV), getattr(ray_constants, "ENABLE_RAY_CLUSTER", True)))
    os.environ[_SINGLE_MACHINE_ENV] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False


def leave_loopback_mode() -> None:
    """Undo loopback_mode (no-op when it is not on)."""
    if not _saved:
        return
    from ray._private import ray_constants

    env, enabled = _saved.pop()
    if env is None:
        os.environ.pop(_SINGLE_MACHINE_ENV, None)
    else:
        os.environ[_SINGLE_MACHINE_ENV] = env
    ray_constants.ENABLE_RAY_CLUSTER = enabled


def start_node_cluster(nodes: int, node_cpus: int, node_gpus: int, namespace: str):
    """A `ray.cluster_utils.Cluster` on loopback: a 1-CPU head and `nodes` workers, this driver joined, the fast
    health checks on. -> (cluster, GCS address). Call leave_loopback_mode() after shutting it down."""
    import ray
    from ray.cluster_utils import Cluster

    loopback_mode()
    local = {"node_ip_address": LOOPBACK, "include_dashboard": False}
    for attempt in (1, 2):
        cluster = Cluster(initialize_head=False)
        try:
            cluster.add_node(num_cpus=1, num_gpus=0, **local,
                             _system_config={**FAST_HEALTH_CHECKS, **EMBEDDED_RAY_SYSTEM_CONFIG})
            for _ in range(nodes):
                cluster.add_node(num_cpus=node_cpus, num_gpus=node_gpus, **local)
            break
        except Exception as exc:  # noqa: BLE001 - Ray raises a bare Exception when a raylet is slow to register
            cluster.shutdown()
            if attempt == 2 or "timed out during startup" not in str(exc):
                raise
            time.sleep(5)  # seen on the 2-core box while other Ray clusters ran (load average > 100)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace=namespace, logging_level=logging.WARNING, log_to_driver=False)
    return cluster, cluster.address


def start_local_ray(num_cpus: int | None, namespace: str) -> str:
    """An embedded single-node Ray on loopback, no dashboard. -> its GCS address. Call leave_loopback_mode() after
    shutting it down."""
    import ray

    loopback_mode()
    cpus = num_cpus or max(2, os.cpu_count() or 2)
    ctx = ray.init(address="local", num_cpus=cpus, namespace=namespace, include_dashboard=False,
                   logging_level=logging.WARNING, log_to_driver=False,
                   _system_config=dict(EMBEDDED_RAY_SYSTEM_CONFIG))  # as `expertmesh serve`'s embedded Ray
    return ctx.address_info["gcs_address"]
