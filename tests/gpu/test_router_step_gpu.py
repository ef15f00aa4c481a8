"""The router's whole step on CUDA for every family (tests/router_step_cuda.py), and its decode step replayed as
CUDA graphs for every graphable family (tests/decode_graphs_cuda.py), as GPU tests: each runs its script's main and
prints its lines; they skip cleanly without CUDA or without transformers (which writes the tiny checkpoints)."""

from __future__ import annotations

import importlib

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("script", [
    "tests.router_step_cuda",  # the router step matches the CPU reference for every family
    "tests.decode_graphs_cuda",  # graphed decode matches eager for every graphable family
])
def test_gpu_script_passes(capsys, script):
    pytest.importorskip("transformers")
    main = importlib.import_module(script).main

    code = main([])
    lines = capsys.readouterr().out.splitlines()
    with capsys.disabled():
        print("\n" + "\n".join(lines))
    assert code == 0, [line for line in lines if line.startswith("FAIL")]
