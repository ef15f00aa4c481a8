"""CPU products whose bits depend on the rows' values only: not on where the operands start, how many rows share the
call, or how many threads compute it.

"Distributed == reference bit for bit" needs each expert row to give the same bits wherever it is computed: in the
reference (a layer's whole batch, the process's threads), in an actor (its share of the rows, the cores Ray gave
it), in a replica's chunk of an expert's rows, one token per expert at decode. MKL's float32 gemm (torch's CPU
matmul) does not guarantee that by itself; measured on this box (AMD EPYC, torch 2.13's MKL):
- *Thread count.* At 2 threads a product splits differently than at 1 ([12, 32] x [32, 96]: last-bit
  differences). Fixed by MKL's strict conditional-numerical-reproducibility mode, MKL_CBWR=AUTO,STRICT, which
  experts/__init__.py sets before any math runs (MKL reads it at its first call).
- *Rows per call.* A product of 1 row (gemv) or 2-3 rows takes other kernels than one of >= 4 rows, and gives
  other bits for the same row; among calls of >= 4 rows a row's bits do not depend on the others (45,700 row
  ranges checked at 1 and 2 threads in strict mode, 0 differences; without strict mode, 2 threads differed).
  So CPU expert products get at least MIN_ROWS rows: a call with fewer is padded with zero rows, whose results are
  dropped (`padded_linear`, and the grouped path pads each group).
- *Alignment.* A one-row gemv peels to an aligned address, so its sums depend on where the weight starts; loaded
  expert weights go on a 64-byte boundary once, at load (`aligned`; experts/weights.py). torch's int8/int4 kernels
  also need aligned rows (experts/quant.py).

GPU products are left as they are: cuBLAS picks kernels by shape too, and whether rows agree there is not checked.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CPU_ALIGN = 64  # bytes: torch's CPU allocator boundary (c10 gAlignment), and a cache line
MIN_ROWS = 4  # fewer rows than this take MKL's gemv / small-M kernels, whose bits differ for the same row
# Device types whose products run on the CPU's MKL kernels, so get padded. The fake-CUDA double (ops/fake_cuda) adds
# "cuda" while it is open: its "cuda" tensors compute on the CPU, and a router step on it must give the CPU router's
# bits (on some CPUs MKL's 1-row and 4-row kernels agree and the difference hid; on others they do not).
CPU_KERNEL_DEVICES: frozenset[str] = frozenset({"cpu"})


def aligned(t: torch.Tensor) -> torch.Tensor:
    """t itself when it is contiguous and starts on a CPU_ALIGN boundary (or is not on the CPU), else a fresh
    contiguous copy, which torch's allocator places on one."""
    if t.device.type == "cpu" and (not t.is_contiguous() or t.data_ptr() % CPU_ALIGN):
        return t.clone(memory_format=torch.contiguous_format)
    return t.contiguous()


def padded_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, computed on at least MIN_ROWS rows on the CPU. x: [T, K] -> [T, N]."""
    rows = x.shape[0]
    if x.device.type not in CPU_KERNEL_DEVICES or rows == 0 or rows >= MIN_ROWS:
        return F.linear(x, weight, bias)
    return F.linear(torch.cat([x, x.new_zeros(MIN_ROWS - rows, x.shape[1])]), weight, bias)[:rows]  # [T, N]
