"""Unit tests run tiny tensors: one intra-op thread is faster than many (and far faster on a loaded machine)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _single_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def fc():
    """The fake-CUDA double open for one test (ops/fake_cuda/__init__.py)."""
    from expertmesh.ops.fake_cuda import fake_cuda

    with fake_cuda() as fc:
        yield fc
