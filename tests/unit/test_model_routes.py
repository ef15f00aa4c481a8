"""A front over several meshes: the model name -> mesh rule (router_service/model_routes.py) and finding the meshes
on a cluster from Serve's application names (cluster/naming.py mesh_id_of_app). No Ray."""

from __future__ import annotations

import pytest

from expertmesh.cluster.naming import MeshNames, mesh_id_of_app, mesh_ids_of_apps
from expertmesh.router_service.config import ConfigError
from expertmesh.router_service.model_routes import ModelRequired, UnknownModel, choose, model_routes


def test_routes_map_each_model_to_its_mesh_in_order():
    routes = model_routes([("alpha", "mixtral-tiny"), ("beta", "qwen-tiny")])
    assert routes == {"mixtral-tiny": "alpha", "qwen-tiny": "beta"}
    assert list(routes) == ["mixtral-tiny", "qwen-tiny"]  # /v1/models lists them in the order given


def test_two_meshes_serving_one_name_is_a_startup_error_naming_the_field():
    with pytest.raises(ConfigError) as err:
        model_routes([("alpha", "tiny"), ("beta", "other"), ("gamma", "tiny")])
    assert err.value.field == "model.name"
    assert "'alpha' and 'gamma' both serve model 'tiny'" in str(err.value)


def test_a_mesh_given_twice_or_none_at_all_is_refused():
    with pytest.raises(ConfigError, match="mesh.id: mesh 'alpha' given twice"):
        model_routes([("alpha", "a"), ("alpha", "b")])
    with pytest.raises(ConfigError, match="mesh.id: no mesh"):
        model_routes([])
    with pytest.raises(ConfigError, match="model.name: mesh 'alpha' serves no model name"):
        model_routes([("alpha", "")])


def test_choose_picks_the_mesh_named_by_the_model():
    targets = {"mixtral-tiny": "handle-a", "qwen-tiny": "handle-b"}
    assert choose("mixtral-tiny", targets) == "handle-a"
    assert choose("qwen-tiny", targets) == "handle-b"


def test_an_unknown_model_is_refused_naming_the_field_and_the_served_models():
    targets = {"mixtral-tiny": 1, "qwen-tiny": 2}
    with pytest.raises(UnknownModel) as err:
        choose("gpt-4", targets)
    assert err.value.field == "model"
    assert err.value.message == "model: unknown model 'gpt-4'; this front serves 'mixtral-tiny', 'qwen-tiny'"
    with pytest.raises(UnknownModel, match="^model_name: unknown model"):  # KServe's field, named as such
        choose("nope", targets, field="model_name")
    with pytest.raises(UnknownModel) as long:  # a client's long name is cut in the message
        choose("x" * 5000, targets)
    assert len(long.value.message) < 200
    # near misses are not matches: names are exact
    for near in ("Mixtral-tiny", "mixtral-tiny ", "mixtral"):
        with pytest.raises(UnknownModel):
            choose(near, targets)


def test_no_model_picks_the_only_mesh_and_is_refused_with_several():
    assert choose("", {"only": 7}) == 7
    assert choose(None, {"only": 7}) == 7
    with pytest.raises(ModelRequired) as err:
        choose("", {"a": 1, "b": 2})
    assert err.value.field == "model" and "several models ('a', 'b')" in err.value.message
    with pytest.raises(UnknownModel):  # one mesh still checks a name that is given
        choose("other", {"only": 7})


def test_routes_and_choose_together():
    routes = model_routes([("default", "expertmesh-demo"), ("chat", "chat-model")])
    handles = {model: f"app:{MeshNames.of(mesh_id).app_name}" for model, mesh_id in routes.items()}
    assert choose("chat-model", handles) == "app:expertmesh-chat"
    assert choose("expertmesh-demo", handles) == "app:expertmesh"


def test_mesh_ids_from_serve_application_names():
    assert mesh_id_of_app("expertmesh") == "default"
    assert mesh_id_of_app("expertmesh-alpha") == "alpha"
    assert mesh_id_of_app("expertmesh-chat-2") == "chat-2"
    for other in ("expertmesh-default", "expertmesh-", "expertmesh-Upper", "expertmeshx", "my-app", "",
                  "expertmesh-routing-table", "expertmesh-a_b"):
        assert mesh_id_of_app(other) is None, other
    for mesh_id in ("default", "alpha", "x-1"):  # round trip with MeshNames
        assert mesh_id_of_app(MeshNames.of(mesh_id).app_name) == mesh_id


def test_all_meshes_found_among_serve_applications_default_first():
    apps = ["expertmesh-zeta", "other-app", "expertmesh-alpha", "expertmesh", "expertmesh-default"]
    assert mesh_ids_of_apps(apps) == ["default", "alpha", "zeta"]
    assert mesh_ids_of_apps(["my-app"]) == []
