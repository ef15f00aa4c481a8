"""Moving tensors between processes in any dtype, bit for bit, and off the device with one synchronisation.

numpy has no bfloat16, so tensors never cross as numpy floats: a `HostTensor` is a dtype name plus a numpy array of
same-sized integers viewing the tensor's raw bytes. Ray passes that array zero-copy through its object store, and
`to_tensor` views it as the torch dtype again without copying, so float32, float16 and bfloat16 all arrive bit-exact.

`HostStager` brings the rows that must leave the device to host memory: each into a pinned buffer with a
non-blocking copy, then one synchronisation for the whole batch (one per MoE layer on the router, one per call on an
actor), never one per expert. For host tensors there is nothing to copy and nothing to wait for.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

# Element size -> the integer type whose array carries those bytes (torch, numpy).
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_NP_BITS = {1: np.dtype(np.uint8), 2: np.dtype(np.int16), 4: np.dtype(np.int32), 8: np.dtype(np.int64)}
# Dtypes a HostTensor (and the gRPC wire, experts/wire.py) carries, by their torch names.
CARRIED_DTYPES = ("float32", "bfloat16", "float16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool")


@dataclass(frozen=True)
class HostTensor:
    """A host tensor as raw bytes: `bits` has the tensor's shape and an integer type of its element size."""

    dtype: str  # torch name, e.g. "bfloat16"
    bits: np.ndarray

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.bits.shape)


def torch_dtype_of(name: str) -> torch.dtype:
    if name not in CARRIED_DTYPES:
        raise ValueError(f"dtype {name!r} is not one of {CARRIED_DTYPES}")
    return getattr(torch, name)


def bits_dtype(name: str) -> np.dtype:
    """The numpy integer type that carries a `name` tensor's bytes."""
    return _NP_BITS[torch_dtype_of(name).itemsize]  # no tensor built: this runs for every call a router sends


def pack(tensor: torch.Tensor) -> HostTensor:
    """A host tensor -> HostTensor viewing its bytes (a copy only when it is not contiguous)."""
    if tensor.device.type != "cpu":
        raise ValueError(f"pack: the tensor is on {tensor.device}; stage it to host memory first (HostStager)")
    name = str(tensor.dtype).removeprefix("torch.")
    torch_dtype_of(name)  # refuses complex and other dtypes the wire does not carry
    host = tensor.detach().contiguous()
    return HostTensor(name, host.view(_BITS[host.element_size()]).numpy())


def to_tensor(packed: HostTensor) -> torch.Tensor:
    """HostTensor -> a torch tensor viewing the same bytes (read-only when they come from Ray's object store or a
    gRPC message: callers never write to it)."""
    dtype = torch_dtype_of(packed.dtype)
    if packed.bits.dtype != bits_dtype(packed.dtype):
        raise ValueError(f"a {packed.dtype} tensor travels as {bits_dtype(packed.dtype)}, got {packed.bits.dtype}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch warns that the array is not writable
        return torch.from_numpy(packed.bits).view(dtype)


class HostStager:
    """Copies tensors to host memory through pinned buffers: `stage` starts a non-blocking copy per tensor,
    `finish` waits once for all of them. Host tensors pass through untouched, and a batch of only host tensors needs
    no wait. synchronize(device) is the one wait (by default an event on the device's current stream);
    always_stage=True stages host tensors too (tests count the copies and waits
    of the code path on a CPU-only machine)."""

    def __init__(self, synchronize: Callable[[torch.device], None] | None = None, always_stage: bool = False):
        self.synchronize = synchronize  # None: torch.cuda.synchronize, looked up at each wait
        self.always_stage = always_stage
        self.copies = 0  # tensors copied into a staging buffer since creation
        self.syncs = 0  # waits since creation
        self._waiting_on: torch.device | None = None

    def stage(self, tensor: torch.Tensor) -> torch.Tensor:
        """-> a host tensor holding `tensor`'s values once `finish` returned."""
        if tensor.device.type == "cpu" and not self.always_stage:
            return tensor.contiguous()
        # Pinned (page-locked) memory lets the copy run asynchronously; torch's caching host allocator reuses it.
        buffer = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.device.type == "cuda")
        buffer.copy_(tensor, non_blocking=True)
        self.copies += 1
        self._waiting_on = tensor.device
        return buffer

    def finish(self) -> None:
        """Wait for every copy `stage` started since the last finish (once, whatever their number)."""
        if self._waiting_on is None:
            return
        device, self._waiting_on = self._waiting_on, None
        (self.synchronize or wait_for_stream)(device)
        self.syncs += 1


def wait_for_stream(device: torch.device) -> None:
    """Wait for the work queued so far on `device`'s current stream (the copies just staged), not for every stream
    of the device as torch.cuda.synchronize would."""
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    event.synchronize()
