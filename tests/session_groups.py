"""Session-wide resources that stop after their last user instead of at the session's end, with their users run
one after another (issue 25: tests that boot less). Two use it: the shared server (tests/shared_server.py) and the
shared local Ray (tests/shared_ray.py). Grouping matters on the 2-core CI machine: an idle server or Ray left up
between its users would take CPU from every module in between, and a shared Ray in this process must be gone before
a module that starts a Ray of its own (a `ray.cluster_utils.Cluster`, a Ray with other settings) runs."""

from __future__ import annotations

from collections.abc import Callable


def _module(item) -> str:
    return item.nodeid.split("::")[0]


def group_users(items: list, fixture: str) -> None:
    """Reorder `items` in place so the modules with a test using `fixture` run consecutively, where the first of
    them was; every other module and the order within each module stay as they were."""
    modules = {_module(item) for item in items if fixture in getattr(item, "fixturenames", ())}
    if not modules:
        return
    first = next(i for i, item in enumerate(items) if _module(item) in modules)
    grouped = [item for item in items[first:] if _module(item) in modules]
    rest = [item for item in items[first:] if _module(item) not in modules]
    items[first:] = grouped + rest


class LastUserStops:
    """fixture name -> a stop function, called once after the teardown of the last collected test that uses it."""

    def __init__(self, stops: dict[str, Callable[[], None]]):
        self.stops = stops
        self.last: dict[str, str] = {}  # node id of the last user -> fixture

    def collected(self, items: list) -> None:
        self.last = {}
        for fixture in self.stops:
            users = [item.nodeid for item in items if fixture in getattr(item, "fixturenames", ())]
            if users:
                self.last[users[-1]] = fixture

    def torn_down(self, item) -> None:
        fixture = self.last.get(item.nodeid)
        if fixture is not None:
            self.stops[fixture]()
