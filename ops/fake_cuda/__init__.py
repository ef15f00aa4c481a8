"""A fake-CUDA test double: a CPU box that looks, to code under test, like a machine with one CUDA GPU.

Why: the router runs its dense model on a GPU, CI has none, and the device mistakes that matter (a CPU mask indexed
with CUDA ids, a CPU tensor added to a CUDA one, ``.numpy()`` of a CUDA tensor, a CPU generator handed to a CUDA
random op) raise on CUDA and pass silently on a CPU box. Under this double they raise here too, with CUDA's
messages, while correct code runs and computes on the CPU underneath, bit for bit what plain CPU code computes.

Use::

    from expertmesh.ops.fake_cuda import fake_cuda

    with fake_cuda() as fc:                          # total_memory=80 * 2**30 by default
        x = torch.randn(4, 8, device="cuda")         # a FakeCudaTensor: .device == cuda:0, .is_cuda
        model = MyModel().to("cuda")                 # parameters become fake-CUDA tensors
        with fc.counting() as step:                  # counts inside the block (fc keeps the running total)
            y = model(x)
            n = int(y.argmax())                      # one device-to-host read
        assert step.host_reads == 1 and step.syncs == 0
        print(step.read_sites)                       # Counter({"router_service/x.py:123": 1})

What it emulates
- Tensors: ``FakeCudaTensor`` (ops/fake_cuda/tensor.py), a ``_make_wrapper_subclass`` reporting cuda:0 around a
  CPU tensor. Every aten operator on it is checked as CUDA's kernel checks devices (ops/fake_cuda/rules.py: the
  generated ExactSame check, TensorIterator's 0-dim CPU scalar rule, index/index_put_/masked_fill_/where/fill_/
  copy_ rules, each taken from PyTorch's source and native_functions.yaml), then run on the CPU tensors; outputs
  are wrapped where CUDA would put them. Composite operators decompose first with ``is_cuda()`` true, so they take
  CUDA's branch. Views wrap views (writes through them reach the base); in-place ops return the caller's tensor.
- Python surface: ``.numpy()`` raises CUDA's TypeError; ``.item()``, ``int()``, ``float()``, ``bool()``, index use,
  ``.tolist()``, ``.cpu()``/``.to("cpu")``, ``copy_`` into a CPU tensor, ``torch.equal``, pickling are
  device-to-host reads. ``.to("cpu", non_blocking=True)`` (its result is pinned, as CUDA pins it) and
  ``copy_(non_blocking=True)`` into pinned memory are not; into pageable memory the copy is a read
  (cudaMemcpyAsync returns only when a device-to-pageable copy is done). Python bindings that take a CUDA device
  guard before any op (indexing, ``copy_``, ``nonzero``, ...) run against a CPU-device proxy of the fake tensor
  that forwards every op to it (``HostProxy``): a CPU build has no CUDA guard.
- Factories and moves (a TorchFunctionMode, since the C++ argument parser would initialise CUDA): ``device="cuda"``,
  ``"cuda:0"``, ``torch.device("cuda")`` or ``0`` give fake tensors (``cuda:1``: invalid device ordinal);
  ``.to("cuda")``, ``.cuda()``, ``.to(fake_tensor)``, ``nn.Module.to("cuda")`` (new Parameters, as with
  ``torch.__future__.set_overwrite_module_params_on_conversion(True)``); ``*_like``/``new_*`` follow their input.
  ``pin_memory=True`` and ``.pin_memory()`` mark CPU tensors pinned (``is_pinned()`` answers True); nothing is
  really pinned. ``scaled_dot_product_attention`` and ``one_hot``, whose C++ allocates with the input's CUDA options,
  run on the CPU tensors (after CUDA's checks); another such op raises a NotImplementedError that says so.
- Randomness: ``torch.Generator(device="cuda")`` is a ``FakeCudaGenerator`` (a CPU generator reporting cuda:0).
  Random ops on the device refuse a CPU generator and CPU ops refuse a fake-CUDA one ("Expected a 'cuda' device type
  for generator but found 'cpu'"). Without a generator, device ops draw from a fake CUDA default generator, seeded
  by ``torch.manual_seed``/``torch.cuda.manual_seed`` and separate from the CPU one, as on CUDA (each context starts
  it at CUDA's default seed). Draws are the CPU's (mt19937): a seed gives what the CPU gives, not what CUDA's
  Philox gives.
- ``torch.cuda``: is_available, device_count, current_device, get_device_name/capability/properties (configurable
  total_memory), mem_get_info and memory_allocated (bytes of storages under live fake tensors), synchronize,
  Stream, Event (elapsed_time from host clocks), current_stream, stream(), device(), manual_seed and RNG state,
  empty_cache; ``torch.accelerator`` and ``torch.backends.cuda.is_built`` likewise. All restored on exit, also
  after an exception.
- CUDA graphs (ops/fake_cuda/graphs.py): ``torch.cuda.CUDAGraph``, ``torch.cuda.graph``, ``graph_pool_handle``,
  ``is_current_stream_capturing``. A capture records the operators, a replay re-runs them on the recorded tensors
  (static inputs must be copied into; shapes and Python values are frozen); what a capture allocated is poisoned
  until replayed; reads, syncs, data-dependent shapes and host-to-device copies inside a capture raise.

Counters (``fc`` and each ``fc.counting()`` block): ``host_reads`` (a device value brought to the host),
``syncs`` (torch.cuda.synchronize, Stream/Event synchronize and query), ``shape_syncs`` (ops whose output size
depends on device data, which CUDA must read back: nonzero, a device boolean mask as index, masked_select, unique,
bincount, repeat_interleave without output_size); ``total`` sums them; each with a Counter of call sites
(``read_sites``, ``sync_sites``, ``shape_sync_sites``: "file:line" of the innermost frame outside torch and this
double). ``fc.reset()`` zeroes, ``fc.snapshot()`` copies. Printing (repr/str) is not counted.

What it does not emulate: kernels (CUDA's numerics, TF32, cuBLAS/flash choices: results are the CPU's), memory
limits (nothing raises OutOfMemoryError), asynchrony (an error surfaces at the op, not at a later sync), more than one
device, autocast, storages (``untyped_storage()``, ``torch.load(map_location="cuda")``),
``torch.set_default_device("cuda")``, ``param.data = fake``. No autograd on the device: a fake tensor never
requires grad (``requires_grad_(True)`` is ignored) because PyTorch's autograd asks for the CUDA device guard a
CPU build lacks and aborts the process; test serving code as it runs, without gradients. The TorchFunctionMode is
per thread: factories in another thread need ``with fc.in_this_thread():``. Functions bound before entering
(``from torch.cuda import is_available``) are not patched. Fake tensors outliving the context still compute, but
count nothing and factories no longer make them.
"""

