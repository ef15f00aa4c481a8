"""MXFP4 (OCP microscaling FP4) expert weights, as gpt-oss publishes them: dequantise on load.

On disk, a weight W [rows, cols] is stored as
  `*_blocks` u8 [rows, cols/32, 16]: 32 E2M1 values per block, two per byte (low nibble first), and
  `*_scales` u8 [rows, cols/32]: one power-of-two exponent per block, biased by 127,
with any leading expert axis in front ([E, rows, cols/32, 16]). Value = FP4_VALUES[nibble] * 2**(scale - 127).

`dequantize` does exactly what transformers' `integrations.mxfp4.convert_moe_packed_tensors` does (the same lookup
and `ldexp` in the target dtype, so the result is equal bit for bit; tests/unit/test_mxfp4.py compares them), but
for one expert at a time and without the final transpose: it returns the weight as [rows, cols], which for gpt-oss is
already `F.linear`'s [out, in]. `quantize` is the inverse used to build test checkpoints (round to nearest E2M1).
Pure torch.
"""

from __future__ import annotations

import torch

# E2M1 code -> value (bit 3 is the sign), the table transformers and the gpt-oss reference use.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32  # values per scale
SCALE_BIAS = 127


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """blocks [..., rows, G, 16] u8, scales [..., rows, G] u8 -> [..., rows, G*32] in `dtype`."""
    assert blocks.shape[:-1] == scales.shape, f"blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}"
    lut = torch.tensor(FP4_VALUES, dtype=dtype, device=blocks.device)  # [16]
    blocks = blocks.to(torch.uint8)
    exponents = scales.to(torch.int32) - SCALE_BIAS  # [..., rows, G]
    out = torch.empty(*blocks.shape[:-1], blocks.shape[-1] * 2, dtype=dtype, device=blocks.device)  # [..., G, 32]
    out[..., 0::2] = lut[(blocks & 0x0F).to(torch.int)]  # low nibble: the even element
    out[..., 1::2] = lut[(blocks >> 4).to(torch.int)]
    # ldexp computes in float32 for a bf16 input (2**e is float32); transformers writes it back into `dtype`, so do we
    out = torch.ldexp(out, exponents[..., None]).to(dtype)  # [..., rows, G, 32]
    return out.reshape(*out.shape[:-2], -1)  # [..., rows, G*32]


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [..., rows, cols] (cols a multiple of 32) -> (blocks [..., rows, cols/32, 16] u8, scales u8).

    Per block of 32: the exponent is the smallest that puts the block's largest magnitude within E2M1's range (6),
    then each value rounds to the nearest representable value (ties to the lower magnitude)."""
    *lead, cols = weight.shape
    assert cols % BLOCK == 0, f"the last axis ({cols}) must be a multiple of {BLOCK}"
    w = weight.float().reshape(*lead, cols // BLOCK, BLOCK)  # [..., G, 32]
    amax = w.abs().amax(-1).clamp(min=torch.finfo(torch.float32).tiny)  # [..., G]
    exponent = torch.ceil(torch.log2(amax / 6.0)).clamp(-SCALE_BIAS, 127).to(torch.int32)  # [..., G]
    scaled = torch.ldexp(w, -exponent[..., None])  # [..., G, 32], |x| <= 6
    magnitudes = torch.tensor(FP4_VALUES[:8])  # [8]
    codes = (scaled.abs()[..., None] - magnitudes).abs().argmin(-1)  # [..., G, 32] in 0..7
    codes = codes + 8 * (scaled < 0).to(codes.dtype)  # sign bit
    codes = codes.to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)  # [..., G, 16]
    return blocks.contiguous(), (exponent + SCALE_BIAS).to(torch.uint8)
