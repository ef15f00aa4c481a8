"""The distributed data plane against `transformers` and the in-process reference, on one local Ray."""

from __future__ import annotations

import shutil

import pytest
import ray
import torch
from safetensors.torch import load_file, save_file

from expertmesh.cluster.naming import NAMESPACE
from expertmesh.experts.errors import CheckpointError
from expertmesh.experts.reference import load_reference_model
from expertmesh.router_service.mesh import ConfigError, ExpertMesh, MeshConfig, RequestError
from tests.tiny_checkpoints import VOCAB
from tests.traffic import kill_and_wait

TOL = 1e-4


pytestmark = pytest.mark.usefixtures("local_ray")


def local_mesh(path, layout: str = "per-expert", **sections) -> ExpertMesh:
    """A mesh on the tiny checkpoint at `path` with no controller (nothing here kills actors); sections: more of
    the configuration tree, e.g. router={"capacity_factor": 1.0}. The one-actor-per-expert layout for the tests
    that name actors expert-e{E}-r{R} or count calls per expert actor; "auto" (one actor per node here, what a user's
    small Ray gets) for those that only compare results: one actor process to start instead of four."""
    experts = {"layout": layout, **sections.pop("experts", {})}
    return ExpertMesh(MeshConfig.from_dict({"model": {"path": str(path)}, "controller": {"enabled": False},
                                            "experts": experts, **sections}))


@pytest.fixture(scope="module")
def family_mesh(request, checkpoints) -> tuple[str, ExpertMesh]:
    """(name, mesh) on checkpoint `request.param`, one per checkpoint for the tests that only read from it rather
    than one per test: module-scoped and parametrized indirectly, so pytest runs each checkpoint's tests together
    and stops its mesh before the next one starts (two at once would not fit the module's 2-CPU Ray)."""
    with local_mesh(checkpoints[request.param], layout="auto") as mesh:
        yield request.param, mesh


def hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def sequences(seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (17, 5)]


def test_replicas_share_load_and_stay_exact(checkpoints):
    path = checkpoints["mixtral"]
    seqs = sequences(seed=2)
    reference = load_reference_model(path).forward([torch.tensor(s) for s in seqs])
    with local_mesh(path, experts={"replicas_per_expert": 2}) as mesh:
        got = mesh.score_batch(seqs)
        # Operators find actors by name from any driver.
        other = ray.get_actor("expert-e1-r1", namespace=NAMESPACE)
        info = ray.get(other.info.remote())
        routed = mesh.model.last_trace.routings
        infos = {i["name"]: i for i in mesh.actor_info()}
    for a, b in zip(got, reference):
        assert (a - b).abs().max().item() <= TOL
    assert info["name"] == "expert-e1-r1" and info["shards"] == [(0, 1), (1, 1)]
    # Both replicas of an expert that got ≥ 2 tokens took part.
    for expert in range(4):
        slots = sum(int((r.experts == expert).sum()) for r in routed.values())
        if slots >= 4:
            assert infos[f"expert-e{expert}-r0"]["tokens"] > 0 and infos[f"expert-e{expert}-r1"]["tokens"] > 0
    with pytest.raises(ValueError):
        ray.get_actor("expert-e1-r1", namespace=NAMESPACE)  # gone after shutdown


def test_default_layout_on_a_small_ray_is_one_actor_per_node_exact_and_fails_over(checkpoints):
    """The default (auto) layout on this module's 2-CPU Ray, where one process per expert would share cores: one
    actor per node hosting every expert of every MoE layer (two replicas: two such actors), one call per actor per
    layer; outputs equal the reference, also after one replica is killed (its tokens go to the other)."""
    path = checkpoints["mixtral"]
    seqs = sequences(seed=4)
    reference = load_reference_model(path).forward([torch.tensor(s) for s in seqs])
    config = MeshConfig.from_dict({"model": {"path": str(path)}, "controller": {"enabled": False},
                                   "experts": {"replicas_per_expert": 2}})
    with ExpertMesh(config) as mesh:
        assert sorted(mesh.actors) == ["expert-e0-r0", "expert-e0-r1"]
        every = [(layer, e) for layer in mesh.model_config.moe_layers for e in range(4)]
        assert all(sorted(i["shards"]) == every for i in mesh.actor_info())
        got = mesh.score_batch(seqs)
        calls = dict(mesh.backend.calls_per_layer)
        kill_and_wait("expert-e0-r0")
        after = mesh.score_batch(seqs)
        assert mesh.backend.dead == {"expert-e0-r0"}
    assert calls and all(1 <= n <= 2 for n in calls.values())  # one call per replica at most, not per expert
    for a, b, ref in zip(got, after, reference):
        assert (a - ref).abs().max().item() <= TOL and (b - ref).abs().max().item() <= TOL


