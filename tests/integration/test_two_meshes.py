"""Two models served on one Ray cluster, each in its own mesh (mesh ids "alpha" and "beta"): each answers exactly
like its in-process reference, and an expert actor killed in one is restored there while the other mesh's actors,
routing table, controller and answers stay as they were. A third start with a mesh id in use is refused without
touching the running mesh."""

from __future__ import annotations

import json

import pytest
import ray

from expertmesh.cluster.controller_config import ControllerConfig
from expertmesh.cluster.mesh_store import MeshStore
from expertmesh.cluster.naming import MeshNames
from expertmesh.cluster.table_store import read_table
from expertmesh.experts.reference import load_reference_model
from expertmesh.router_service.config import ExpertsConfig, MeshIdConfig, ModelConfig
from expertmesh.router_service.dispatch import FailoverConfig
from expertmesh.router_service.mesh import ExpertMesh, MeshConfig
from tests.tiny_checkpoints import greedy_tokens
from tests.traffic import controller_state, kill_and_wait, wait_for

PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38]
MAX_TOKENS = 8
MODELS = {"alpha": "mixtral", "beta": "qwen2_moe"}  # mesh id -> checkpoint (two different models)

pytestmark = pytest.mark.usefixtures("local_ray")


def config(checkpoints, mesh_id: str) -> MeshConfig:
    # 4 actors per mesh at 0.2 CPU each: both pools fit the module's 2-CPU Ray.
    return MeshConfig(model=ModelConfig(path=str(checkpoints[MODELS[mesh_id]])), mesh=MeshIdConfig(id=mesh_id),
                      experts=ExpertsConfig(layout="per-expert", num_cpus_per_actor=0.2),
                      failover=FailoverConfig(no_replica_policy="wait", wait_timeout_s=90),
                      controller=ControllerConfig(enabled=True))


@pytest.fixture(scope="module")
def expected(checkpoints) -> dict[str, list[int]]:
    return {mesh_id: greedy_tokens(load_reference_model(checkpoints[family]), PROMPT, MAX_TOKENS)
            for mesh_id, family in MODELS.items()}


@pytest.fixture(scope="module")
def meshes(checkpoints):
    with ExpertMesh(config(checkpoints, "alpha")) as alpha, ExpertMesh(config(checkpoints, "beta")) as beta:
        yield {"alpha": alpha, "beta": beta}


def actor_ids(mesh_id: str, names) -> dict[str, str]:
    namespace = MeshNames.of(mesh_id).namespace
    return {name: ray.get_actor(name, namespace=namespace)._actor_id.hex() for name in names}


def answer(mesh: ExpertMesh) -> list[int]:
    return mesh.generate(token_ids=PROMPT, max_tokens=MAX_TOKENS).token_ids


def test_each_mesh_answers_like_its_own_reference(meshes, expected):
    assert expected["alpha"] != expected["beta"]  # two models: a mix-up would show
    for mesh_id, mesh in meshes.items():
        assert answer(mesh) == expected[mesh_id], mesh_id
    # The same actor names, in two namespaces, are two sets of actors hosting two models.
    names = sorted(meshes["alpha"].actors)
    assert names == sorted(meshes["beta"].actors) and "expert-e0-r0" in names
    ids_a, ids_b = actor_ids("alpha", names), actor_ids("beta", names)
    assert not set(ids_a.values()) & set(ids_b.values())
    for mesh_id in MODELS:
        info = ray.get(ray.get_actor("expert-e0-r0", namespace=f"expertmesh-{mesh_id}").info.remote())
        assert info["name"] == "expert-e0-r0" and info["mesh_id"] == mesh_id
    # Each controller is its own mesh's, in its namespace; the default mesh's namespace holds neither.
    for mesh_id, mesh in meshes.items():
        names_of = MeshNames.of(mesh_id)
        handle = ray.get_actor(names_of.controller, namespace=names_of.namespace)
        assert handle._actor_id == mesh.controller._actor_id
        assert sorted(controller_state(mesh)["actors"]) == names
    with pytest.raises(ValueError):
        ray.get_actor("controller", namespace="expertmesh")


def test_a_kill_in_one_mesh_leaves_the_other_alone(meshes, expected):
    alpha, beta = meshes["alpha"], meshes["beta"]
    names = sorted(beta.actors)
    before_ids = actor_ids("beta", names)
    before_table = read_table("beta")
    before_state = controller_state(beta)
    beta_calls = {info["name"]: info["calls"] for info in beta.actor_info()}

    victim = "expert-e0-r0"
    kill_and_wait(victim, namespace=MeshNames.of("alpha").namespace)
    assert answer(alpha) == expected["alpha"]  # rides out the restore (wait policy)
    assert alpha.backend.retried_calls > 0 and not alpha.backend.dead

    def restored() -> dict | None:
        state = controller_state(alpha)
        return state if any(e["kind"] == "restored" and e["actor"] == victim for e in state["events"]) else None

    state = wait_for(restored, 60, f"alpha's controller to restore {victim}", every=0.2,
                     detail=lambda: controller_state(alpha)["events"])
    assert state["actors"][victim]["generation"] == 1
    info = ray.get(ray.get_actor(victim, namespace="expertmesh-alpha").info.remote())
    assert info["generation"] == 1
    # Alpha's controller keeps its record under alpha's key; nothing went to the default mesh's keys.
    assert json.loads(MeshStore("alpha").get("controller"))["epoch"] == state["epoch"]
    assert MeshStore().get("controller") is None and read_table() is None

    # Beta: the same actors (none restarted), the same table, no controller events, the same answers.
    assert actor_ids("beta", names) == before_ids
    assert read_table("beta") == before_table
    after_state = controller_state(beta)
    assert after_state["epoch"] == before_state["epoch"]
    assert after_state["events"] == before_state["events"]
    assert all(a["generation"] == 0 for a in after_state["actors"].values())
    assert beta.backend.retried_calls == 0 and not beta.backend.dead
    assert answer(beta) == expected["beta"]
    assert sum(info["calls"] for info in beta.actor_info()) > sum(beta_calls.values())  # beta's actors served it


def test_a_second_start_with_a_mesh_id_in_use_is_refused_and_harmless(meshes, checkpoints, expected):
    alpha = meshes["alpha"]
    table = read_table("alpha")
    ids = actor_ids("alpha", sorted(alpha.actors))
    with pytest.raises(RuntimeError, match="already exists in namespace 'expertmesh-alpha'.*mesh id 'alpha'"):
        ExpertMesh(config(checkpoints, "alpha"))
    assert read_table("alpha") == table and actor_ids("alpha", sorted(alpha.actors)) == ids
    assert answer(alpha) == expected["alpha"]
