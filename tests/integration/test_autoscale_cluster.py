"""Per-expert autoscaling on a Cluster that declares GPUs: the pool starts with every GPU slot used, hot shards want
more replicas, so the controller asks Ray's autoscaler for GPUs (request_resources). The test plays the autoscaler
and adds a GPU node; the controller places the new replicas there, live. When the traffic stops, the replicas go
after the cooldown and the request is released. Every generation equals the reference throughout.
"""

from __future__ import annotations

import json

import pytest
import ray

from expertmesh.cluster.controller_config import ControllerConfig
from expertmesh.cluster.elastic import ElasticConfig
from expertmesh.cluster.load_stats import LoadStatsConfig
from expertmesh.cluster.naming import NAMESPACE
from expertmesh.experts.embedded_model import EMBEDDED_MODEL_DIR
from expertmesh.experts.reference import load_reference_model
from expertmesh.experts.tokenizer import load_tokenizer
from expertmesh.router_service.config import RayConfig
from expertmesh.router_service.mesh import ExpertMesh, MeshConfig
from expertmesh.router_service.observability_config import ObservabilityConfig
from tests.clusters import FAKE_GPU_DEVICES, cluster_with_gpus
from tests.tiny_checkpoints import greedy_tokens
from tests.traffic import (
    MAX_TOKENS,
    NonStopClient,
    code_prompts,
    control_log,
    controller_state,
    mesh_sender,
    wait_for,
)


@pytest.fixture(scope="module")
def small_cluster():
    with cluster_with_gpus(2, dashboard=True) as cluster:
        yield cluster


def ray_resource_request() -> list[dict] | None:
    """What request_resources left for the (v1) autoscaler, if that is where it went."""
    from ray.autoscaler._private.constants import AUTOSCALER_RESOURCE_REQUEST_CHANNEL
    from ray.experimental import internal_kv

    raw = internal_kv._internal_kv_get(AUTOSCALER_RESOURCE_REQUEST_CHANNEL)
    return json.loads(raw) if raw else None


def test_scale_out_onto_a_requested_node_and_back_in(small_cluster):
    tokenizer = load_tokenizer(EMBEDDED_MODEL_DIR)
    prompts = [tokenizer.encode(t).ids[:24] for t in code_prompts(8)]
    reference = load_reference_model(EMBEDDED_MODEL_DIR)
    expected = [greedy_tokens(reference, p, MAX_TOKENS) for p in prompts]
    elastic = ElasticConfig(
        control_interval_s=2.0, slots_per_gpu=4, num_cpus_per_actor=0.1, min_window_tokens=100,
        autoscale={"target_load_per_replica": 60.0, "max_gpus": 4, "base_gpus": 2, "downscale_delay_s": 4.0})
    mesh = ExpertMesh(MeshConfig(
        ray=RayConfig(address=small_cluster.address), controller=ControllerConfig(elastic=elastic),
        devices=FAKE_GPU_DEVICES,
        observability=ObservabilityConfig(load=LoadStatsConfig(window_s=6.0, bucket_s=1.0), report_interval_s=1.0)))
    try:
        assert sorted(mesh.router.table.actors) == ["expert-g0-v0", "expert-g1-v0"]  # 2 GPUs x 4 slots: full
        with NonStopClient(mesh_sender(mesh), prompts) as client:
            wait_for(lambda: controller_state(mesh)["requested_gpus"] > 2, timeout=120, what="a GPU request")
            kinds = [e["kind"] for e in controller_state(mesh)["events"]]
            assert "request_resources" in kinds
            request = ray_resource_request()
            if request is not None:  # autoscaler v1 reads it from the KV store; v2 gets it over GCS RPC
                assert len(request) == controller_state(mesh)["requested_gpus"]
                assert all(b == {"GPU": 1} for b in request)

            new_node = small_cluster.add_node(num_cpus=2, num_gpus=2)  # the "autoscaler" answers
            small_cluster.wait_for_nodes()
            # (Before the node joined the controller may also have rebalanced within the two full GPUs.)
            def scale_out() -> dict | None:
                return next((e for e in control_log(mesh) if e.get("remap", {}).get("ok")
                             and e["replicas_after"] > e["replicas_before"]), None)

            wait_for(lambda: scale_out() is not None, timeout=180, what="replicas placed on the new node")
            assert scale_out()["reason"] == "autoscale"
            nodes = {name: ray.get(ray.get_actor(name, namespace=NAMESPACE).info.remote())["node_id"]
                     for name in mesh.router.table.actors}
            assert new_node.node_id in nodes.values()
            served_before_stop = len(client.served)
            wait_for(lambda: len(client.served) >= served_before_stop + 4, what="traffic after scaling out")
        peak = sum(len(r) for r in mesh.router.table.replicas.values())
        # No traffic: the window empties, every shard turns cold, and after the cooldown the extra replicas go.
        wait_for(lambda: controller_state(mesh)["requested_gpus"] == 0, timeout=120, what="the GPU request released")
        wait_for(lambda: sum(len(r) for r in mesh.router.table.replicas.values()) < peak, timeout=120,
                 what="replicas removed")
        assert not client.errors, client.errors[:3]
        assert all(tokens == expected[k] for k, tokens in client.served)
        assert mesh.backend.retried_calls == 0
        assert mesh.generate(token_ids=prompts[0], max_tokens=MAX_TOKENS, stop_at_eos=False).token_ids == expected[0]
    finally:
        mesh.shutdown()
