"""Tensors on a 64-byte boundary on the CPU, so that a product's bits do not depend on where a tensor starts.

Two CPU kernels care where their operands start:
- One-row products. A decode step sends one token to most experts, and BLAS computes that [1, K] x [K, N] product as
  a gemv. The gemv peels leading elements until the weight reaches an aligned address and sums them separately, so
  the same weight at two addresses gives sums that differ in the last bit (measured: 1e-9 on a hidden-64 expert,
  enough to break "offloaded == resident bit for bit").
- torch's int8/int4 kernels read with aligned vector loads and fault on anything else (experts/quant.py).

Where a loaded weight starts is decided by its byte offset in the checkpoint file (a view into the read buffer),
while stacks, quantised weights and copies made by the offload tiers start on the allocator's 64-byte boundary.
So every loaded expert weight is put on that boundary once, at load (experts/weights.py). The copy changes no
value.
"""

from __future__ import annotations

import torch

CPU_ALIGN = 64  # bytes: torch's CPU allocator boundary (c10 gAlignment), and a cache line


def aligned(t: torch.Tensor) -> torch.Tensor:
    """t itself when it is contiguous and starts on a CPU_ALIGN boundary (or is not on the CPU), else a fresh
    contiguous copy, which torch's allocator places on one."""
    if t.device.type == "cpu" and (not t.is_contiguous() or t.data_ptr() % CPU_ALIGN):
        return t.clone(memory_format=torch.contiguous_format)
    return t.contiguous()
