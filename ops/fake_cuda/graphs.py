"""CUDA graphs under the fake-CUDA double: a capture records the device's operators, a replay runs them again on the
very tensors they were recorded with.

Part of the fake-CUDA double (ops/fake_cuda/__init__.py). What it keeps of CUDA's semantics is what graph code gets
wrong, each of which passes silently if a "graph" simply re-ran the Python function:
- A replay re-runs the recorded kernels on the recorded memory. New inputs must be *copied into* the static tensors
  the capture read; a new tensor bound to the same Python name is never seen. Shapes, Python scalars and Python
  branches are frozen at capture.
- A capture only records: the tensors it allocates hold no values until the first replay. Here they are poisoned
  (NaN; the lowest integer) when the capture ends, so code that reads them before replaying fails its comparison.
- Inside a capture, a device-to-host read, a synchronize and an operator whose output size depends on device data
  raise (CUDA: "operation not permitted when stream is capturing"), and so does a host-to-device copy, which a
  replay would repeat from the capture-time host buffer (freed or reused by then).
- Operators on the device that the double runs above aten (scaled_dot_product_attention, one_hot) are recorded too.
Not emulated: memory pools (``pool=`` is accepted and ignored; graph memory is ordinary memory), random factories
called with ``device="cuda"`` inside a capture (their values stay those of the capture), capture error modes.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from . import device as dev
from . import tensor as ft

_handles = itertools.count(1)


class _Op:
    """One recorded operator: fn over the CPU tensors underneath, and its fresh outputs to refill at replay."""

    __slots__ = ("fn", "args", "kwargs", "outs", "rng")

    def __init__(self, fn: Callable, args: tuple, kwargs: dict, outs: list[torch.Tensor],
                 rng: torch.Generator | None) -> None:
        self.fn, self.args, self.kwargs, self.outs, self.rng = fn, args, kwargs, outs, rng

    def run(self) -> None:
        with ft.drawing_from(self.rng) if self.rng is not None else contextlib.nullcontext():
            result = self.fn(*self.args, **self.kwargs)
        fresh = [t for t in tree_leaves(result) if isinstance(t, torch.Tensor)]
        for recorded, new in zip(self.outs, fresh):
            if recorded is not None:
                recorded.copy_(new)


def _inputs(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    return [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]


def _aliases(t: torch.Tensor, inputs: list[torch.Tensor]) -> bool:
    ptr = t.untyped_storage().data_ptr()
    return any(t is x or (x.numel() and ptr == x.untyped_storage().data_ptr()) for x in inputs)


class Capture:
    """The operators recorded between capture_begin and capture_end (the double's hooks call `add`)."""

    def __init__(self) -> None:
        self.ops: list[_Op] = []

    def add(self, fn: Callable, args: tuple, kwargs: dict, result: Any, rng: torch.Generator | None = None) -> None:
        """fn(*args, **kwargs) (CPU tensors underneath) just made `result` (CPU tensors): replay it. Outputs that
        alias an input (in place, out=, views) need no refill: re-running fn writes or views the same memory."""
        inputs = _inputs(args, kwargs)
        outs = [None if _aliases(t, inputs) else t
                for t in tree_leaves(result) if isinstance(t, torch.Tensor)]
        self.ops.append(_Op(fn, args, kwargs, outs, rng))

    def poison(self) -> None:
        """What a capture allocated holds nothing until a replay computes it."""
        for op in self.ops:
            for t in op.outs:
                if t is None or t.numel() == 0:
                    continue
                if t.dtype.is_floating_point or t.dtype.is_complex:
                    t.fill_(float("nan"))
                elif t.dtype != torch.bool:
                    t.fill_(torch.iinfo(t.dtype).min)

    def replay(self) -> None:
        for op in self.ops:
            op.run()


class FakeCUDAGraph:
    """torch.cuda.CUDAGraph on the double: capture_begin / capture_end / replay / reset / pool."""

    def __init__(self, keep_graph: bool = False) -> None:
        self._capture: Capture | None = None
        self._handle = (next(_handles), 0)

    def capture_begin(self, pool: Any = None, capture_error_mode: str = "global") -> None:
        if ft.capture_in_progress() is not None:
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing (a capture is already "
                               "in progress)")
        if self._capture is not None:
            raise RuntimeError("This CUDAGraph instance already owns a captured graph. To capture a new graph, "
                               "create a new instance.")
        self._capture = Capture()
        ft.set_capture(self._capture)

    def capture_end(self) -> None:
        if ft.capture_in_progress() is not self._capture or self._capture is None:
            raise RuntimeError("capture_end without a capture in progress")
        ft.set_capture(None)
        self._capture.poison()

    def abandon(self) -> None:
        """A capture that raised: CUDA invalidates it (the graph cannot be replayed)."""
        if ft.capture_in_progress() is self._capture:
            ft.set_capture(None)
        self._capture = None

    def replay(self) -> None:
        if self._capture is None or ft.capture_in_progress() is self._capture:
            raise RuntimeError("Called CUDAGraph::replay without a preceding successful capture.")
        self._capture.replay()

    def reset(self) -> None:
        self._capture = None

    def pool(self) -> tuple[int, int]:
        return self._handle

    @property
    def num_ops(self) -> int:
        """How many operators the capture recorded (the double's own; the real class has no such field)."""
        return 0 if self._capture is None else len(self._capture.ops)


class graph:  # noqa: N801  (torch.cuda.graph is a lower-case class)
    """torch.cuda.graph(cuda_graph, pool=None, stream=None, capture_error_mode="global"): capture the block.

    As the real context, entering synchronizes the device (counted) before the capture begins."""

    def __init__(self, cuda_graph: FakeCUDAGraph, pool: Any = None, stream: Any = None,
                 capture_error_mode: str = "global") -> None:
        self.cuda_graph = cuda_graph
        self.pool = pool
        self.stream = stream

    def __enter__(self) -> None:
        dev.synchronize()
        self.cuda_graph.capture_begin(pool=self.pool)

    def __exit__(self, exc_type: Any, *exc: object) -> None:
        if exc_type is not None:
            self.cuda_graph.abandon()
            return
        self.cuda_graph.capture_end()


def graph_pool_handle() -> tuple[int, int]:
    return (next(_handles), 0)


def is_current_stream_capturing() -> bool:
    return ft.capture_in_progress() is not None
