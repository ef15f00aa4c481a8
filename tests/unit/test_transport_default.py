"""router.transport "auto" (the default): socket on an embedded Ray, refs on a joined cluster; a named transport as
named; anything else refused naming the field."""

from __future__ import annotations

import pytest

from expertmesh.router_service.config import MeshConfig
from expertmesh.router_service.transports.base import TRANSPORTS, resolve_transport


def test_auto_is_socket_on_an_embedded_ray_and_refs_on_a_joined_cluster():
    assert MeshConfig().router.transport == "auto"
    assert resolve_transport("auto", "local") == "socket"
    assert resolve_transport("auto", "10.0.0.1:6379") == "refs"
    for name in TRANSPORTS:
        assert resolve_transport(name, "local") == name and resolve_transport(name, "10.0.0.1:6379") == name


def test_unknown_transport_is_refused_naming_the_field():
    with pytest.raises(ValueError, match="transport"):
        resolve_transport("carrier-pigeon", "local")
    with pytest.raises(ValueError, match="transport: must be one of"):
        MeshConfig().replace(**{"router.transport": "carrier-pigeon"}).validate()
