"""Fixtures shared by integration modules: one local Ray per module, the in-process reference of the tiny Mixtral
checkpoint, and a gRPC channel to the module's own `served` server (modules that start one define `served`)."""

from __future__ import annotations

import grpc
import pytest
import ray

from expertmesh.cluster.naming import NAMESPACE
from expertmesh.experts.reference import load_reference_model
from tests.clusters import init_local_ray


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
