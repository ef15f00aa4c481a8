"""NIXL's progress thread, made to wait for events instead of spinning.

NIXL's Python agent (nixl 1.5, `nixl._api.nixl_agent.__init__`) starts its UCX progress thread with
`pthrDelay = 0`, and the thread's loop polls the UCX workers' event descriptors with that delay as its `poll()`
timeout: with 0 it never sleeps. Every process with an agent (the router and each expert actor on the `rdt`
transport: Ray makes one on first use) then keeps a core busy while idle. Measured on the 2-core box: 4.9 s of CPU in
5 s idle, in each process; with a 1 ms delay 0.08 s, and one router ↔ actor round of 8 rows fell from 16 ms to
6.6 ms (`bench dispatch --transport rdt --workload decode`: the layer round from 117 to 44 ms). With a delay the
thread still wakes at once when a worker's descriptor signals (an incoming transfer); the delay only bounds how long
it sleeps without one. Ray creates the agent itself (`nixl_tensor_transport.py: _make_nixl_agent`) and neither Ray
nor NIXL's Python exposes the delay, so the config class NIXL's Python instantiates is swapped for one that replaces
a delay of 0 with PROGRESS_WAIT_US. Processes that never make an agent are unaffected.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

PROGRESS_WAIT_US = 1000  # poll() takes milliseconds: NIXL rounds this up to 1 ms


def quiet_nixl_progress_thread() -> bool:
    """Make NIXL agents created in this process from now on wait PROGRESS_WAIT_US for events instead of spinning.
    -> whether NIXL is installed (nothing to do without it). Idempotent."""
    try:
        import nixl._api as api
    except ImportError:
        return False
    config = getattr(getattr(api, "nixlBind", None), "nixlAgentConfig", None)
    if config is None:  # another NIXL whose Python is laid out differently: leave it as it is, and say so
        log.warning("NIXL's agent config is not where nixl 1.5 keeps it: its progress thread may spin while idle "
                    "(experts/nixl_progress.py)")
        return True
    if getattr(config, "expertmesh_quiet", False):
        return True

    class EventDrivenConfig(config):
        expertmesh_quiet = True

        def __setattr__(self, name: str, value) -> None:
            if name == "pthrDelay" and value == 0:
                value = PROGRESS_WAIT_US
            super().__setattr__(name, value)

    api.nixlBind.nixlAgentConfig = EventDrivenConfig
    return True
