"""Fixtures shared by integration modules: the session's local Ray (tests/shared_ray.py), the in-process reference
of the tiny Mixtral checkpoint, a gRPC channel to the module's own `served` server (modules that start one define
`served`), and the session's shared server (tests/shared_server.py). Both shared ones are used by modules run one
after another and stop after their last user (tests/session_groups.py)."""

from __future__ import annotations

import grpc
import pytest

from expertmesh.experts.reference import load_reference_model
from tests.session_groups import LastUserStops, group_users
from tests.shared_ray import SHARED_RAY
from tests.shared_server import SHARED, SHARED_HTTP


@pytest.fixture(scope="module")
def local_ray():
    """A 2-CPU local Ray for the module (modules opt in with `pytestmark = pytest.mark.usefixtures("local_ray")`):
    the session's shared one (tests/shared_ray.py), handed back clean when the module ends."""
    SHARED_RAY.acquire()
    yield
    SHARED_RAY.release()


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
    yield SHARED.get("--model", str(checkpoints["mixtral"]))
    SHARED.stop()


@pytest.fixture(scope="session")
def shared_http_server():
    """The embedded model served once with the OpenAI front, for modules that only read from it
    (tests/shared_server.py)."""
    yield SHARED_HTTP.get()
    SHARED_HTTP.stop()


_LAST_USER_STOPS = LastUserStops({"shared_server": SHARED.stop, "shared_http_server": SHARED_HTTP.stop,
                                   "local_ray": SHARED_RAY.stop})


def pytest_collection_modifyitems(config, items):
    group_users(items, "shared_server")
    group_users(items, "shared_http_server")
    group_users(items, "local_ray")


def pytest_collection_finish(session):
    _LAST_USER_STOPS.collected(session.items)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After the last user's own teardown (its module's fixtures, a restore among them), stop what it shared."""
    try:
        return (yield)
    finally:
        _LAST_USER_STOPS.torn_down(item)


def pytest_terminal_summary(terminalreporter):
    if SHARED_RAY.starts:
        terminalreporter.write_line(f"shared local Ray: {SHARED_RAY.starts} start(s) for "
                                    f"{SHARED_RAY.modules} in-process module(s)")
