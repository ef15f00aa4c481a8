"""Fixtures shared by integration modules: one local Ray per module, and the in-process reference of the tiny
Mixtral checkpoint."""

from __future__ import annotations

import pytest
import ray

from expertmesh.cluster.naming import NAMESPACE
from expertmesh.experts.reference import load_reference_model


@pytest.fixture(scope="module")
def local_ray():
    """A 2-CPU local Ray for the module (modules opt in with `pytestmark = pytest.mark.usefixtures("local_ray")`)."""
    ray.init(address="local", num_cpus=2, namespace=NAMESPACE, include_dashboard=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def reference(checkpoints):
    return load_reference_model(checkpoints["mixtral"])
