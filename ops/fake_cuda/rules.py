"""Which mixes of CPU and CUDA tensors an aten operator accepts, decided as PyTorch's CUDA kernels decide it.

Part of the fake-CUDA double (ops/fake_cuda/__init__.py); pure functions of (operator, arguments), no state.

PyTorch checks devices in three places, and each is mirrored here:

1. Generated CUDA wrappers (torchgen/dest/register_dispatch_key.py, ``gen_device_check``): a kernel registered for
   CUDA whose native_functions.yaml entry keeps the default ``device_check: ExactSame`` checks that its out= and
   positional tensor arguments (tensor lists and optional tensors included, kwarg-only ones not) all sit on one
   device, in that order, with c10::impl::check_and_update_common_device: "Expected all tensors to be on the same
   device, but found at least two devices, cuda:0 and cpu! (when checking argument for argument index in method
   wrapper_CUDA__index_select)". A 0-dim CPU tensor is no exception there (index_select, gather, cat, mm, clamp's
   tensor bounds, ...). Composite operators that reach the double whole (embedding, stack) are held to the same
   check, which is what their decompositions (index_select, cat) do.
2. TensorIterator (aten/src/ATen/TensorIterator.cpp, ``compute_types``), for entries marked
   ``device_check: NoCheck   # TensorIterator``: the common device is the first non-CPU operand, outputs first;
   any other CPU operand is an error unless it is a 0-dim *input* and the iterator allows CPU scalars, at most one
   ("Trying to pass too many CPU scalars to non-CPU kernel!"). Binary and comparison configs allow one; so do
   addcmul and lerp in current releases. The double allows one for every TensorIterator op (a unary op with a
   0-dim CPU input and a CUDA out= is the rare case where it is more lenient than CUDA).
3. Kernels with their own rules (TensorAdvancedIndexing.cpp, TensorCompare.cpp, Copy.cpp):
   - index: a CUDA tensor takes CPU or CUDA indices; a CPU tensor takes only CPU ones ("indices should be either
     on cpu or on the same device as the indexed tensor (cpu)", check_indices_on_cpu_or_selfdevice);
   - index_put_: indices are moved to self's device (CUDA indices into a CPU tensor work, via a device-to-host
     copy); a 0-dim value is moved; a one-element CPU value with a single boolean mask on self's device becomes
     masked_fill_; any other value must be on self's device ("expected device cuda:0 but got device cpu for value
     tensor" when accumulating, TensorIterator's message otherwise);
   - masked_fill_: mask on self's device ("expected self and mask to be on the same device, ..."), the value any
     0-dim tensor (a CUDA value is read with .item());
   - where: every 0-dim CPU operand is moved to the device;
   - fill_: a 0-dim value from any device (read with .item() when it is not on self's device);
   - copy_ and _to_copy: any devices.

``check`` raises what CUDA would raise and returns the host synchronisations the operator implies on CUDA.
The yaml ships inside the torch wheel (torchgen/packaged) and is read once, lazily.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

_CPU = torch.device("cpu")
_MASK_DTYPES = (torch.bool, torch.uint8)


class Kind(enum.Enum):
    EXACT = "generated ExactSame check"
    ITER = "TensorIterator"
    FREE = "no device check"
    INDEX = "index"
    INDEX_PUT = "index_put_"
    MASKED_FILL = "masked_fill_"
    WHERE = "where"


@dataclass(frozen=True)
class Rule:
    kind: Kind
    method: str  # the name CUDA's generated wrapper carries, for messages


@dataclass(frozen=True)
class Effects:
    """Host synchronisations an operator implies on CUDA beyond its own result (counted by the double)."""

    host_reads: int = 0  # device values copied to the host (an index moved to a CPU tensor, .item() of a value)
    shape_syncs: int = 0  # output size depends on device data (nonzero, boolean masks, unique, bincount, ...)


_NONE = Effects()

# Operators whose kernels check devices themselves (see the module docstring), by overload packet name.
_SPECIAL: dict[str, Kind] = {
    "copy_": Kind.FREE, "copy": Kind.FREE, "fill_": Kind.FREE, "fill": Kind.FREE, "_copy_from": Kind.FREE,
    "_copy_from_and_resize": Kind.FREE, "_to_copy": Kind.FREE,
    "_foreach_copy_": Kind.FREE, "_foreach_copy": Kind.FREE, "lift_fresh": Kind.FREE, "lift_fresh_copy": Kind.FREE,
    "index": Kind.INDEX, "_unsafe_index": Kind.INDEX,
    "index_put_": Kind.INDEX_PUT, "index_put": Kind.INDEX_PUT, "_index_put_impl_": Kind.INDEX_PUT,
    "_index_put_impl": Kind.INDEX_PUT, "_unsafe_index_put": Kind.INDEX_PUT,
    "masked_fill_": Kind.MASKED_FILL, "masked_fill": Kind.MASKED_FILL,
    "where": Kind.WHERE,
}
_HOST_READ_OPS = frozenset({"_local_scalar_dense", "equal", "allclose"})  # return a device value to Python


def _yaml_path() -> Path | None:
    try:
        import torchgen
    except ImportError:
        return None
    path = Path(torchgen.__file__).parent / "packaged" / "ATen" / "native" / "native_functions.yaml"
    return path if path.is_file() else None


@functools.cache
def _yaml_entries() -> dict[str, tuple[bool, bool, bool]]:
    """native_functions.yaml as {"add.Tensor": (no_check, tensor_iterator, structured)}; a line scan, not YAML."""
    path = _yaml_path()
    if path is None:
        return {}
    entries: dict[str, list[bool]] = {}
    current: list[bool] | None = None
    for line in path.read_text().splitlines():
        if line.startswith("- func:"):
            current = entries.setdefault(line[len("- func:"):].strip().split("(", 1)[0], [False, False, False])
        elif current is None:
            continue
        elif "device_check: NoCheck" in line:
            current[0] = True
            current[1] = "TensorIterator" in line
        elif line.strip().startswith(("structured_delegate:", "structured: True")):
            current[2] = True
    return {name: (a, b, c) for name, (a, b, c) in entries.items()}


@functools.cache
def rule_for(func: torch._ops.OpOverload) -> Rule:
    packet = func._schema.name.split("::", 1)[-1]
    overload = func._schema.overload_name
    entries = _yaml_entries()
    no_check, iterator, structured = entries.get(f"{packet}.{overload}" if overload else packet,
                                                 (False, False, False))
    method = (f"wrapper_CUDA_{packet}{'_' + overload if overload else ''}" if structured
              else f"wrapper_CUDA_{overload}_{packet}")
    if packet in _SPECIAL:
        return Rule(_SPECIAL[packet], method)
    if not entries:  # no yaml (a torch without torchgen): pointwise ops are the TensorIterator ones
        return Rule(Kind.ITER if torch.Tag.pointwise in func.tags else Kind.EXACT, method)
    if no_check:
        return Rule(Kind.ITER if iterator else Kind.FREE, method)
    return Rule(Kind.EXACT, method)


def _bound(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Iterator[tuple[Any, Any]]:
    """(schema argument, value) for every argument given, in schema order."""
    for i, arg in enumerate(func._schema.arguments):
        if i < len(args):
            yield arg, args[i]
        elif arg.name in kwargs:
            yield arg, kwargs[arg.name]


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            if isinstance(v, torch.Tensor):
                yield v


def _is_output(arg: Any) -> bool:
    return arg.is_out or (arg.alias_info is not None and arg.alias_info.is_write)


def _mismatch(common: torch.device, other: torch.device, suffix: str = "") -> RuntimeError:
    return RuntimeError("Expected all tensors to be on the same device, but found at least two devices, "
                        f"{common} and {other}!{suffix}")


def _check_exact(func: torch._ops.OpOverload, rule: Rule, args: tuple, kwargs: dict) -> None:
    bound = list(_bound(func, args, kwargs))
    # gen_device_check's order: out= arguments, then the positional ones (kwarg-only tensors are not checked)
    ordered = [b for b in bound if b[0].is_out] + [b for b in bound if not b[0].kwarg_only]
    common: torch.device | None = None
    for arg, value in ordered:
        for t in _tensors(value):
            if common is None:
                common = t.device
            elif t.device != common:
                raise _mismatch(common, t.device,
                                f" (when checking argument for argument {arg.name} in method {rule.method})")


def _check_iter(func: torch._ops.OpOverload, args: tuple, kwargs: dict, max_cpu_scalars: int | None) -> None:
    bound = list(_bound(func, args, kwargs))
    outputs = [t for arg, v in bound if _is_output(arg) for t in _tensors(v)]
    inputs = [t for arg, v in bound if not arg.is_out for t in _tensors(v)]
    common = next((t.device for t in outputs + inputs if t.device != _CPU), _CPU)
    if common == _CPU:
        return
    for t in outputs:
        if t.device != common:
            raise _mismatch(common, t.device)
    scalars = 0
    for t in inputs:
        if t.device == _CPU and t.dim() == 0:
            scalars += 1
            if max_cpu_scalars is not None and scalars > max_cpu_scalars:
                raise RuntimeError("Trying to pass too many CPU scalars to non-CPU kernel!")
        elif t.device != common:
            raise _mismatch(common, t.device)


def _arg(func: torch._ops.OpOverload, args: tuple, kwargs: dict, name: str, default: Any = None) -> Any:
    for arg, value in _bound(func, args, kwargs):
        if arg.name == name:
            return value
    return default


def _is_mask(t: torch.Tensor) -> bool:
    return t.dtype in _MASK_DTYPES


def _check_index(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Effects:
    self, indices = args[0], [t for t in args[1] if t is not None]
    for t in indices:
        if t.device != _CPU and t.device != self.device:
            raise RuntimeError(f"indices should be either on cpu or on the same device as the indexed tensor "
                               f"({self.device})")
    out = _arg(func, args, kwargs, "out")
    if out is not None and out.device != self.device:
        raise _mismatch(self.device, out.device)
    # a boolean mask becomes indices through nonzero(), a sync when the mask lives on the device
    return Effects(shape_syncs=int(any(_is_mask(t) and t.device != _CPU for t in indices)))


def _masked_fill_path(self: torch.Tensor, indices: list, value: torch.Tensor) -> bool:
    """canDispatchToMaskedFill: a one-element CPU value and a single boolean mask on self's device."""
    defined = [t for t in indices if t is not None]
    return (value.numel() == 1 and value.device == _CPU and len(defined) <= 1
            and all(_is_mask(t) and t.device == self.device for t in defined))


