"""Logit rules (sampling.adjust_logits) on CUDA: the same values as on the CPU, on the logits' device, and the
greedy choice after them the same token. Skips without CUDA."""

from __future__ import annotations

import pytest
import torch

from expertmesh.router_service.sampling import SamplingParams, adjust_logits, choose

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_adjusted_logits_on_cuda_equal_the_cpus():
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(0))  # [V]
    params = SamplingParams(presence_penalty=0.7, frequency_penalty=-0.3, repetition_penalty=1.4,
                            logit_bias=((3, 5.0), (999, -100.0)))
    prompt, output = [1, 5, 5, 900], [3, 3, 42, 7]
    cpu = adjust_logits(logits, params, prompt, output, frozenset({7, 8}))
    cuda = adjust_logits(logits.cuda(), params, prompt, output, frozenset({7, 8}))
    assert cuda.device.type == "cuda"
    assert torch.equal(cuda.cpu(), cpu)
    assert int(choose(cuda, SamplingParams())) == int(choose(cpu, SamplingParams()))
