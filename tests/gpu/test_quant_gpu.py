"""Quantised experts (experts/quant.py) on CUDA, Ray-free: a weight quantised on the CPU (INT4 in the CPU kernel's
layout) moves to the GPU and back with the same integers and scales, computes there as its dequantised weight does,
and quantising on the GPU gives the CPU's result within one step. Skips cleanly without CUDA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from expertmesh.experts.ffn import GatedMLPWeights, activation, gated_mlp
from expertmesh.experts.quant import quantize, quantize_mlp

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

CUDA = torch.device("cuda:0")
TOL = {torch.bfloat16: 0.03, torch.float32: 1e-4}  # relative to the largest output


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_a_cpu_quantised_weight_moves_to_cuda_and_back_and_computes_as_dequantised(mode, dtype):
    w = (torch.randn(256, 384, generator=torch.Generator().manual_seed(0)) * 0.05).to(dtype)
    cpu = quantize(w, mode)
    gpu = cpu.to(CUDA)
    assert gpu.device.type == "cuda" and gpu.nbytes() == cpu.nbytes()
    assert torch.equal(gpu.dequantize().cpu(), cpu.dequantize())  # same integers, scales (and zeros)
    assert torch.equal(gpu.to("cpu").dequantize(), cpu.dequantize())
    x = torch.randn(5, 384, device=CUDA).to(dtype)
    want = F.linear(x.float(), gpu.dequantize(torch.float32))  # [5, 256]
    got = gpu.linear(x)
    assert got.device.type == "cuda" and got.dtype == dtype
    assert (got.float() - want).abs().max() <= TOL[dtype] * want.abs().max(), gpu.kernel


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantising_on_cuda_matches_the_cpu_within_one_step(mode):
    w = torch.randn(128, 256, generator=torch.Generator().manual_seed(1)) * 0.05
    on_cpu = quantize(w, mode).dequantize()
    on_gpu = quantize(w.to(CUDA), mode).dequantize().cpu()
    step = (w.abs().amax(dim=1, keepdim=True) / 127 if mode == "int8"
            else (w.view(128, 2, 128).amax(-1) - w.view(128, 2, 128).amin(-1)).repeat_interleave(128, 1) / 15)
    assert ((on_gpu - on_cpu).abs() <= step * 1.01).all()


def test_a_quantised_expert_computes_on_cuda_as_on_the_cpu():
    gen = torch.Generator().manual_seed(2)
    expert = GatedMLPWeights(torch.randn(512, 256, generator=gen) * 0.05, torch.randn(256, 256, generator=gen) * 0.05)
    act = activation("silu")
    for mode in ("int8", "int4"):
        cpu = quantize_mlp(expert, mode)
        x = torch.randn(7, 256, generator=gen)
        want = gated_mlp(x, cpu, act)
        got = gated_mlp(x.to(CUDA), cpu.to(CUDA), act).cpu()
        assert (got - want).abs().max() <= 1e-4 * max(1.0, want.abs().max().item())
