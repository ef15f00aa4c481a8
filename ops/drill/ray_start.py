"""The Ray a self-started drill runs on: bound to loopback (nothing of a drill listens beyond this machine) and, for
node kills, with Ray's node health checks shortened so a removed node is declared dead in ~1.2 s instead of ~15 s.

Ray decides when `ray.nodes()` says Alive False from its GCS health checks of each raylet: one every
`health_check_period_ms` (default 3000), each failing after `health_check_timeout_ms` (default 10000), the node
dead after `health_check_failure_threshold` (default 5) failures in a row. expertmesh's node watches (router and
controller, `failover.node_poll_s` / `controller.node_poll_s`) act within one poll of that. A killed raylet's port
refuses at once, so detection is about period x threshold; the timeout matters for a node that hangs. Users set the
same on their own head node (`ray start --head --system-config='{...}'`, README: Failover).
"""

from __future__ import annotations

import logging
import os

LOOPBACK = "127.0.0.1"
# 3 failed checks 0.4 s apart: a removed node is dead ~1.2 s after its raylet stops answering. Each check may take
# 1 s, so a raylet merely slow on a loaded box is not declared dead by one slow answer.
FAST_HEALTH_CHECKS = {
    "health_check_period_ms": 400,
    "health_check_timeout_ms": 1000,
    "health_check_failure_threshold": 3,
}


def start_node_cluster(nodes: int, node_cpus: int, node_gpus: int, namespace: str):
    """A `ray.cluster_utils.Cluster` on loopback: a 1-CPU head and `nodes` workers, this driver joined, the fast
    health checks on. -> (cluster, GCS address)."""
    import ray
    from ray.cluster_utils import Cluster

    local = {"node_ip_address": LOOPBACK, "include_dashboard": False}
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 0, **local,
                                                            "_system_config": dict(FAST_HEALTH_CHECKS)})
    for _ in range(nodes):
        cluster.add_node(num_cpus=node_cpus, num_gpus=node_gpus, **local)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace=namespace, logging_level=logging.WARNING, log_to_driver=False,
             _node_ip_address=LOOPBACK)
    return cluster, cluster.address


def start_local_ray(num_cpus: int | None, namespace: str) -> str:
    """An embedded single-node Ray on loopback, no dashboard. -> its GCS address."""
    import ray

    cpus = num_cpus or max(2, os.cpu_count() or 2)
    ctx = ray.init(address="local", num_cpus=cpus, namespace=namespace, include_dashboard=False,
                   logging_level=logging.WARNING, log_to_driver=False, _node_ip_address=LOOPBACK)
    return ctx.address_info["gcs_address"]
