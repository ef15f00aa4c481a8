"""NIXL's progress thread waits for events instead of spinning (experts/nixl_progress.py)."""

from __future__ import annotations

import pytest

from expertmesh.experts.nixl_progress import PROGRESS_WAIT_US, quiet_nixl_progress_thread


def test_an_agent_config_asking_for_no_delay_gets_the_event_wait():
    api = pytest.importorskip("nixl._api")
    assert quiet_nixl_progress_thread() is True
    config = api.nixlBind.nixlAgentConfig()
    config.pthrDelay = 0  # what nixl_agent.__init__ sets
    assert config.pthrDelay == PROGRESS_WAIT_US
    config.pthrDelay = 5000  # an explicit delay is kept
    assert config.pthrDelay == 5000


def test_quieting_twice_wraps_the_config_once():
    api = pytest.importorskip("nixl._api")
    quiet_nixl_progress_thread()
    first = api.nixlBind.nixlAgentConfig
    quiet_nixl_progress_thread()
    assert api.nixlBind.nixlAgentConfig is first


def test_an_agent_made_after_quieting_works_and_does_not_spin_while_idle():
    """The swapped config is what nixl_agent builds its C++ agent from: an agent still starts and registers memory,
    and its progress thread sleeps while idle (spinning, it took ~1 CPU-second per second here)."""
    import time

    api = pytest.importorskip("nixl._api")
    torch = pytest.importorskip("torch")
    quiet_nixl_progress_thread()
    agent = api.nixl_agent("expertmesh-progress-test", api.nixl_agent_config(backends=["UCX"]))
    buffer = torch.zeros(64, dtype=torch.uint8)
    registered = agent.register_memory(buffer)
    agent.deregister_memory(registered)
    cpu, wall = time.process_time(), time.monotonic()
    time.sleep(1.0)
    used = (time.process_time() - cpu) / (time.monotonic() - wall)
    assert used < 0.3, f"the process used {used:.2f} CPU-seconds per second while its NIXL agent idled"


def test_a_nixl_laid_out_differently_is_left_alone_with_a_warning(monkeypatch, caplog):
    """An upgrade that moves the config class must not break the import of the rdt transport (and every actor)."""
    api = pytest.importorskip("nixl._api")
    monkeypatch.delattr(api, "nixlBind")
    with caplog.at_level("WARNING"):
        assert quiet_nixl_progress_thread() is True
    assert "progress thread may spin" in caplog.text