from __future__ import annotations

import contextlib
import copy
import os
import sys
import weakref
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves, tree_map, tree_map_only

from . import device as dev
from . import tensor as ft
from .patches import patches
from .tensor import FakeCudaGenerator, FakeCudaTensor, check_cuda_device, generator_mismatch

__all__ = ["Counts", "FakeCuda", "FakeCudaGenerator", "FakeCudaTensor", "fake_cuda"]

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_OWN_FILES = frozenset(os.path.join(os.path.dirname(os.path.abspath(__file__)), name) for name in (
    "__init__.py", "tensor.py", "rules.py", "device.py", "patches.py"))
_KINDS = ("read", "sync", "shape_sync")


def _call_site() -> str:
    """"file:line" of the innermost frame that is neither torch nor this double: the code that caused the event."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if not path.startswith(_TORCH_DIR) and path not in _OWN_FILES:
            rel = os.path.relpath(path) if os.path.isabs(path) else path
            return f"{path if rel.startswith('..') else rel}:{frame.f_lineno}"
        frame = frame.f_back
    return "<unknown>"


@dataclass
class Counts:
    """Device-to-host events, in total and by call site."""

    host_reads: int = 0
    syncs: int = 0
    shape_syncs: int = 0
    read_sites: Counter[str] = field(default_factory=Counter)
    sync_sites: Counter[str] = field(default_factory=Counter)
    shape_sync_sites: Counter[str] = field(default_factory=Counter)

    def add(self, kind: str, site: str) -> None:
        if kind == "read":
            self.host_reads += 1
            self.read_sites[site] += 1
        elif kind == "sync":
            self.syncs += 1
            self.sync_sites[site] += 1
        else:
            self.shape_syncs += 1
            self.shape_sync_sites[site] += 1

    @property
    def total(self) -> int:
        """Every time the host waited for the device: reads, explicit syncs and data-dependent shapes."""
        return self.host_reads + self.syncs + self.shape_syncs


class FakeCuda:
    """The open double: counters, pinned-memory marks, memory accounting (the Recorder of fake_cuda_tensor)."""

    def __init__(self, total_memory: int) -> None:
        self.total_memory = total_memory
        self.counts = Counts()
        self._blocks: list[Counts] = []
        self._pinned: dict[int, torch.Tensor] = {}  # storage address -> a tensor keeping that storage alive
        self._live: weakref.WeakSet[FakeCudaTensor] = weakref.WeakSet()
        self._peak = 0
        self.mode = _FakeCudaMode(self)

    # --- counters ----------------------------------------------------------------------------------------------
    @property
    def host_reads(self) -> int:
        return self.counts.host_reads

    @property
    def syncs(self) -> int:
        return self.counts.syncs

    @property
    def shape_syncs(self) -> int:
        return self.counts.shape_syncs

    @property
    def read_sites(self) -> Counter[str]:
        return self.counts.read_sites

    @property
    def sync_sites(self) -> Counter[str]:
        return self.counts.sync_sites

    @property
    def shape_sync_sites(self) -> Counter[str]:
        return self.counts.shape_sync_sites

    def reset(self) -> None:
        self.counts = Counts()

    def snapshot(self) -> Counts:
        return copy.deepcopy(self.counts)

    @contextlib.contextmanager
    def counting(self) -> Iterator[Counts]:
        """Counts of the events inside the block (blocks nest; the running total keeps counting too)."""
        block = Counts()
        self._blocks.append(block)
        try:
            yield block
        finally:
            self._blocks.remove(block)

    def record(self, kind: str, what: str) -> None:
        assert kind in _KINDS, kind
        site = _call_site()
        self.counts.add(kind, site)
        for block in self._blocks:
            block.add(kind, site)

    # --- pinned host memory (a CPU-only torch cannot pin: the double remembers which storages "are") -------------
    def pin(self, t: torch.Tensor) -> None:
        self._pinned[t.untyped_storage().data_ptr()] = t

    def is_pinned(self, t: torch.Tensor) -> bool:
        return t.numel() > 0 and t.untyped_storage().data_ptr() in self._pinned

    # --- device memory ------------------------------------------------------------------------------------------
    def track(self, t: FakeCudaTensor) -> None:
        self._live.add(t)

    def memory_allocated(self) -> int:
        """Bytes of the distinct storages under live fake-CUDA tensors (views share their base's)."""
        storages = {}
        for t in list(self._live):
            s = t._elem.untyped_storage()
            storages[s.data_ptr()] = s.nbytes()
        allocated = sum(storages.values())
        self._peak = max(self._peak, allocated)
        return allocated

    def reset_peak(self) -> None:
        self._peak = 0

    def max_memory_allocated(self) -> int:
        self.memory_allocated()
        return self._peak  # the largest value observed when asked, not a true high-water mark

    def mem_get_info(self, device: Any = None) -> tuple[int, int]:
        check_cuda_device(device)
        return self.total_memory - self.memory_allocated(), self.total_memory

    @contextlib.contextmanager
    def in_this_thread(self) -> Iterator[None]:
        """Factories with device="cuda" in a worker thread: TorchFunctionModes are thread-local."""
        with self.mode:
            yield


def _is_cuda(device: Any) -> bool:
    if isinstance(device, int) and not isinstance(device, bool):
        return True  # device=0 means cuda:0
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


def _has_fake(args: Any, kwargs: Any) -> bool:
    return any(isinstance(x, FakeCudaTensor) for x in tree_leaves((args, kwargs)))


def _to_device(t: torch.Tensor, dtype: torch.dtype | None, memory_format: torch.memory_format | None) -> Any:
    """A CPU tensor moved to the fake device: always a copy, as a host-to-device move is."""
    ft.refuse_host_copy_in_capture("a host tensor moved to the device")
    fmt = {} if memory_format is None else {"memory_format": memory_format}
    return FakeCudaTensor(t.detach().to(dtype=dtype or t.dtype, copy=True, **fmt))


def _tensor_to(fc: FakeCuda, func: Any, args: tuple, kwargs: dict) -> Any:
    self = args[0]
    kw = {k: v for k, v in kwargs.items() if k != "copy"}  # a move to the device copies anyway
    device, dtype, _, memory_format = torch._C._nn._parse_to(*args[1:], **kw)
    if device is None or device.type != "cuda":
        return func(*args, **kwargs)
    if isinstance(self, FakeCudaTensor):
        return FakeCudaTensor.to(self, *args[1:], **kwargs)  # strips the device before the C++ sees it
    check_cuda_device(device)
    return _to_device(self, dtype, memory_format)


def _tensor_cuda(fc: FakeCuda, func: Any, args: tuple, kwargs: dict) -> Any:
    self, device = args[0], (args[1] if len(args) > 1 else kwargs.get("device"))
    if isinstance(self, FakeCudaTensor):
        return FakeCudaTensor.cuda(self, *args[1:], **kwargs)
    check_cuda_device(device)
    return _to_device(self, None, kwargs.get("memory_format"))


def _tensor_pin_memory(fc: FakeCuda, func: Any, args: tuple, kwargs: dict) -> Any:
    self = args[0]
    if isinstance(self, FakeCudaTensor):
        return FakeCudaTensor.pin_memory(self)
    if fc.is_pinned(self):
        return self
    pinned = self.clone(memory_format=torch.contiguous_format) if self.numel() else self.clone()
    fc.pin(pinned)
    return pinned


def _tensor_is_pinned(fc: FakeCuda, func: Any, args: tuple, kwargs: dict) -> Any:
    self = args[0]
    return False if isinstance(self, FakeCudaTensor) else fc.is_pinned(self)


def _as_tensor(fc: FakeCuda, func: Any, args: tuple, kwargs: dict) -> Any:
    data, dtype = args[0], (args[1] if len(args) > 1 else kwargs.get("dtype"))
    device = args[2] if len(args) > 2 else kwargs.get("device")
    if isinstance(data, FakeCudaTensor) and (device is None or _is_cuda(device)):
        check_cuda_device(device)
        return data if dtype in (None, data.dtype) else data.to(dtype)  # as_tensor does not copy what it can share
    if device is not None and _is_cuda(device):
        ft.refuse_host_copy_in_capture("torch.as_tensor(host data, device='cuda')")
        return _on_device(fc, func, args[:2], {**kwargs, "device": device})
    return func(*args, **kwargs)


def _tensor_ctor(fc: FakeCuda, func: Any, args: tuple, kwargs: dict) -> Any:
    """torch.tensor(data): device values inside ``data`` are read to the host one by one, as on CUDA."""
    data = args[0]
    if isinstance(data, FakeCudaTensor):  # copy construction keeps the source's device unless told otherwise
        device = kwargs.get("device")
        if device is None or _is_cuda(device):
            check_cuda_device(device)
            dtype = kwargs.get("dtype") or data.dtype
            return data.detach().to(dtype=dtype, copy=True)
    elif isinstance(data, (list, tuple)):
        data = tree_map_only(FakeCudaTensor, lambda t: t.cpu(), data)
    args = (data, *args[1:])
    if _is_cuda(kwargs.get("device")):
        ft.refuse_host_copy_in_capture("torch.tensor(host data, device='cuda')")
        return _on_device(fc, func, args, kwargs)
    return func(*args, **kwargs)


def _sdpa(fc: FakeCuda, func: Any, args: tuple, kwargs: dict) -> Any:
    """scaled_dot_product_attention on the CPU kernels the CPU path picks (bit-identical), after CUDA's checks.

    Its C++ composite, seeing device cuda, would allocate (the causal mask) with the query's CUDA options, which a
    CPU build cannot do, and would take the math fallback, whose rounding differs from the CPU kernel's.
    """
    q, k, v = args[:3]
    mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
    if not (q.device == k.device == v.device):
        raise RuntimeError("Expected query, key, and value to have the same device type, but got query.device: "
                           f"{q.device} key.device: {k.device} and value.device: {v.device} instead.")
    if not isinstance(q, FakeCudaTensor):
        return func(*args, **kwargs)  # a CPU query with a fake mask: let the dispatcher's checks speak
    if mask is not None and mask.device != q.device and mask.dim() > 0:
        raise RuntimeError("Expected all tensors to be on the same device, but found at least two devices, "
                           f"{q.device} and {mask.device}!")
    inner_args, inner_kwargs = tree_map_only(FakeCudaTensor, ft._unwrap, (args, kwargs))
    with ft.drawing_from(ft.default_generator):
        out = func(*inner_args, **inner_kwargs)
    _captured(func, inner_args, inner_kwargs, out, ft.default_generator)
    return FakeCudaTensor(out)


def _one_hot(fc: FakeCuda, func: Any, args: tuple, kwargs: dict) -> Any:
    """F.one_hot: its composite allocates with the input's CUDA options; without num_classes it reads the max."""
    if not isinstance(args[0], FakeCudaTensor):
        return func(*args, **kwargs)
    num_classes = args[1] if len(args) > 1 else kwargs.get("num_classes", -1)
    if num_classes == -1:
        ft.record("read", "one_hot")  # num_classes = self.max().item() + 1
    out = func(args[0]._elem, *args[1:], **kwargs)
    _captured(func, (args[0]._elem, *args[1:]), kwargs, out)
    return FakeCudaTensor(out)


def _captured(func: Any, args: tuple, kwargs: dict, out: Any, rng: torch.Generator | None = None) -> None:
    """An operator the double runs above aten, recorded into a CUDA graph capture in progress (graphs.py)."""
    capture = ft.capture_in_progress()
    if capture is not None:
        capture.add(func, args, kwargs, out, rng)


def _on_device(fc: FakeCuda, func: Any, args: tuple, kwargs: dict) -> Any:
    """A call with device="cuda": run it for the CPU, then move what it made onto the fake device."""
    check_cuda_device(kwargs["device"])
    if kwargs.get("pin_memory"):
        raise RuntimeError("Only dense CPU tensors can be pinned")
    gen = kwargs.get("generator")
    if gen is not None and not ft.is_fake_generator(gen):
        raise generator_mismatch("cuda", gen)
    on_cpu = {**kwargs, "device": "cpu"}
    with ft.drawing_from(ft.default_generator) if gen is None else contextlib.nullcontext():
        out = func(*args, **on_cpu)
    # A factory is a kernel (a fill, an arange) that a CUDA graph replays: torch.zeros then scatter_ starts from
    # zeros again at every replay.
    _captured(func, args, on_cpu, out, ft.default_generator if gen is None else None)
    return tree_map(lambda t: FakeCudaTensor(t) if type(t) is torch.Tensor else t, out)


_HANDLERS = {
    torch.Tensor.to: _tensor_to,
    torch.Tensor.cuda: _tensor_cuda,
    torch.Tensor.pin_memory: _tensor_pin_memory,
    torch.Tensor.is_pinned: _tensor_is_pinned,
    torch.as_tensor: _as_tensor,
    torch.tensor: _tensor_ctor,
    F.scaled_dot_product_attention: _sdpa,
    F.one_hot: _one_hot,
}


class _FakeCudaMode(TorchFunctionMode):
    """Sees every torch call before the C++ argument parser does: rewrites device="cuda", guards generators."""

    def __init__(self, fc: FakeCuda) -> None:
        super().__init__()
        self.fc = fc

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        handler = _HANDLERS.get(func)
        if handler is not None:
            return handler(self.fc, func, args, kwargs)
        if _is_cuda(kwargs.get("device")):
            return _on_device(self.fc, func, args, kwargs)
        gen = kwargs.get("generator")
        if ft.is_fake_generator(gen) and not _has_fake(args, kwargs):
            raise generator_mismatch("cpu", gen)  # a CPU kernel given the device's generator
        if kwargs.get("pin_memory") and (kwargs.get("device") is None or torch.device(kwargs["device"]).type
                                         == "cpu"):
            out = func(*args, **{**kwargs, "pin_memory": False})
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.fc.pin(t)
            return out
        try:
            return func(*args, **kwargs)
        except RuntimeError as e:
            # a binding that takes a CUDA device guard before any op (copy_, nonzero, ...): a CPU build has none
            if "not linked with support for cuda devices" not in str(e) or not _has_fake(args, kwargs):
                raise
        except NotImplementedError as e:
            if "from the 'CUDA' backend" not in str(e):
                raise
            raise NotImplementedError(f"fake_cuda: {getattr(func, '__name__', func)} allocates a CUDA tensor inside "
                                      "its C++ implementation, which a CPU build cannot; the double needs a handler "
                                      "for it (see _HANDLERS in ops/fake_cuda/__init__.py)") from e
        return ft.call_through_proxies(func, args, kwargs)


_MISSING = object()
_active: list[FakeCuda] = []  # the open double, if any


@contextlib.contextmanager
def fake_cuda(total_memory: int = 80 * 2**30) -> Iterator[FakeCuda]:
    """Open the double: this thread sees one CUDA device with ``total_memory`` bytes (see the module docstring)."""
    if _active:
        raise RuntimeError("fake_cuda() is already open; nest fc.counting() blocks instead")
    fc = FakeCuda(total_memory)
    saved: list[tuple[object, str, object]] = []
    ft.default_generator.manual_seed(ft.CUDA_DEFAULT_SEED)  # each context starts where a fresh CUDA process does
    dev.reset_streams()
    try:
        for obj, name, value in patches(fc):
            saved.append((obj, name, getattr(obj, name, _MISSING)))
            setattr(obj, name, value)
        ft.set_recorder(fc)
        _active.append(fc)
        with fc.mode:
            yield fc
    finally:
        _active.clear()
        ft.set_recorder(None)
        ft.set_capture(None)  # a capture left open by an exception ends with the double
        for obj, name, old in reversed(saved):
            if old is _MISSING:
                delattr(obj, name)
            else:
                setattr(obj, name, old)
