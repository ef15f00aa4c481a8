"""cluster/configs/serve_config.yaml deployed with `serve run` on a local cluster, answering through Serve's own gRPC
proxy: the path `serve deploy` and KubeRay users take."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import ray
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from ray._private import state as ray_state

from expertmesh.cluster.naming import NAMESPACE, expert_actor_name
from expertmesh.experts.reference import load_reference_model
from expertmesh.ops.server_process import start_server
from expertmesh.protos import admin_pb2, admin_pb2_grpc, inference_pb2_grpc, kserve_v2_pb2_grpc
from expertmesh.protos import inference_pb2 as pb
from expertmesh.protos import kserve_v2_pb2 as kpb
from tests.clusters import init_local_ray
from tests.tiny_checkpoints import greedy_tokens
from tests.traffic import wait_for

CONFIG = Path(__file__).resolve().parents[2] / "cluster" / "configs" / "serve_config.yaml"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def deployed(checkpoints, tmp_path_factory):
    init_local_ray(num_cpus=4, namespace=NAMESPACE, include_dashboard=False)
    config = yaml.safe_load(CONFIG.read_text())
    port = free_port()
    config["grpc_options"]["port"] = port
    config["http_options"]["port"] = free_port()
    app = config["applications"][0]["args"]
    # The shipped config serves a Hub model in bf16 with a GPU per router; here: a tiny folder, on CPU.
    app["model"]["path"] = str(checkpoints["mixtral"])
    app["model"]["dtype"] = "auto"
    app["router"]["gpus"] = 0
    # Non-default settings that must reach the builder and the routers through Serve's args (one config tree).
    app["model"]["name"] = "yaml-mixtral"
    app["failover"]["no_replica_policy"] = "degrade"
    app["router"].pop("autoscale")
    app["router"]["replicas"] = 1
    app.setdefault("experts", {})["layout"] = "per-expert"  # the assertions below name one actor per expert
    path = tmp_path_factory.mktemp("serve") / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    log = path.with_suffix(".log")
    proc = subprocess.Popen([sys.executable, "-m", "ray.serve.scripts", "run", "--address",
                             ray.get_runtime_context().gcs_address, str(path)],
                            stdout=log.open("w"), stderr=subprocess.STDOUT)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")

    def serving() -> bool:
        if proc.poll() is not None:
            raise RuntimeError("serve run exited")
        try:
            status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status
        except grpc.RpcError:
            return False
        return status == health_pb2.HealthCheckResponse.SERVING

    try:
        wait_for(serving, 240, "serve run to report SERVING", every=0.25)
    except (AssertionError, RuntimeError) as exc:
        proc.kill()
        raise RuntimeError(f"serve run did not come up ({exc}):\n{log.read_text()[-4000:]}") from exc
    yield channel
    channel.close()
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
    ray.shutdown()


def test_generate_through_serves_grpc_proxy_equals_the_reference(deployed, checkpoints):
    prompt = [7, 8, 9, 10]
    ids = []
    for message in inference_pb2_grpc.InferenceStub(deployed).Generate(
        pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), max_tokens=8), timeout=60
    ):
        if message.HasField("token"):
            ids.extend(message.token.token_ids)
    assert ids == greedy_tokens(load_reference_model(checkpoints["mixtral"]), prompt, 8)


def test_errors_keep_their_codes_behind_serves_proxy(deployed):
    with pytest.raises(grpc.RpcError) as err:
        list(inference_pb2_grpc.InferenceStub(deployed).Generate(
            pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1]), max_tokens=0), timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_tokens" in err.value.details()


def test_the_builder_started_experts_and_controller_detached(deployed):
    names = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == NAMESPACE}
    assert {"controller", "expert-e0-r0", "expert-e0-r1", "expert-e3-r1"} <= names
    # Exactly the controller and two replicas of each of the 4 experts (the config's replicas_per_expert), all
    # detached: they outlive `serve run`'s driver, which is what lets Serve restart a router replica onto them.
    assert names == {"controller"} | {expert_actor_name(e, r) for e in range(4) for r in range(2)}
    for name in names:
        actor_id = ray.get_actor(name, namespace=NAMESPACE)._actor_id.hex()
        assert ray_state.actors(actor_id=actor_id)["IsDetached"], name


def test_destructive_admin_calls_are_refused_behind_serves_proxy_without_an_admin_token(deployed):
    """The deployment checks the admin token itself (Serve's proxy has no front before it); this config sets none."""
    stub = admin_pb2_grpc.AdminStub(deployed)
    for method in ("KillReplica", "DrainReplica", "UndrainReplica"):
        with pytest.raises(grpc.RpcError) as err:
            getattr(stub, method)(admin_pb2.ReplicaRequest(actor="expert-e0-r0", force=True), timeout=30)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED and "--admin-token" in err.value.details()
    state = stub.GetClusterState(admin_pb2.ClusterStateRequest(), timeout=30)
    assert all(r.alive and not r.drained for r in state.replicas)
    watch = health_pb2_grpc.HealthStub(deployed).Watch(health_pb2.HealthCheckRequest(), timeout=30)
    assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
    watch.cancel()


def test_settings_from_the_serve_config_took_effect(deployed):
    """model.name and failover.no_replica_policy came from the YAML's args, not from defaults."""
    state = admin_pb2_grpc.AdminStub(deployed).GetClusterState(admin_pb2.ClusterStateRequest(), timeout=30)
    assert state.model == "yaml-mixtral" and state.no_replica_policy == "degrade"
    assert len(state.replicas) == 8  # experts.replicas_per_expert: 2 x the tiny Mixtral's 4 experts
    ready = kserve_v2_pb2_grpc.GRPCInferenceServiceStub(deployed).ModelReady(
        kpb.ModelReadyRequest(name="yaml-mixtral"), timeout=30)
    assert ready.ready


def test_expertmesh_front_serves_the_deployed_mesh(deployed, checkpoints):
    """`expertmesh front --address` before the mesh `serve run` deployed: gRPC Generate through it equals the
    reference, and its HTTP front serves the deployed model's name (asked from the deployment). Its resuming is the
    `expertmesh serve` fronts' code, tested with killed replicas in test_router_resume_served.py; killing this
    module's one router replica would cost a Serve restart (30 s to minutes on a loaded 2-core machine)."""
    import json
    import urllib.request

    front = start_server(["--address", ray.get_runtime_context().gcs_address, "--http-port", "0"], command="front",
                         timeout=120)
    try:
        assert front.model_name == "yaml-mixtral"
        prompt, max_tokens = [7, 8, 9, 10], 12
        with grpc.insecure_channel(front.target) as channel:
            ids = [t for m in inference_pb2_grpc.InferenceStub(channel).Generate(
                pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), max_tokens=max_tokens), timeout=60)
                   if m.HasField("token") for t in m.token.token_ids]
        assert ids == greedy_tokens(load_reference_model(checkpoints["mixtral"]), prompt, max_tokens)
        body = json.dumps({"model": "yaml-mixtral", "prompt": prompt, "max_tokens": 3}).encode()
        reply = urllib.request.urlopen(urllib.request.Request(
            f"{front.http_url}/v1/completions", body, {"Content-Type": "application/json"}), timeout=60)
        assert json.loads(reply.read())["usage"]["completion_tokens"] == 3
    finally:
        assert front.stop() == 0, front.log()
