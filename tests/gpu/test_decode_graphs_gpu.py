"""CUDA graphs for the router's decode step on CUDA for every graphable family (tests/decode_graphs_cuda.py), as a
GPU test: skips cleanly without CUDA or without transformers (which writes the tiny checkpoints)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_graphed_decode_matches_eager_on_cuda_for_every_graphable_family(capsys):
    pytest.importorskip("transformers")
    from tests.decode_graphs_cuda import main

    code = main([])
    lines = capsys.readouterr().out.splitlines()
    with capsys.disabled():
        print("\n" + "\n".join(lines))
    assert code == 0, [line for line in lines if line.startswith("FAIL")]
