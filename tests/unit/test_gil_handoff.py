"""The serving processes' GIL switch interval (experts/gil_handoff.py): set to 0.5 ms, and called by the router
deployment, the expert actor and the HTTP front (checked by reading their sources: starting them needs Ray)."""

from __future__ import annotations

import inspect
import sys

from expertmesh.experts import gil_handoff


def test_the_switch_interval_becomes_half_a_millisecond():
    before = sys.getswitchinterval()
    try:
        gil_handoff.shorten_gil_switch_interval()
        assert abs(sys.getswitchinterval() - 0.0005) < 1e-9
    finally:
        sys.setswitchinterval(before)


def test_every_serving_process_shortens_it():
    from expertmesh.experts.actor import ExpertActor
    from expertmesh.router_service.deployment import RouterDeployment
    from expertmesh.router_service.http_front import start_http_front

    router_init = RouterDeployment.func_or_class.__init__ if hasattr(RouterDeployment, "func_or_class") \
        else RouterDeployment.__init__
    actor_init = getattr(ExpertActor, "__ray_metadata__", None)
    actor_cls = actor_init.modified_class if actor_init is not None else ExpertActor
    for fn in (router_init, actor_cls.__init__, start_http_front):
        assert "shorten_gil_switch_interval()" in inspect.getsource(fn), fn
