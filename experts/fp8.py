"""Block-scaled FP8 checkpoints (DeepSeek-V3's published format), dequantised on load.

A linear weight `X.weight` [R, C] is stored as float8_e4m3fn next to `X.weight_scale_inv` [ceil(R/bR), ceil(C/bC)]
float32, one scale per bR x bC block (`quantization_config.weight_block_size`, [128, 128] in the published
checkpoints); the real weight is weight * scale_inv of its block. Embeddings, norms, the router gate and lm_head stay
unquantised. We dequantise in float32 and the loaders cast to the serving dtype, so an FP8 checkpoint is served in
bf16/fp32 like any other (transformers does the same on a machine without FP8 matmuls).
"""

from __future__ import annotations

import math

import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn
SCALE_SUFFIX = "_scale_inv"


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """The scale grid of a weight of `shape` ([..., R, C]): [..., ceil(R/bR), ceil(C/bC)]."""
    *lead, rows, cols = shape
    return (*lead, math.ceil(rows / block[0]), math.ceil(cols / block[1]))


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """weight [..., R, C] (float8) and scale_inv [..., ceil(R/bR), ceil(C/bC)] -> float32 [..., R, C].

    A trailing partial block (R or C not a multiple of the block) uses its block's scale, as DeepSeek's
    `weight_dequant` kernel does."""
    rows, cols = weight.shape[-2:]
    assert tuple(scale_inv.shape) == scale_shape(tuple(weight.shape), block), (weight.shape, scale_inv.shape, block)
    scale = scale_inv.float().repeat_interleave(block[0], dim=-2)[..., :rows, :]  # [..., R, ceil(C/bC)]
    scale = scale.repeat_interleave(block[1], dim=-1)[..., :cols]  # [..., R, C]
    return weight.float() * scale


def quantize(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The published recipe (DeepSeek-V3 `weight_quant`): per block, scale = amax / 448 and q = weight / scale in
    float8_e4m3fn. weight [R, C] -> (q [R, C] float8_e4m3fn, scale_inv [ceil(R/bR), ceil(C/bC)] float32).
    Used by tests and tools that build FP8 checkpoints."""
    rows, cols = weight.shape
    grid_r, grid_c = scale_shape((rows, cols), block)
    padded = torch.zeros(grid_r * block[0], grid_c * block[1], dtype=torch.float32)
    padded[:rows, :cols] = weight.float()
    blocks = padded.view(grid_r, block[0], grid_c, block[1])  # [gR, bR, gC, bC]
    amax = blocks.abs().amax(dim=(1, 3))  # [gR, gC]
    scale_inv = (amax / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)  # [gR, gC]
    q = (blocks / scale_inv[:, None, :, None]).view_as(padded)[:rows, :cols]
    return q.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).contiguous(), scale_inv


def scale_names(reader, wanted: dict[str, tuple[int, ...] | None], block: tuple[int, int]
                ) -> dict[str, tuple[int, ...] | None]:
    """The `X.weight_scale_inv` tensors the checkpoint has for the `X.weight`s in `wanted` -> their expected grid."""
    scales: dict[str, tuple[int, ...] | None] = {}
    for name, shape in wanted.items():
        scale_name = name + SCALE_SUFFIX
        if name.endswith(".weight") and reader.has(scale_name):
            scales[scale_name] = None if shape is None else scale_shape(tuple(shape), block)
    return scales


def read_weights(reader, wanted: dict[str, tuple[int, ...] | None], block: tuple[int, int] | None,
                 progress: str | None = None, **read_options) -> dict[str, torch.Tensor]:
    """reader.read_many(wanted), with every `X.weight` that has an `X.weight_scale_inv` in the checkpoint
    dequantised (float32). block None (not an FP8 checkpoint) reads the tensors as they are. read_options:
    read_many's on_bytes / device."""
    if block is None:
        return reader.read_many(wanted, progress=progress, **read_options)
    scales = scale_names(reader, wanted, block)
    tensors = reader.read_many(wanted | scales, progress=progress, **read_options)
    for scale_name in scales:
        name = scale_name[: -len(SCALE_SUFFIX)]
        tensors[name] = dequantize(tensors[name], tensors.pop(scale_name), block)
    return tensors
