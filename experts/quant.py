"""Weight-only quantised expert matrices (`experts.quant`): INT8 per output channel, INT4 in groups along the input.

A `QuantizedLinear` replaces one F.linear weight [N, K] (out, in) of an expert; activations stay in the serving dtype
and only the weights are stored narrow. `GatedMLPWeights` (experts/ffn.py) holds them in place of its gate_up/down
tensors, so everything that moves or sizes an expert (`.to(device)`, `.nbytes()`) works on either.

- int8: symmetric per output row: w ≈ q · s, q ∈ [-127, 127] int8 [N, K], s [N] (absmax / 127).
- int4: asymmetric per group of `INT4_GROUP` (128) inputs along K: w ≈ (q - 8) · scale + zero, q ∈ [0, 15], two
  per byte; scale and zero [G, N, 2] (G = ceil(K / group)), the layout torch's int4 kernel takes. A row shorter
  than 128 (K < 128) is one group, i.e. per-row INT4; a K that is not a multiple of 128 ends in a shorter group.

Scales (and zeros) are stored in the serving dtype, rounded first, and the integers are computed against the rounded
values, so what is dequantised is what was quantised against. Quantising works on blocks of rows in float32, so a
bf16 tensor is never widened whole.

Matmuls: torch's packed kernel where a probe run once per process (like grouped_ffn's `_grouped_mm_runs`) finds it
correct and the measurements below find it faster, else F.linear on the weight dequantised per call. The choice
depends only on device, dtype, shape and a call's row count, so every process on one machine makes the same choice
for the same rows and the actors equal the reference bit for bit:
- int8: `torch._weight_int8pack_mm(x, q, s)` for bf16/fp16 activations, on CPU for calls of at most
  INT8_KERNEL_MAX_ROWS rows (decode); float32 activations, and larger CPU calls, dequantise.
- int4: for bf16/fp16 on CPU `torch._weight_int4pack_mm_for_cpu` on the weight kept in
  `_convert_weight_to_int4pack_for_cpu`'s layout (layout "cpu_int4pack"; that kernel needs N a multiple of 16 and
  whole groups of a size it supports); float32, other devices, or a shape the probe refuses: the plain two-per-byte
  layout ("nibbles") dequantised per call. Moving a
  "cpu_int4pack" weight off the CPU unpacks it through the kernel's own nibble order, learned by packing index
  patterns (`_cpu_pack_order`), so no second copy of the weight is kept.
`QuantizedLinear.kernel` names the path a weight takes.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .reproducible import CPU_ALIGN, aligned, padded_linear
from .setting_choices import QUANT_MODES

INT4_GROUP = 128
_ROW_BLOCK = 1024  # rows quantised at a time: bounds the float32 working copy

# When the packed kernels pay, measured on this project's CPU (x86 AVX-512, torch 2.13, one thread, a [5632, 1024]
# weight; ms for 8 / 128 rows). float32 activations: F.linear 3.0 / 16; int8 kernel 87 / 1740, dequantise-per-call
# 16 / 40; int4 kernel 187 / 8134, dequantise 145 / 112 -- torch's CPU kernels have no fast float32 path, so float32
# always dequantises. bfloat16: F.linear 1.5 / 11.5; int8 kernel 2.3 / 59, dequantise 12.7 / 14.3 -- the int8
# kernel for decode-sized calls only; int4 kernel 1.5 / 47, dequantise 181 / 119 -- the int4 kernel always. The
# choice depends only on dtype and row count, which a call's rows have in the actor and in the reference alike, so
# the bits agree.
INT8_KERNEL_MAX_ROWS = 32

_int8_ok: dict[tuple[str, torch.dtype], bool] = {}
_int4_cpu_ok: dict[tuple[int, int, int, torch.dtype], bool] = {}
_pack_orders: dict[tuple[int, int], torch.Tensor] = {}


@dataclass(frozen=True)
class QuantizedLinear:
    """One weight [N, K] stored quantised. qweight: int8 [N, K] ("rows") or uint8 [N, K/2] ("nibbles":
    byte j = q[2j] | q[2j+1] << 4; "cpu_int4pack": torch's CPU kernel layout). scales: int8 [N];
    int4 [G, N, 2] = (scale, zero), in the activation dtype."""

    mode: str
    shape: tuple[int, int]
    qweight: torch.Tensor
    scales: torch.Tensor
    group: int = 0
    layout: str = "rows"

    @property
    def dtype(self) -> torch.dtype:
        return self.scales.dtype

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    @property
    def kernel(self) -> str:
        """The matmul this weight takes on its device and dtype (int8: by the call's row count)."""
        if self.mode == "int8":
            if not _int8_kernel_dtype(self.device, self.dtype) or not _int8_runs(self.device, self.dtype):
                return "dequantize"
            if self.device.type == "cpu":
                if not _cpu_int8_shape_ok(self):
                    return "dequantize"
                return f"_weight_int8pack_mm up to {INT8_KERNEL_MAX_ROWS} rows, dequantize above"
            return "_weight_int8pack_mm"
        return "_weight_int4pack_mm_for_cpu" if self.layout == "cpu_int4pack" else "dequantize"

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales))

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None,
           non_blocking: bool = False) -> QuantizedLinear:
        """On `device`, with scales in `dtype` (the activations'); int4 re-laid for that device's kernel."""
        device = torch.device(device) if device is not None else self.device
        dtype = dtype or self.dtype
        if self.mode == "int8":
            return dataclasses.replace(self, qweight=self.qweight.to(device, non_blocking=non_blocking),
                                       scales=self.scales.to(device, dtype, non_blocking=non_blocking))
        if device == self.device and dtype == self.dtype:
            return self
        nibbles = self._nibbles().to(device, non_blocking=non_blocking)  # [N, K/2]
        return _int4_weight(nibbles, self.scales.to(device, dtype, non_blocking=non_blocking), self.shape, self.group)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The weight [N, K] these integers and scales stand for, in `dtype` (default: the scales')."""
        dtype = dtype or self.dtype
        n, k = self.shape
        if self.mode == "int8":
            return self.qweight.to(dtype) * self.scales.to(dtype)[:, None]  # [N, K]
        q = unpack_nibbles(self._nibbles()).to(dtype)  # [N, K]
        scale, zero = (self.scales[..., i].t().to(dtype) for i in (0, 1))  # [N, G] each
        if k % self.group == 0:  # whole groups: broadcast, no [N, K] copies of the scales
            groups = q.view(n, -1, self.group)  # [N, G, group]
            return ((groups - 8) * scale[..., None] + zero[..., None]).view(n, k)  # [N, K]
        scale, zero = (t.repeat_interleave(self.group, dim=1)[:, :k] for t in (scale, zero))  # [N, K] each
        return (q - 8) * scale + zero  # [N, K]

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x @ W.T (+ bias). x: [T, K] -> [T, N]."""
        if x.shape[0] == 0:
            y = x.new_zeros((0, self.shape[0]))
        elif self.mode == "int8" and x.dtype == self.dtype and _int8_kernel_dtype(x.device, x.dtype) and (
                x.device.type != "cpu" or (x.shape[0] <= INT8_KERNEL_MAX_ROWS and _cpu_int8_shape_ok(self))) and (
                _int8_runs(x.device, x.dtype)):
            y = torch._weight_int8pack_mm(aligned(x), self.qweight, self.scales)  # [T, N]
        elif self.layout == "cpu_int4pack" and x.dtype == self.dtype:
            y = torch._weight_int4pack_mm_for_cpu(aligned(x), self.qweight, self.group, self.scales)  # [T, N]
        else:
            return padded_linear(x, self.dequantize(x.dtype), bias)  # [T, N]
        return y if bias is None else y + bias

    def _nibbles(self) -> torch.Tensor:
        """The weight in the plain two-per-byte layout, [N, K/2] uint8."""
        if self.layout == "nibbles":
            return self.qweight
        order = _cpu_pack_order(*self.shape)  # [N*K]: flat source index of each packed nibble
        packed = self.qweight.cpu()
        nib = torch.stack([packed & 15, packed >> 4], dim=-1).reshape(-1)  # [N*K], in packed order
        q = torch.empty_like(nib)
        q[order] = nib
        return pack_nibbles(q.view(self.shape)).to(self.device)


def linear(x: torch.Tensor, weight: torch.Tensor | QuantizedLinear, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for a plain or a quantised weight. x: [T, K] -> [T, N]."""
    if isinstance(weight, QuantizedLinear):
        return weight.linear(x, bias)
    return padded_linear(x, weight, bias)  # experts/reproducible.py: a row's bits not depending on its call


def tensor_nbytes(t: torch.Tensor | QuantizedLinear | None) -> int:
    if t is None:
        return 0
    if isinstance(t, QuantizedLinear):
        return t.nbytes()
    return t.numel() * t.element_size()


def quantize(w: torch.Tensor, mode: str, dtype: torch.dtype | None = None) -> QuantizedLinear:
    """w: [N, K] (any float dtype, any device) -> QuantizedLinear on w's device, scales in `dtype` (default w's)."""
    dtype = dtype or w.dtype
    if mode == "int8":
        return _quantize_int8(w, dtype)
    if mode == "int4":
        return _quantize_int4(w, dtype)
    raise ValueError(f"quant mode must be one of {QUANT_MODES[1:]}, got {mode!r}")


def quantize_mlp(weights, mode: str):
    """A GatedMLPWeights (experts/ffn.py) with gate_up and down quantised; biases stay in the serving dtype.
    mode "none" returns it unchanged."""
    if mode == "none":
        return weights
    if mode not in QUANT_MODES:
        raise ValueError(f"quant mode must be one of {QUANT_MODES}, got {mode!r}")
    return dataclasses.replace(weights, gate_up=quantize(weights.gate_up, mode), down=quantize(weights.down, mode))


def _row_blocks(w: torch.Tensor):
    for start in range(0, w.shape[0], _ROW_BLOCK):
        yield w[start:start + _ROW_BLOCK].float()  # [B, K] float32: one block at a time, never the whole tensor


def _quantize_int8(w: torch.Tensor, dtype: torch.dtype) -> QuantizedLinear:
    qs, ss = [], []
    for block in _row_blocks(w):
        scale = (block.abs().amax(dim=1) / 127).to(dtype).float()  # [B], rounded to how it is stored
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row: q = 0
        qs.append(torch.round(block / scale[:, None]).clamp(-127, 127).to(torch.int8))  # [B, K]
        ss.append(scale)
    return QuantizedLinear("int8", tuple(w.shape), torch.cat(qs), torch.cat(ss).to(dtype))


def int4_group(k: int) -> int:
    """INT4_GROUP, or the whole row when it is shorter."""
    return min(INT4_GROUP, k)


def _quantize_int4(w: torch.Tensor, dtype: torch.dtype) -> QuantizedLinear:
    n, k = w.shape
    if k % 2:
        raise ValueError(f"int4 packs two inputs per byte: the input size must be even, got {k}")
    group = int4_group(k)
    groups = math.ceil(k / group)
    qs, sz = [], []
    for block in _row_blocks(w):
        # A last group shorter than `group` is padded with its own last value (changes neither min nor max).
        padded = F.pad(block[:, None, :], (0, groups * group - k), mode="replicate")[:, 0]  # [B, G*group]
        g = padded.view(block.shape[0], groups, group)  # [B, G, group]
        low, high = g.amin(dim=-1), g.amax(dim=-1)  # [B, G]
        scale = ((high - low) / 15).to(dtype).float()  # [B, G], rounded to how it is stored
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # a constant group: q = 8, w = zero
        zero = (low + 8 * scale).to(dtype).float()  # [B, G]
        q = torch.round((g - zero[..., None]) / scale[..., None]) + 8  # [B, G, group]
        qs.append(q.clamp(0, 15).to(torch.uint8).view(block.shape[0], -1)[:, :k])  # [B, K]
        sz.append(torch.stack([scale, zero], dim=-1))  # [B, G, 2]
    scales = torch.cat(sz).transpose(0, 1).contiguous().to(dtype)  # [G, N, 2]
    return _int4_weight(pack_nibbles(torch.cat(qs)), scales, (n, k), group)


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """q: [N, K] integers in [0, 15] -> [N, K/2] uint8, byte j = q[2j] | q[2j+1] << 4."""
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[N, K/2] uint8 -> [N, K] uint8 in [0, 15]."""
    return torch.stack([packed & 15, packed >> 4], dim=-1).view(packed.shape[0], -1)


def _int4_weight(nibbles: torch.Tensor, scales: torch.Tensor, shape: tuple[int, int], group: int) -> QuantizedLinear:
    """The int4 weight in the layout its device's kernel takes (CPU kernel if it runs for this shape), else nibbles."""
    n, k = shape
    if nibbles.device.type == "cpu" and scales.dtype != torch.float32 and _int4_cpu_runs(n, k, group, scales.dtype):
        packed = torch._convert_weight_to_int4pack_for_cpu(unpack_nibbles(nibbles).to(torch.int32), 1)  # [N, K/2]
        return QuantizedLinear("int4", shape, packed, scales, group, "cpu_int4pack")
    return QuantizedLinear("int4", shape, nibbles, scales, group, "nibbles")


# torch's CPU int8 kernel (aten/src/ATen/native/cpu/int8mm_kernel.cpp, AVX-512 and AVX2 paths) reads activations
# and weight rows with *aligned* vector loads, 16 inputs at a time, and does not check: an activation that is not
# 32-byte aligned (one that arrived over the wire, read in place from a gRPC or Ray buffer) faults with SIGSEGV,
# and a K that is not a multiple of 16 reads past each row. So the kernel gets rows copied to a fresh allocation
# (torch's CPU allocator aligns to 64 bytes; `aligned`, experts/reproducible.py) when they are not aligned, and
# weights with K % 16 != 0 dequantise. The int4 kernel takes the same care; the copy does not change a value, so the
# bits still agree with the reference.
def _cpu_int8_shape_ok(weight: QuantizedLinear) -> bool:
    """Whether every row of the weight and of a bf16/fp16 activation stays aligned for the CPU int8 kernel."""
    return weight.shape[1] % 16 == 0 and weight.qweight.data_ptr() % CPU_ALIGN == 0


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    tol = 1e-4 if got.dtype == torch.float32 else 3e-2
    return bool((got.float() - want).abs().max() <= tol * max(1.0, float(want.abs().max())))


def _int8_kernel_dtype(device: torch.device, dtype: torch.dtype) -> bool:
    """float32 on CPU dequantises (see INT8_KERNEL_MAX_ROWS)."""
    return not (device.type == "cpu" and dtype == torch.float32)


def _int8_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch._weight_int8pack_mm runs here and matches the dequantised product (probed once)."""
    key = (device.type, dtype)
    if key not in _int8_ok:
        ok = hasattr(torch, "_weight_int8pack_mm")
        if ok:
            try:
                gen = torch.Generator().manual_seed(0)
                w = torch.randn(64, 64, generator=gen)
                x = torch.randn(3, 64, generator=gen).to(device, dtype)
                q = _quantize_int8(w, dtype).to(device)
                got = torch._weight_int8pack_mm(x, q.qweight, q.scales)  # [3, 64]
                ok = _close(got, x.float() @ q.dequantize(torch.float32).t())
            except (RuntimeError, NotImplementedError, TypeError):
                ok = False
        _int8_ok[key] = ok
    return _int8_ok[key]


def _int4_cpu_runs(n: int, k: int, group: int, dtype: torch.dtype) -> bool:
    """Whether the CPU int4 kernel packs and multiplies this shape correctly (probed once per shape and dtype)."""
    key = (n, k, group, dtype)
    if key not in _int4_cpu_ok:
        ok = hasattr(torch, "_weight_int4pack_mm_for_cpu") and k % group == 0
        if ok:
            try:
                gen = torch.Generator().manual_seed(0)
                x = torch.randn(3, k, generator=gen).to(dtype)
                q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)
                scales = torch.stack([torch.rand(k // group, n, generator=gen) / 8 + 1e-3,
                                      torch.randn(k // group, n, generator=gen) / 8], dim=-1).to(dtype)  # [G, N, 2]
                weight = QuantizedLinear("int4", (n, k), pack_nibbles(q), scales, group, "nibbles")
                packed = torch._convert_weight_to_int4pack_for_cpu(q, 1)
                got = torch._weight_int4pack_mm_for_cpu(x, packed, group, scales)  # [3, N]
                ok = _close(got, x.float() @ weight.dequantize(torch.float32).t())
            except (RuntimeError, NotImplementedError, TypeError):
                ok = False
        _int4_cpu_ok[key] = ok
    return _int4_cpu_ok[key]


def _cpu_pack_order(n: int, k: int) -> torch.Tensor:
    """[N*K] int64: for each nibble of `_convert_weight_to_int4pack_for_cpu`'s output (byte by byte, low nibble
    first), the flat index n*K + k of the input it holds. Learned from the kernel itself by packing the index's
    base-16 digits, one digit per pass, so it follows whatever blocking the installed torch uses."""
    key = (n, k)
    if key not in _pack_orders:
        index = torch.arange(n * k, dtype=torch.int64).view(n, k)  # [N, K]
        order = torch.zeros(n * k, dtype=torch.int64)
        digit = 0
        while digit == 0 or (1 << (4 * digit)) < n * k:
            packed = torch._convert_weight_to_int4pack_for_cpu(((index >> (4 * digit)) & 15).to(torch.int32), 1)
            nib = torch.stack([packed & 15, packed >> 4], dim=-1).reshape(-1).to(torch.int64)  # [N*K]
            order |= nib << (4 * digit)
            digit += 1
        _pack_orders[key] = order
    return _pack_orders[key]
