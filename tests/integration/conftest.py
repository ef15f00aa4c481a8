"""Fixtures shared by integration modules: one local Ray per module, the in-process reference of the tiny Mixtral
checkpoint, a gRPC channel to the module's own `served` server (modules that start one define `served`), and the
session's shared server (tests/shared_server.py: its users run one after another and it stops after the last)."""

from __future__ import annotations

import grpc
import pytest
import ray

from expertmesh.cluster.naming import NAMESPACE
from expertmesh.experts.reference import load_reference_model
from tests.clusters import init_local_ray
from tests.shared_server import SHARED, group_shared_server_users, uses_shared_server


@pytest.fixture(scope="module")
def local_ray():
    """A 2-CPU local Ray for the module (modules opt in with `pytestmark = pytest.mark.usefixtures("local_ray")`)."""
    init_local_ray(num_cpus=2, namespace=NAMESPACE, include_dashboard=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def reference(checkpoints):
    return load_reference_model(checkpoints["mixtral"])


@pytest.fixture(scope="module")
def channel(served):
    """A plaintext channel to the module's `served` server (an `expertmesh serve` subprocess)."""
    with grpc.insecure_channel(served.target) as chan:
        yield chan


@pytest.fixture(scope="session")
def shared_server(checkpoints):
    """The tiny Mixtral served once for the modules that only need a running server (tests/shared_server.py)."""
    yield SHARED.get(str(checkpoints["mixtral"]))
    SHARED.stop()


def pytest_collection_modifyitems(config, items):
    group_shared_server_users(items)


def pytest_collection_finish(session):
    users = [item.nodeid for item in session.items if uses_shared_server(item)]
    SHARED.last_user = users[-1] if users else None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After the last user's own teardown (its module's fixtures, a restore among them), stop the shared server."""
    try:
        return (yield)
    finally:
        if item.nodeid == SHARED.last_user:
            SHARED.stop()
