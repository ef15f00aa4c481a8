"""The fake-CUDA tensor: a wrapper subclass that reports cuda:0 and computes on the CPU tensor it holds.

Part of the fake-CUDA double; see ops/fake_cuda/ for what it emulates and how to use it. This module holds the
tensor and generator types and the dispatch: every aten operator that touches a FakeCudaTensor arrives in
``FakeCudaTensor.__torch_dispatch__`` (below autograd, after composite operators have decomposed, so the C++ that
branches on ``is_cuda()`` has already taken CUDA's branch). There the call is checked as a CUDA kernel would check
it (ops/fake_cuda/rules.py), run on the inner CPU tensors, and its outputs wrapped where CUDA would put them on
the device. Views wrap views of the inner tensor, so writes through a view reach the base's storage, and in-place
operators return the very wrapper they were given.
"""

from __future__ import annotations

import contextlib
import copy
import weakref
from collections.abc import Iterator
from typing import Any, Protocol

import torch
from torch.utils._pytree import tree_map, tree_map_only

from . import rules as rules

CUDA0 = torch.device("cuda", 0)
_CPU = torch.device("cpu")
CUDA_DEFAULT_SEED = 67280421310721  # c10::detail::default_rng_seed_val: a fresh CUDA generator's seed


class Recorder(Protocol):
    """What the active fake_cuda() context offers the tensors: counting, pinned memory, memory accounting."""

    def record(self, kind: str, what: str) -> None: ...  # kind: "read", "sync" or "shape_sync"
    def pin(self, t: torch.Tensor) -> None: ...
    def is_pinned(self, t: torch.Tensor) -> bool: ...
    def track(self, t: FakeCudaTensor) -> None: ...


_recorder: Recorder | None = None  # set while a fake_cuda() context is open; tensors outliving it count nothing


def set_recorder(recorder: Recorder | None) -> None:
    global _recorder
    _recorder = recorder


def record(kind: str, what: str) -> None:
    if _capture is not None:
        # cudaErrorStreamCaptureUnsupported: the host cannot wait for work that a capture only records
        raise RuntimeError(f"CUDA error: operation not permitted when stream is capturing ({kind}: {what})")
    if _recorder is not None:
        _recorder.record(kind, what)


# The CUDA graph capture in progress (ops/fake_cuda/graphs.py Capture), or None: operators on fake tensors are
# recorded into it for replay.
_capture: Any = None


def set_capture(capture: Any) -> None:
    global _capture
    _capture = capture


def capture_in_progress() -> Any:
    return _capture


def refuse_host_copy_in_capture(what: str) -> None:
    """A host-to-device copy inside a capture: a replay would copy again from the capture-time host buffer."""
    if _capture is not None:
        raise RuntimeError(f"CUDA error: operation not permitted when stream is capturing ({what}: a host-to-device "
                           "copy inside a CUDA graph capture; copy into a static device tensor before replaying)")


def _is_pinned(t: torch.Tensor) -> bool:
    return _recorder is not None and _recorder.is_pinned(t)


class FakeCudaGenerator(torch.Generator):
    """A CPU generator underneath that reports device cuda:0: what torch.Generator(device="cuda") returns here.

    Random operators on fake-CUDA tensors accept it (and only it); CPU operators refuse it, as on CUDA.
    """

    def __init__(self) -> None:
        # the dispatcher hands kernels a fresh torch.Generator around the same C++ generator, so it is known by
        # that generator's address (_cdata), not by Python identity
        _fake_generators[self._cdata] = self

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return CUDA0

    def __repr__(self) -> str:
        return f"<FakeCudaGenerator device=cuda:0 seed={self.initial_seed()}>"


_fake_generators: weakref.WeakValueDictionary[int, FakeCudaGenerator] = weakref.WeakValueDictionary()


def is_fake_generator(gen: Any) -> bool:
    return isinstance(gen, torch.Generator) and _fake_generators.get(gen._cdata) is not None


# The stream random operators on the device draw from when given no generator: CUDA's default generator is not
# the CPU one, so torch.manual_seed reseeds both (through torch.cuda.manual_seed_all) and neither advances the other.
default_generator = FakeCudaGenerator()
default_generator.manual_seed(CUDA_DEFAULT_SEED)


