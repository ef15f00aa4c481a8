"""The expert pool checked by bytes on a Cluster whose nodes declare GPUs (memory given with experts.gpu_memory_gb):
a pool that fits starts; one that does not stops before any actor starts with one line naming the GPUs missing, or —
with an autoscaler running — asks it for them (request_resources), waits, and starts when they come."""

from __future__ import annotations

import json
import threading

import pytest

from expertmesh.cluster.memory_plan import GIB, RUNTIME_RESERVE_BYTES
from expertmesh.cluster.naming import is_expert_actor_name
from expertmesh.experts.errors import ConfigError
from expertmesh.router_service.config import MeshConfig
from expertmesh.router_service.gpu_fit import AUTOSCALER_STATUS_KEY
from expertmesh.router_service.mesh import ExpertMesh
from tests.clusters import FAKE_GPUS, cluster_with_gpus
from tests.traffic import wait_for

# The tiny Mixtral: 4 experts x 2 layers x (3 x 32 x 48) fp32 = 36,864 bytes per expert actor. A "GPU" whose usable
# memory is 50,000 bytes holds one such actor, not two.
ACTOR_BYTES = 2 * 3 * 32 * 48 * 4
GPU_GB = (RUNTIME_RESERVE_BYTES + 50_000) / 0.9 / GIB


@pytest.fixture(scope="module")
def gpu_cluster():
    """One Cluster for the module (the last test adds a node to it, so it runs last)."""
    with cluster_with_gpus(2, dashboard=True) as cluster:
        yield cluster


def _config(cluster, checkpoint, gpu_gb: float, wait_s: float = 0.0) -> MeshConfig:
    return MeshConfig().replace(**{
        "model.path": str(checkpoint), "ray.address": cluster.address, "experts.num_cpus_per_actor": 0.1,
        "experts.layout": "per-expert",
        "experts.gpu_memory_gb": gpu_gb, "experts.gpu_wait_s": wait_s, "controller.enabled": False,
        "devices.gpu_without_cuda": FAKE_GPUS["gpu_without_cuda"],
    })


def _expert_actors() -> list[str]:
    from ray.util.state import list_actors

    return [a.name for a in list_actors(filters=[("state", "=", "ALIVE")]) if is_expert_actor_name(a.name or "")]


def test_a_pool_that_fits_by_bytes_starts(gpu_cluster, checkpoints):
    with ExpertMesh(_config(gpu_cluster, checkpoints["mixtral"], gpu_gb=24.0)) as mesh:
        assert sorted(mesh.router.table.actors) == [f"expert-e{e}-r0" for e in range(4)]


def test_a_pool_that_does_not_fit_stops_before_any_actor_with_one_line(gpu_cluster, checkpoints):
    with pytest.raises(ConfigError) as err:
        ExpertMesh(_config(gpu_cluster, checkpoints["mixtral"], gpu_gb=GPU_GB))
    message = str(err.value)
    assert err.value.field == "experts" and "\n" not in message
    assert "need 4 GPUs of 2 GiB by memory, the cluster has 2: 2 missing" in message, message
    assert _expert_actors() == []


def test_with_an_autoscaler_it_asks_for_the_missing_gpus_and_starts_when_they_come(gpu_cluster, checkpoints):
    from ray.autoscaler._private.constants import AUTOSCALER_RESOURCE_REQUEST_CHANNEL
    from ray.experimental import internal_kv

    internal_kv._internal_kv_put(AUTOSCALER_STATUS_KEY, b"{}", overwrite=True)  # the test plays the autoscaler
    started: dict = {}

    def start() -> None:
        try:
            started["mesh"] = ExpertMesh(_config(gpu_cluster, checkpoints["mixtral"], gpu_gb=GPU_GB, wait_s=120))
        except BaseException as exc:  # noqa: BLE001 - reported by the test below
            started["error"] = exc

    thread = threading.Thread(target=start, daemon=True)
    thread.start()
    request = wait_for(lambda: internal_kv._internal_kv_get(AUTOSCALER_RESOURCE_REQUEST_CHANNEL), timeout=60,
                       what="a request_resources call")
    assert json.loads(request) == [{"GPU": 1}] * 4 and _expert_actors() == []
    gpu_cluster.add_node(num_cpus=2, num_gpus=2)  # the autoscaler brings a node
    thread.join(180)
    assert "error" not in started, started.get("error")
    mesh = started["mesh"]
    try:
        slots = mesh.runtime.pool.slots
        per_gpu = {(s.node_id, s.gpu_slot) for s in slots}
        assert len(per_gpu) == 4 and all(s.num_gpus == 1.0 for s in slots)  # one actor per GPU, by bytes
    finally:
        mesh.shutdown()