def test_capacity_factor_matches_reference_with_the_same_cap(checkpoints):
    path = checkpoints["olmoe"]
    ids = [torch.tensor(s) for s in sequences(seed=3)]
    capped_ref = load_reference_model(path, capacity_factor=1.0).forward(ids)
    free_ref = load_reference_model(path).forward(ids)
    with local_mesh(path, layout="auto", router={"capacity_factor": 1.0}) as mesh:
        got = mesh.score_batch([i.tolist() for i in ids])
        rerouted = sum(r.rerouted for r in mesh.model.last_trace.routings.values())
    for a, b in zip(got, capped_ref):
        assert (a - b).abs().max().item() <= TOL
    assert rerouted > 0  # the cap did bite on this input, so the comparison means something
    assert max((a - b).abs().max().item() for a, b in zip(got, free_ref)) > TOL


def test_bad_requests_name_the_field(checkpoints):
    with local_mesh(checkpoints["mixtral"], layout="auto") as mesh:
        cases = [
            (lambda: mesh.score([]), "token_ids"),
            (lambda: mesh.score([1, VOCAB]), "token_ids"),
            (lambda: mesh.score([-1]), "token_ids"),
            (lambda: mesh.generate(token_ids=[1, 2], max_tokens=0), "max_tokens"),
            (lambda: mesh.generate(token_ids=[1, 2], max_tokens=200), "max_tokens"),
            (lambda: mesh.generate(prompt="hello"), "prompt"),
        ]
        for call, field in cases:
            with pytest.raises(RequestError) as err:
                call()
            assert err.value.field == field
        assert mesh.score([1, 2, 3]).shape == (3, VOCAB)  # still serving


def test_broken_checkpoint_fails_before_actors_start(checkpoints, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(checkpoints["mixtral"], broken)
    tensors = load_file(str(broken / "model.safetensors"))
    del tensors["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.block_sparse_moe\.experts\.2\.w3\.weight"):
        ExpertMesh(MeshConfig.from_dict({"model": {"path": str(broken)}}))
    assert not [a for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == NAMESPACE]


def test_config_is_validated_at_the_boundary():
    for field, value in [("experts.replicas_per_expert", 0), ("model.dtype", "int8"),
                         ("router.capacity_factor", float("nan")), ("model.path", "/nonexistent")]:
        with pytest.raises(ConfigError) as err:
            MeshConfig().replace(**{field: value}).validate()
        assert err.value.field == field


# Last in the module: the last checkpoint's mesh stays up until the module ends (a module-scoped fixture), and
# the tests above start meshes of their own under the same mesh id.


@pytest.mark.parametrize("family_mesh", ["mixtral", "qwen2_moe", "olmoe", "mixtral_sharded", "direct"],
                         indirect=True)
def test_logits_equal_transformers(checkpoints, family_mesh):
    name, mesh = family_mesh
    hf = hf_model(checkpoints[name])
    seqs = sequences()
    got = mesh.score_batch(seqs)  # both sequences share every expert call
    hit = {layer: int(torch.unique(r.experts).numel()) for layer, r in mesh.model.last_trace.routings.items()}
    calls = dict(mesh.backend.calls_per_layer)
    for ids, logits in zip(seqs, got):
        with torch.no_grad():
            want = hf(torch.tensor([ids])).logits[0]
        assert (logits - want).abs().max().item() <= TOL
    # One call per actor per layer, never per token or per expert: the auto layout on this 2-CPU Ray is one actor
    # hosting every expert (test_replicas_share_load_and_stay_exact counts the per-expert layout's calls).
    assert len(mesh.slots) == 1 and calls == {layer: 1 for layer in hit}
    assert all(0 < n <= hf.config.num_experts_per_tok * len(seqs[0]) for n in calls.values())


@pytest.mark.parametrize("family_mesh", ["mixtral", "qwen2_moe", "olmoe"], indirect=True)
def test_greedy_generation_equals_transformers_generate(checkpoints, family_mesh):
    name, mesh = family_mesh
    hf = hf_model(checkpoints[name])
    prompt = sequences(seed=1)[0][:6]
    result = mesh.generate(token_ids=prompt, max_tokens=12)
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                       pad_token_id=0)[0, len(prompt):].tolist()
    assert result.token_ids == want
    assert result.finish_reason == "length"
    assert sum(result.tokens_per_expert[0]) == (len(prompt) + 11) * hf.config.num_experts_per_tok
