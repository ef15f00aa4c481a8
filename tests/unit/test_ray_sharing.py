"""Several meshes started in one process share the Ray the first one started: closing one leaves Ray up for the
others, the last one shuts it down (router_service/startup.py)."""

from __future__ import annotations

import pytest

from expertmesh.router_service import startup
from expertmesh.router_service.config import MeshConfig, MeshIdConfig


@pytest.fixture
def fake_ray(monkeypatch):
    calls = {"shutdown": 0}
    monkeypatch.setattr(startup.ray, "is_initialized", lambda: True)
    monkeypatch.setattr(startup.ray, "shutdown", lambda: calls.__setitem__("shutdown", calls["shutdown"] + 1))
    monkeypatch.setattr(startup, "_RAY_SHARERS", set())
    return calls


def runtime(mesh_id: str) -> startup.MeshRuntime:
    rt = startup.MeshRuntime(MeshConfig(mesh=MeshIdConfig(id=mesh_id)), reader=None, owns_ray=True)
    startup._RAY_SHARERS.add(id(rt))
    return rt


def test_the_last_mesh_to_stop_shuts_ray_down(fake_ray):
    alpha, beta = runtime("alpha"), runtime("beta")
    alpha.stop()
    assert fake_ray["shutdown"] == 0 and not alpha.owns_ray
    alpha.stop()  # twice is harmless
    assert fake_ray["shutdown"] == 0
    beta.stop()
    assert fake_ray["shutdown"] == 1


def test_keep_ray_keeps_it(fake_ray):
    alpha = runtime("alpha")
    alpha.stop(keep_ray=True)
    assert fake_ray["shutdown"] == 0 and not startup._RAY_SHARERS


def test_a_caller_owned_ray_is_never_shut_down(fake_ray):
    rt = startup.MeshRuntime(MeshConfig(), reader=None, owns_ray=False)
    rt.stop()
    assert fake_ray["shutdown"] == 0