@contextlib.contextmanager
def drawing_from(gen: torch.Generator) -> Iterator[None]:
    """Run CPU kernels that use the default CPU generator on ``gen``'s stream instead (then restore both)."""
    cpu = torch.default_generator
    saved = cpu.get_state()
    cpu.set_state(gen.get_state())
    try:
        yield
    finally:
        gen.set_state(cpu.get_state())
        cpu.set_state(saved)


def generator_mismatch(wanted: str, found: torch.Generator) -> RuntimeError:
    # at::check_generator's message (ATen/core/DistributionsHelper.h)
    return RuntimeError(f"Expected a '{wanted}' device type for generator but found '{found.device.type}'")


def _unwrap(t: FakeCudaTensor) -> torch.Tensor:
    return t._elem


def _unwrap_value(v: Any) -> Any:
    """An aten argument with its fake tensors replaced by their CPU data (aten nests at most a list of tensors)."""
    if isinstance(v, FakeCudaTensor):
        return v._elem
    if isinstance(v, (list, tuple)) and any(isinstance(x, FakeCudaTensor) for x in v):
        return type(v)(x._elem if isinstance(x, FakeCudaTensor) else x for x in v)
    return v


def _tensor_args(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    out = []
    for v in (*args, *kwargs.values()):
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            out.extend(x for x in v if isinstance(x, torch.Tensor))
    return out


class FakeCudaTensor(torch.Tensor):
    """A tensor on "cuda:0" whose data is the CPU tensor ``_elem`` (same sizes, strides and offset).

    It never requires grad: recording an autograd graph on a CUDA tensor builds InputMetadata, which asks for the
    CUDA device guard a CPU build lacks, and that aborts the process (std::terminate, no Python exception). So
    ``requires_grad_(True)`` is ignored (nn.Parameter and Module.to rely on it) and serving code is tested as it
    runs: without gradients.
    """

    _elem: torch.Tensor
    __torch_function__ = torch._C._disabled_torch_function_impl  # results keep their types; the mode sees all

    @staticmethod
    def __new__(cls, elem: torch.Tensor) -> FakeCudaTensor:
        assert type(elem) is torch.Tensor and elem.device == _CPU, f"wraps plain CPU tensors, got {type(elem)}"
        elem = elem.detach() if elem.requires_grad else elem
        # The wrapper is an inference tensor exactly when the CPU tensor it wraps is: a view of a normal tensor
        # made under inference_mode is normal, and PyTorch shares the base's version counter with it, which an
        # inference tensor cannot take ("Cannot set version_counter for inference tensor").
        with torch.inference_mode(elem.is_inference()):
            r = torch.Tensor._make_wrapper_subclass(cls, elem.size(), strides=elem.stride(),
                                                    storage_offset=elem.storage_offset(), dtype=elem.dtype,
                                                    layout=elem.layout, device=CUDA0, requires_grad=False)
        r._elem = elem
        if _recorder is not None:
            _recorder.track(r)
        return r

    @classmethod
    def __torch_dispatch__(cls, func: torch._ops.OpOverload, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd"):
            # Under inference_mode composite operators arrive whole (no autograd key decomposed them): decompose
            # here, so their parts meet CUDA's rules as they do on CUDA (linear -> mm, true_divide -> div, ...)
            out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        effects = rules.check(func, args, kwargs)
        packet = func._schema.name.split("::", 1)[-1]
        if packet == "_to_copy":
            return _to_copy(func, args, kwargs)
        if packet == "copy_":
            return _copy_(args, kwargs)
        rng = _random_stream(func, kwargs)
        to_host = False
        if kwargs.get("device") is not None:  # new_*/*_like given a device: the CPU one keeps its result
            to_host = torch.device(kwargs["device"]).type == "cpu"
            if not to_host:
                check_cuda_device(kwargs["device"])
            kwargs = {**kwargs, "device": _CPU}
        inner_args = tuple(_unwrap_value(v) for v in args)
        inner_kwargs = {k: _unwrap_value(v) for k, v in kwargs.items()}
        if _capture is not None and effects.host_reads + effects.shape_syncs:
            record("read" if effects.host_reads else "shape_sync", packet)  # raises: not capturable
        with drawing_from(rng) if rng is not None else contextlib.nullcontext():
            out = func(*inner_args, **inner_kwargs)
        for _ in range(effects.host_reads):
            record("read", packet)
        for _ in range(effects.shape_syncs):
            record("shape_sync", packet)
        if _capture is not None:  # a replay draws on from the same stream, as CUDA's philox offset advances
            _capture.add(func, inner_args, inner_kwargs, out, rng)
        return out if to_host else _wrap_outputs(func, args, kwargs, out)

    # --- what CUDA tensors do differently from CPU ones at the Python surface -----------------------------------

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        # diagnostics, not a device read: printing is not counted
        inner = repr(self._elem)
        grad = f", grad_fn=<{type(self.grad_fn).__name__}>" if self.grad_fn is not None else ""
        return f"{inner[:-1]}, device='cuda:0'{grad})"

    __str__ = __repr__

    def __deepcopy__(self, memo: dict) -> FakeCudaTensor:
        # Tensor.__deepcopy__ would rebuild a CUDA storage; a device-to-device copy is no host read
        new = FakeCudaTensor(copy.deepcopy(self._elem, memo))
        memo[id(self)] = new
        for key, value in self.__dict__.items():  # _is_param of parameters, user attributes
            if key != "_elem":
                setattr(new, key, copy.deepcopy(value, memo))
        return new

    def __reduce_ex__(self, protocol: Any) -> tuple:
        # pickling (torch.save, multiprocessing) copies the data to the host, as for a CUDA tensor
        record("read", "pickle")
        return FakeCudaTensor, (self._elem,)

    def numpy(self, *, force: bool = False) -> Any:
        if not force:  # tensor_numpy.cpp: TORCH_CHECK_TYPE, a TypeError
            raise TypeError("can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to copy the tensor "
                            "to host memory first.")
        return self.detach().cpu().numpy()

    def tolist(self) -> Any:
        return self.cpu().tolist()  # one device-to-host copy, counted by _to_copy

    def item(self) -> Any:
        if self.numel() != 1:
            raise RuntimeError(f"a Tensor with {self.numel()} elements cannot be converted to Scalar")
        return torch.ops.aten._local_scalar_dense.default(self)  # counted there

    def _one_value(self) -> Any:
        if self.numel() != 1:
            raise RuntimeError("only one element tensors can be converted to Python scalars")
        return self.item()

    def __bool__(self) -> bool:
        if self.numel() != 1:
            many = "no values" if self.numel() == 0 else "more than one value"
            raise RuntimeError(f"Boolean value of Tensor with {many} is ambiguous")
        return bool(self.item())

    def __int__(self) -> int:
        return int(self._one_value())

    def __float__(self) -> float:
        return float(self._one_value())

    def __complex__(self) -> complex:
        return complex(self._one_value())

    def __index__(self) -> int:
        if self.dtype.is_floating_point or self.dtype.is_complex or self.numel() != 1:
            raise TypeError("only integer tensors of a single element can be converted to an index")
        return int(self.item())

    def __format__(self, format_spec: str) -> str:
        if self.dim() == 0:
            return self.item().__format__(format_spec)  # as Tensor.__format__: a read
        return format(repr(self), format_spec)

    def __getitem__(self, index: Any) -> Any:
        # Python indexing is C++ (python_variable_indexing.cpp) that first takes a device guard, which a CPU build
        # has none of for CUDA. A CPU-device proxy lets that code run; every aten op it issues (select, slice,
        # index, index_put_, copy_, ...) is forwarded to this tensor, so CUDA's rules apply.
        out = torch.Tensor.__getitem__(HostProxy(self), index)
        return out._target if isinstance(out, HostProxy) else out

    def __setitem__(self, index: Any, value: Any) -> None:
        torch.Tensor.__setitem__(HostProxy(self), index, value)

    def requires_grad_(self, requires_grad: bool = True) -> FakeCudaTensor:
        return self  # see the class docstring: a fake-CUDA tensor never requires grad

    @property
    def requires_grad(self) -> bool:  # type: ignore[override]
        return False

    @requires_grad.setter
    def requires_grad(self, value: bool) -> None:
        return None

    def data_ptr(self) -> int:
        return self._elem.data_ptr()

    def is_pinned(self, device: Any = None) -> bool:
        return False

    def pin_memory(self, device: Any = None) -> torch.Tensor:
        raise RuntimeError(f"cannot pin '{self.type()}' only dense CPU tensors can be pinned")

    def record_stream(self, stream: Any) -> None:
        return None  # the double runs every kernel at once: no allocator to keep memory for a stream

    def cuda(self, device: Any = None, non_blocking: bool = False,
             memory_format: torch.memory_format = torch.preserve_format) -> torch.Tensor:
        check_cuda_device(device)
        return self if memory_format == torch.preserve_format else self.contiguous(memory_format=memory_format)

    def to(self, *args: Any, **kwargs: Any) -> torch.Tensor:  # type: ignore[override]
        copy = bool(kwargs.pop("copy", False))
        # Called straight (a method of this class, not through torch's dispatch), with the double's mode active:
        # parse without it, or the mode rewrites device="cuda" to the CPU.
        with torch._C.DisableTorchFunction():
            device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        fmt = {} if memory_format is None else {"memory_format": memory_format}
        if device is not None and device.type != "cuda":
            return super().to(device=device, dtype=dtype, non_blocking=non_blocking, copy=copy, **fmt)
        check_cuda_device(device)  # the C++ would look for a CUDA device guard, which a CPU build lacks
        if dtype is None:
            dtype = self.dtype
        if dtype == self.dtype and not copy and memory_format in (None, torch.preserve_format):
            return self  # as CUDA's `to` does for a no-op (the C++ no-op path handed back the unwrapped CPU tensor)
        return super().to(dtype=dtype, non_blocking=non_blocking, copy=copy, **fmt)

    def new_tensor(self, data: Any, dtype: torch.dtype | None = None, device: Any = None,
                   requires_grad: bool = False, **kwargs: Any) -> torch.Tensor:
        if isinstance(data, FakeCudaTensor):
            data = data._elem
        dtype = dtype if dtype is not None else (data.dtype if isinstance(data, torch.Tensor) else self.dtype)
        cpu = data.detach().to(dtype=dtype, copy=True) if isinstance(data, torch.Tensor) else torch.tensor(
            data, dtype=dtype)
        if device is not None and torch.device(device).type == "cpu":
            return cpu.requires_grad_(requires_grad)
        check_cuda_device(device)
        return FakeCudaTensor(cpu)


class HostProxy(torch.Tensor):
    """A fake-CUDA tensor's metadata on device cpu, forwarding every aten op to the fake tensor.

    For the C++ Python bindings that take a CUDA device guard before calling any op (indexing, copy_, nonzero,
    ...): a CPU build has no CUDA guard, but a CPU one is a no-op, and the ops reach the fake tensor all the same.
    """

    _target: FakeCudaTensor
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, target: FakeCudaTensor) -> HostProxy:
        with torch.inference_mode(target.is_inference()):  # as FakeCudaTensor.__new__ (version counters)
            r = torch.Tensor._make_wrapper_subclass(cls, target.size(), strides=target.stride(),
                                                    storage_offset=target.storage_offset(), dtype=target.dtype,
                                                    layout=target.layout, device=_CPU)
        r._target = target
        return r

    @classmethod
    def __torch_dispatch__(cls, func: torch._ops.OpOverload, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        args, kwargs = tree_map_only(HostProxy, lambda p: p._target, (args, kwargs or {}))
        return func(*args, **kwargs)


def call_through_proxies(func: Any, args: tuple, kwargs: dict) -> Any:
    """Call a Python binding with fake tensors behind HostProxy (see there); proxies in the result are unwrapped."""
    args, kwargs = tree_map_only(FakeCudaTensor, HostProxy, (args, kwargs))
    return tree_map_only(HostProxy, lambda p: p._target, func(*args, **kwargs))


def check_cuda_device(device: Any) -> None:
    """The double has one device: cuda, cuda:0 or 0 name it; any other index is CUDA's invalid ordinal."""
    if device is None:
        return
    d = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if d.type != "cuda":
        raise ValueError(f"expected a cuda device, got {d}")
    if d.index not in (None, 0):
        raise RuntimeError("CUDA error: invalid device ordinal")


def _random_stream(func: torch._ops.OpOverload, kwargs: dict) -> torch.Generator | None:
    """at::check_generator for a kernel on the device; the stream to draw from when the op brings none."""
    if "generator" in kwargs and kwargs["generator"] is not None:
        gen = kwargs["generator"]
        if not is_fake_generator(gen):
            raise generator_mismatch("cuda", gen)
        return None  # a CPU generator underneath: the kernel draws from it directly
    if torch.Tag.nondeterministic_seeded in func.tags:
        return default_generator
    return None


def _to_copy(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> torch.Tensor:
    src = args[0]
    kw = dict(kwargs)
    device = kw.pop("device", None)
    pin = bool(kw.pop("pin_memory", False))
    if device is not None and torch.device(device).type == "cpu":
        out = func(src._elem, **kw)
        # _to_copy pins the result of a non_blocking CUDA-to-CPU copy (pin_out), so the copy itself does not wait
        if kw.get("non_blocking", False) or pin:
            if _recorder is not None:
                _recorder.pin(out)
        if not kw.get("non_blocking", False):
            record("read", "to(cpu)")
        return out
    if device is not None:
        check_cuda_device(device)
    out = func(src._elem, **kw)
    if _capture is not None:
        _capture.add(func, (src._elem,), kw, out)
    return FakeCudaTensor(out)


def _copy_(args: tuple, kwargs: dict) -> torch.Tensor:
    dst, src = args[0], args[1]
    non_blocking = bool(args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
    if isinstance(dst, FakeCudaTensor):
        if not isinstance(src, FakeCudaTensor):
            refuse_host_copy_in_capture("copy_ from the host")
        dst._elem.copy_(src._elem if isinstance(src, FakeCudaTensor) else src, non_blocking)
        if _capture is not None:
            _capture.add(torch.Tensor.copy_, (dst._elem, src._elem), {}, dst._elem)
        return dst
    # device to host: a non_blocking copy into pinned memory is queued; into pageable memory cudaMemcpyAsync
    # returns only once the copy is done, so the host waits as for a blocking one
    if not (non_blocking and _is_pinned(dst)):
        record("read", "copy_(cpu)")
    dst.copy_(src._elem, non_blocking)
    return dst


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _wrap_outputs(func: torch._ops.OpOverload, args: tuple, kwargs: dict, out: Any) -> Any:
    inputs = _tensor_args(args, kwargs)
    inners = [t._elem if isinstance(t, FakeCudaTensor) else t for t in inputs]
    host_inputs = [t for t in inputs if not isinstance(t, FakeCudaTensor)]

    def wrap(o: Any) -> Any:
        if not isinstance(o, torch.Tensor):
            return o
        for orig, inner in zip(inputs, inners):
            if o is inner:  # in place or out=: hand back the caller's own tensor
                if isinstance(orig, FakeCudaTensor):
                    _check_same_metadata(func, orig)
                return orig
        for t in host_inputs:  # a view of a CPU argument stays on the CPU (view_as and friends)
            if _same_storage(o, t):
                return o
        return FakeCudaTensor(o)

    return wrap(out) if isinstance(out, torch.Tensor) else tree_map(wrap, out)


def _check_same_metadata(func: torch._ops.OpOverload, t: FakeCudaTensor) -> None:
    e = t._elem
    if e.shape != t.shape or e.stride() != t.stride() or e.storage_offset() != t.storage_offset():
        raise NotImplementedError(f"{func} changed a fake-CUDA tensor's shape or strides in place (resize_, t_, "
                                  "unsqueeze_, set_, out= of another size); the double cannot follow. Use the "
                                  "out-of-place form.")
