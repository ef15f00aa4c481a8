"""How the `rdt` expert transport (router_service/transports/rdt.py) hands a tensor to the other side: as an ObjectRef
in Ray's RDT store that the reader reads out of the writer's memory through NIXL, one-sided, on its own thread.

NIXL is Ray Direct Transport's one-sided transport: the driver (an embedded router) may put and read, no collective
group is needed, and a failed read is aborted instead of killing the actors (docs/concepts/transports.md: Device to
device). Refs travel boxed (`RdtBox`, with the tensor's shape and dtype) so Ray never starts its own receive task for
them, and so the reader can choose where the bytes land before it reads.

Memory registered once per process, never per call. NIXL reads out of and into registered memory only; a buffer
registered for one call and deregistered after it costs a registration each time and, worse, bumps this process's
NIXL metadata version, so every peer disconnects from it and reloads its metadata before its next read (Ray 2.60
`nixl_tensor_transport.py`: `remove_remote_agent` on a version change). So:
- what a process *sends*: the router's rows go through a send slab it carves itself (`slab("send", device)`: the
  router knows when a call is over and gives the range back then); an actor's outputs go through Ray's NIXL memory pool
  (`register_nixl_memory_pool`: Ray frees a put's range when its ref goes out of scope, which only Ray knows);
- what a process *reads* lands in a receive slab (`rdt_read`, `rdt_reading`).
A tensor that does not fit takes the old way: registered for its own put or read, deregistered after.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import ray
import torch

from .nixl_progress import quiet_nixl_progress_thread
from .slab_allocator import SlabAllocator

# NIXL's Python package logs every agent start at INFO to stdout, where it lands in the output of commands that
# print JSON (`expertmesh bench dispatch --json`), also from actors (Ray forwards their stdout). Ray imports NIXL on
# its first use, after this module, in the router and in every actor; an explicit NIXL_LOG_LEVEL wins.
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
quiet_nixl_progress_thread()  # before Ray makes this process's NIXL agent (on its first put or read)

RDT_TENSOR_TRANSPORT = "nixl"
RDT_READ_TIMEOUT_S = 30.0  # an actor reading the router's rows: a router gone mid-call must not hold it for long
# Registered once per process and device, each: the rows or outputs of the calls in flight at once. A decode round of
# Mixtral-8x7B at batch 256 moves 256 × 2 × 8 KiB = 4 MiB of rows in all; a prefill chunk beyond the slab takes the
# per-call registration path (correct, slower). On a CPU box of 9 processes: 9 × 3 × 32 MiB, touched as used.
RDT_SLAB_BYTES = 32 << 20


@dataclass(frozen=True)
class RdtBox:
    """What travels for a tensor: the ref to read, and the tensor's shape and dtype (torch name) so the reader can
    pick the registered range the bytes land in before reading."""

    ref: ray.ObjectRef
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        return _numel(self.shape) * getattr(torch, self.dtype).itemsize

    def view_in(self, flat: torch.Tensor) -> torch.Tensor:
        """This box's tensor as a view of the uint8 range `flat`."""
        return flat[: self.nbytes].view(getattr(torch, self.dtype)).view(self.shape)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for size in shape:
        n *= size
    return n


class RegisteredSlab:
    """One uint8 buffer on a device, registered with NIXL once, carved into ranges by a SlabAllocator."""

    def __init__(self, nbytes: int, device: torch.device):
        from ray.experimental import register_nixl_memory

        self.buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        register_nixl_memory(self.buffer)  # for the process's lifetime: see the module docstring
        self.ranges = SlabAllocator(nbytes)
        self.lock = threading.Lock()

    def take(self, nbytes: int) -> tuple[int, torch.Tensor] | None:
        """(offset, a uint8 view of nbytes) of a free range, or None when none is free."""
        with self.lock:
            offset = self.ranges.take(nbytes)
        return None if offset is None else (offset, self.buffer[offset: offset + nbytes])

    def give_back(self, offset: int) -> None:
        with self.lock:
            self.ranges.give_back(offset)

    def retire(self, offset: int) -> None:
        with self.lock:
            self.ranges.retire(offset)


