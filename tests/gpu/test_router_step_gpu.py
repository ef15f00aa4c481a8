"""The router's whole step on CUDA for every family (tests/router_step_cuda.py), as a GPU test: skips cleanly
without CUDA or without transformers (which writes the tiny checkpoints)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_router_step_on_cuda_matches_the_cpu_reference_for_every_family(capsys):
    pytest.importorskip("transformers")
    from tests.router_step_cuda import main

    code = main([])
    lines = capsys.readouterr().out.splitlines()
    with capsys.disabled():
        print("\n" + "\n".join(lines))
    assert code == 0, [line for line in lines if line.startswith("FAIL")]
