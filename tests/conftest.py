"""Session-wide tiny checkpoints (built once, shared by unit and integration tests)."""

from __future__ import annotations

import pytest

from tests.tiny_checkpoints import write_direct_mixtral, write_hf_checkpoint

FAMILIES = ("mixtral", "qwen2_moe", "olmoe")


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict:
    """name -> folder: one per family, a sharded Mixtral, and one written with safetensors alone."""
    root = tmp_path_factory.mktemp("ckpt")
    dirs = {family: write_hf_checkpoint(family, root / family, seed=i) for i, family in enumerate(FAMILIES)}
    dirs["mixtral_sharded"] = write_hf_checkpoint("mixtral", root / "mixtral_sharded", seed=7, max_shard_size="40KB")
    dirs["direct"] = write_direct_mixtral(root / "direct", seed=3)
    return dirs


@pytest.fixture(scope="session")
def router_step_checkpoints(tmp_path_factory) -> dict:
    """family -> folder for every family the router-step scenarios run (tests/router_step_cuda.py FAMILIES), written
    once per session (per xdist worker) for the fake-CUDA router step and the decode-graph tests."""
    from tests.router_step_cuda import FAMILIES as STEP_FAMILIES
    from tests.router_step_cuda import write_checkpoint

    root = tmp_path_factory.mktemp("router-step-models")
    return {family: write_checkpoint(family, root / family) for family in STEP_FAMILIES}
