"""Stand-ins for torch.cuda's device-side objects under the fake-CUDA double (see ops/fake_cuda/__init__.py).

Streams, events and device properties are plain Python: the double runs every kernel at once on the CPU, so a
stream is only a name, an event only a timestamp, and every wait is already over. What is kept is the count of the
calls that make the host wait for the device (synchronize, query), which is what a test of a GPU router wants.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from .tensor import CUDA0, check_cuda_device, record

_stream_ids = itertools.count(1)


class FakeStream:
    """torch.cuda.Stream: ``synchronize`` and ``query`` count as host syncs; the rest is bookkeeping."""

    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
        check_cuda_device(device)
        self.device = CUDA0
        self.priority = priority
        self.cuda_stream = next(_stream_ids)  # an int, as the real handle is

    def synchronize(self) -> None:
        record("sync", "Stream.synchronize")

    def query(self) -> bool:
        record("sync", "Stream.query")
        return True  # every kernel has already run

    def wait_event(self, event: FakeEvent) -> None:
        return None

    def wait_stream(self, stream: FakeStream) -> None:
        return None

    def record_event(self, event: FakeEvent | None = None) -> FakeEvent:
        event = event if event is not None else FakeEvent()
        event.record(self)
        return event

    def __enter__(self) -> FakeStream:
        _streams.push(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _streams.pop()

    def __repr__(self) -> str:
        return f"<FakeStream device=cuda:0 cuda_stream={self.cuda_stream:#x}>"


class FakeEvent:
    """torch.cuda.Event: records host time (kernels are synchronous here); ``synchronize``/``query`` are syncs."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self.enable_timing = enable_timing
        self._recorded_at: float | None = None

    def record(self, stream: FakeStream | None = None) -> None:
        self._recorded_at = time.perf_counter()

    def wait(self, stream: FakeStream | None = None) -> None:
        return None

    def query(self) -> bool:
        record("sync", "Event.query")
        return True

    def synchronize(self) -> None:
        record("sync", "Event.synchronize")

    def elapsed_time(self, end_event: FakeEvent) -> float:
        """Milliseconds between the two records, as CUDA reports them (errors worded as CUDA's)."""
        if not (self.enable_timing and end_event.enable_timing):
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'.")
        if self._recorded_at is None or end_event._recorded_at is None:
            raise RuntimeError("Both events must be recorded before calculating elapsed time.")
        return (end_event._recorded_at - self._recorded_at) * 1000.0


class _StreamStack:
    def __init__(self) -> None:
        self.default = FakeStream()
        self._stack: list[FakeStream] = []

    def current(self) -> FakeStream:
        return self._stack[-1] if self._stack else self.default

    def push(self, stream: FakeStream) -> None:
        self._stack.append(stream)

    def pop(self) -> None:
        self._stack.pop()

    def set(self, stream: FakeStream) -> None:
        if self._stack:
            self._stack[-1] = stream
        elif stream is not self.default:
            self._stack.append(stream)


_streams = _StreamStack()


def reset_streams() -> None:
    global _streams
    _streams = _StreamStack()


def current_stream(device: Any = None) -> FakeStream:
    check_cuda_device(device)
    return _streams.current()


def default_stream(device: Any = None) -> FakeStream:
    check_cuda_device(device)
    return _streams.default


def set_stream(stream: FakeStream) -> None:
    _streams.set(stream)


@contextlib.contextmanager
def stream(s: FakeStream | None) -> Iterator[FakeStream | None]:
    """torch.cuda.stream(s): make ``s`` current inside the block (None: leave the current one)."""
    if s is None:
        yield None
        return
    _streams.push(s)
    try:
        yield s
    finally:
        _streams.pop()


class device:  # noqa: N801  (torch.cuda.device is a lower-case class)
    """torch.cuda.device(i): the double has one device, so entering it changes nothing."""

    def __init__(self, device: Any) -> None:
        check_cuda_device(device)

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def device_of(obj: Any) -> device:
    return device(None)


def synchronize(device: Any = None) -> None:
    check_cuda_device(device)
    record("sync", "torch.cuda.synchronize")


@dataclass(frozen=True)
class FakeDeviceProperties:
    """The fields of torch.cuda.get_device_properties(0) that serving code reads (values of an H100 SXM)."""

    total_memory: int
    name: str = "Fake CUDA device (CPU double)"
    major: int = 9
    minor: int = 0
    multi_processor_count: int = 132
    is_integrated: bool = False
    is_multi_gpu_board: bool = False
    L2_cache_size: int = 50 * 2**20
    warp_size: int = 32