_slabs: dict[tuple[str, str], RegisteredSlab] = {}  # (role, device) -> this process's slab
_slabs_lock = threading.Lock()
_pool_device: list[torch.device] = []  # the device of this process's Ray NIXL pool, once registered
_stream_told: list[torch.device] = []  # Ray was told this process's CUDA stream (set_nixl_cuda_stream)
stats = {"slab_misses": 0, "pool_misses": 0, "retired_reads": 0}  # took the per-call registration path; failed reads


def slab(role: str, device: torch.device | str) -> RegisteredSlab:
    """This process's registered slab for `role` ("send" or "read") on `device`, made on first use."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (role, str(device))
    with _slabs_lock:
        if key not in _slabs:
            _slabs[key] = RegisteredSlab(RDT_SLAB_BYTES, device)
        return _slabs[key]


def rdt_box(tensor: torch.Tensor) -> RdtBox | torch.Tensor:
    """Put `tensor` (an actor's output) for a one-sided read: copied into Ray's NIXL memory pool, registered once per
    process. An empty tensor travels itself (NIXL cannot register zero bytes: a read of one fails)."""
    if tensor.numel() == 0:
        return tensor.cpu()
    tensor = tensor.contiguous()
    _stream_waits_only(tensor.device)
    _ensure_pool(tensor.device)
    from ray.experimental.rdt.nixl_memory_pool import NixlOutOfMemoryError

    try:
        ref = ray.put(tensor, _tensor_transport=RDT_TENSOR_TRANSPORT)
    except NixlOutOfMemoryError:  # the pool is full of outputs not yet read: register this one for its own put
        stats["pool_misses"] += 1
        ref = _put_registered(tensor)
    if tensor.device.type == "cuda":
        # Ray's pool copy is queued on the current stream: done before any reader can learn the ref.
        torch.cuda.current_stream(tensor.device).synchronize()
    return RdtBox(ref, tuple(tensor.shape), _dtype_name(tensor))


def rdt_box_rows(rows: torch.Tensor) -> tuple[RdtBox | torch.Tensor, Callable[[], None]]:
    """Put the router's rows for one call out of this process's send slab, -> (box, give_back). Call give_back once
    the call is over (its output read or the call failed): until then the actor may still be reading the range."""
    if rows.numel() == 0:
        return rows.cpu(), _nothing
    rows = rows.contiguous()
    _stream_waits_only(rows.device)
    send = slab("send", rows.device)
    taken = send.take(rows.numel() * rows.element_size())
    if taken is None:
        stats["slab_misses"] += 1
        return RdtBox(_put_registered(rows), tuple(rows.shape), _dtype_name(rows)), _nothing
    offset, flat = taken
    staged = flat.view(rows.dtype).view(rows.shape)
    staged.copy_(rows)
    if rows.device.type == "cuda":
        torch.cuda.current_stream(rows.device).synchronize()  # the copy is done before the actor may read it
    # A view of registered memory: Ray neither registers it again nor copies it into the pool.
    ref = ray.put(staged, _tensor_transport=RDT_TENSOR_TRANSPORT)
    return RdtBox(ref, tuple(rows.shape), _dtype_name(rows)), lambda: send.give_back(offset)


def rdt_read(boxes: list[RdtBox | torch.Tensor], device: torch.device | str,
             timeout: float = RDT_READ_TIMEOUT_S) -> list[torch.Tensor]:
    """The tensors the boxes hold, read at once onto `device` through the receive slab and copied out of it (the
    slab's ranges are free again on return). Empty tensors came as themselves. Raises what the read raised; the
    ranges of a failed read are retired (a late transfer may still land in them)."""
    device = torch.device(device)
    read_slab = slab("read", device)
    landed: list[tuple[int, torch.Tensor] | None] = []
    refs = []
    for box in boxes:
        if isinstance(box, torch.Tensor):
            continue
        landed.append(_aim(box, read_slab, device))  # keeps the view alive: Ray holds only a weak reference to it
        refs.append(box.ref)
    try:
        values = ray.get(refs, timeout=timeout) if refs else []
        copies = iter([value if spot is None else value.clone() for value, spot in zip(values, landed)])
        if device.type == "cuda" and any(spot is not None for spot in landed):
            # The clones are queued on the stream: done before the ranges take the next read (one wait per gather).
            torch.cuda.current_stream(device).synchronize()
    except BaseException:
        for spot in landed:
            if spot is not None:
                read_slab.retire(spot[0])
                stats["retired_reads"] += 1
        raise
    for spot in landed:
        if spot is not None:
            read_slab.give_back(spot[0])
    return [box if isinstance(box, torch.Tensor) else next(copies) for box in boxes]


@contextmanager
def rdt_reading(box: RdtBox | torch.Tensor, device: torch.device | str,
                timeout: float = RDT_READ_TIMEOUT_S) -> Iterator[torch.Tensor]:
    """The tensor `box` holds, read onto `device` into the receive slab and used there in place for the block (an
    actor's rows, consumed by its forward); the range is free again after it."""
    if isinstance(box, torch.Tensor):
        yield box
        return
    device = torch.device(device)
    read_slab = slab("read", device)
    spot = _aim(box, read_slab, device)
    if spot is None:
        yield ray.get(box.ref, timeout=timeout)
        return
    offset, _view = spot  # the view stays referenced until the read is done: Ray holds only a weak reference
    try:
        value = ray.get(box.ref, timeout=timeout)
    except BaseException:
        read_slab.retire(offset)
        stats["retired_reads"] += 1
        raise
    try:
        yield value
    finally:
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()  # the block's kernels are done with the range
        read_slab.give_back(offset)


def _aim(box: RdtBox, read_slab: RegisteredSlab, device: torch.device) -> tuple[int, torch.Tensor] | None:
    """Point `box`'s read at a free range of the read slab -> (offset, the tensor's view there); when none is free,
    at a fresh buffer on `device` (the per-call registration way) -> None."""
    from ray.experimental import set_target_device_for_ref, set_target_for_ref

    taken = read_slab.take(box.nbytes)
    if taken is None:
        stats["slab_misses"] += 1
        set_target_device_for_ref(box.ref, device.type)
        return None
    view = box.view_in(taken[1])
    set_target_for_ref(box.ref, [view])
    return taken[0], view


def _stream_waits_only(device: torch.device) -> None:
    """Ray waits for a CUDA tensor before it registers or pools it: for the whole device unless told a stream
    (`set_nixl_cuda_stream`). Tell it this process's current stream, where the router's and actors' kernels run."""
    if device.type != "cuda" or _stream_told:
        return
    from ray.experimental import set_nixl_cuda_stream

    set_nixl_cuda_stream(torch.cuda.current_stream(device))
    _stream_told.append(device)


def _ensure_pool(device: torch.device) -> None:
    """Register this process's Ray NIXL memory pool (one per process, on the device of its first put)."""
    if _pool_device:
        return
    with _slabs_lock:
        if not _pool_device:
            from ray.experimental import register_nixl_memory_pool

            register_nixl_memory_pool(RDT_SLAB_BYTES, device)
            _pool_device.append(device)


def _put_registered(tensor: torch.Tensor) -> ray.ObjectRef:
    """The per-call way: register the tensor for this put alone (Ray deregisters it with the ref)."""
    from ray.experimental import deregister_nixl_memory, register_nixl_memory

    register_nixl_memory(tensor)  # a registration of its own, so Ray does not try the pool again
    try:
        return ray.put(tensor, _tensor_transport=RDT_TENSOR_TRANSPORT)
    finally:
        deregister_nixl_memory(tensor)  # the put holds its own count until its ref goes out of scope


def _dtype_name(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def _nothing() -> None:
    return None