def _check_index_put(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Effects:
    self, indices = args[0], list(args[1])
    value = _arg(func, args, kwargs, "values")
    accumulate = bool(_arg(func, args, kwargs, "accumulate", False))
    defined = [t for t in indices if t is not None]
    device_masks = int(any(_is_mask(t) and t.device != _CPU for t in defined))
    if self.device == _CPU:
        # make_info moves the CUDA indices to the CPU tensor (device-to-host copies); a CUDA value must then
        # meet the CPU tensor in TensorIterator, which only a 0-dim value (moved first) survives
        if value.device != _CPU and not (value.numel() == 1 and value.dim() == 0):
            raise _mismatch(value.device, _CPU)
        reads = int(any(t.device != _CPU for t in defined)) + int(value.device != _CPU)
        return Effects(host_reads=reads, shape_syncs=device_masks)
    if not accumulate and _masked_fill_path(self, indices, value):
        return _NONE
    if value.device != self.device and not (value.numel() == 1 and value.dim() == 0):
        if accumulate:
            raise RuntimeError(f"expected device {self.device} but got device {value.device} for value tensor")
        raise _mismatch(self.device, value.device)
    return Effects(shape_syncs=device_masks)


def _check_masked_fill(args: tuple) -> Effects:
    self, mask = args[0], args[1]
    value = args[2] if len(args) > 2 else None
    if isinstance(value, torch.Tensor) and self.device == _CPU:
        raise RuntimeError("masked_fill_: Expected inputs to be on same device")
    if mask.device != self.device:
        raise RuntimeError(f"expected self and mask to be on the same device, but got mask on {mask.device} "
                           f"and self on {self.device}")
    return Effects(host_reads=int(isinstance(value, torch.Tensor) and value.device != _CPU))


def check(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Effects:
    """Raise what CUDA raises for this call (fake-CUDA tensors report cuda:0); return the syncs it implies."""
    rule = rule_for(func)
    packet = func._schema.name.split("::", 1)[-1]
    if rule.kind is Kind.EXACT:
        _check_exact(func, rule, args, kwargs)
    elif rule.kind is Kind.ITER:
        _check_iter(func, args, kwargs, max_cpu_scalars=1)
    elif rule.kind is Kind.WHERE:
        _check_iter(func, args, kwargs, max_cpu_scalars=None)
    elif rule.kind is Kind.INDEX:
        return _check_index(func, args, kwargs)
    elif rule.kind is Kind.INDEX_PUT:
        return _check_index_put(func, args, kwargs)
    elif rule.kind is Kind.MASKED_FILL:
        return _check_masked_fill(args)
    if packet in _HOST_READ_OPS:
        return Effects(host_reads=1)
    if packet in ("fill_", "fill") and isinstance(args[1], torch.Tensor):
        # fill_ takes a 0-dim value from any device; one on another device is read with .item()
        return Effects(host_reads=int(args[1].device != args[0].device and args[1].device != _CPU))
    if torch.Tag.dynamic_output_shape in func.tags:
        if packet.startswith("repeat_interleave") and _arg(func, args, kwargs, "output_size") is not None:
            return _NONE  # the caller gave the size: no device-to-host read of the repeats' sum
        return Effects(shape_syncs=1)
    return _NONE
