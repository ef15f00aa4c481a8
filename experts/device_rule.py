"""Which tensors live on the router's device and which on the host: the one rule, written once.

On a router with a GPU (router.gpus > 0) every mixed-device mistake raises on the first request, and every read of a
device value (`.tolist()`, `.item()`, `int()`, `bool()`, a blocking copy) stalls the host until the GPU catches up.
The rule that keeps both in check:

  device  the router's GPU (or the CPU, where all of this is free): weights, activations, the paged KV pool, gate
          logits and the `Routing` the gate returns, the lm_head's logits, sampling and its generators, and the
          combine's arithmetic (weights x expert outputs added into [T, H]).
  host    CPU memory: everything the dispatcher decides in Python. Once a layer's routing leaves the gate it is
          host bookkeeping: the no-replica policy, shedding, capacity moves, dispatch planning (rows grouped by
          expert and actor), routing tables and their masks, load statistics, per-request counts, wire buffers.

The crossings, and only these:

  `layer_to_host`  per MoE layer, the routing's tensors and the hidden rows [T, H] go to pinned host memory with
                   non-blocking copies and one wait: the layer's one device->host read. (The whole [T, H] is never
                   more bytes than the rows the experts need, T x k x H, and the rows are then gathered on the host.)
  `to_device`      host tensors the device needs (the combine's indices, weights and expert outputs; a step's token
                   ids and positions) go up from pinned memory without waiting: the stream orders the copy before
                   the kernels that read it.
  `gather_rows`    for a transport that sends device rows itself (`rdt`: device to device), `layer_to_host` moves
                   the routing alone, and each call's rows are gathered on the device in one index_select from one
                   upload of the calls' token indices: no read, no wait.

Nothing else in the router's hot path reads a device value; `ops/fake_cuda/` runs the whole step under a
fake-CUDA double that raises on mixed devices and counts every read (tests/unit/test_router_step_fake_cuda.py).
Pure torch: no Ray.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields, replace

import torch

from .arrays import HostStager
from .gating import Routing

__all__ = ["cat_to_device", "gather_rows", "layer_to_host", "routing_on_host", "to_device", "tensor_on", "HOST"]

HOST = torch.device("cpu")

# Routing fields that are [T, ...] tensors (the rest are ints); probs/selection are [T, E] and optional to copy.
_ROUTING_TENSORS = tuple(f.name for f in fields(Routing) if f.name not in ("rerouted", "dropped"))
_WIDE = ("probs", "selection")


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`, copied without waiting (from pinned memory) when the device is a GPU; the tensor
    itself when it is already there. The host tensor must not be written to afterwards (the copy may still run)."""
    if tensor.device == device or device.type == "cpu" and tensor.device.type == "cpu":
        return tensor
    assert tensor.device.type == "cpu", f"to_device takes host tensors, got one on {tensor.device}"
    if not tensor.is_pinned():
        tensor = tensor.pin_memory()  # page-locked, so the copy is asynchronous (torch's caching host allocator)
    return tensor.to(device, non_blocking=True)


def cat_to_device(parts: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """torch.cat of host tensors, on `device`: on a GPU concatenated straight into pinned memory and sent up without
    a wait (to_device of a fresh cat would copy the rows once more, into a pinned buffer)."""
    if device.type == "cpu":
        return torch.cat(list(parts))
    first = parts[0]
    rows = sum(p.shape[0] for p in parts)
    pinned = torch.empty((rows, *first.shape[1:]), dtype=first.dtype, pin_memory=True)
    return to_device(torch.cat(list(parts), out=pinned), device)


def gather_rows(hidden: torch.Tensor, token_idx: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Each call's rows hidden[idx] ([n_i, H] each), gathered where hidden is: on the host call by call; on a device
    in one index_select after one upload of the host indices (no wait), as views of one [sum n_i, H] tensor."""
    if hidden.device.type == "cpu":
        return [hidden[idx] for idx in token_idx]
    if not token_idx:
        return []
    sizes = [int(idx.numel()) for idx in token_idx]
    index = cat_to_device(list(token_idx), hidden.device)  # [sum n_i] host ints, sent up without a wait
    return list(hidden.index_select(0, index).split(sizes))


def tensor_on(data, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.tensor(data) built on the host and sent to `device` without a wait (torch.tensor(data, device=cuda)
    copies from pageable memory and synchronises the stream)."""
    return to_device(torch.tensor(data, dtype=dtype), device)


def layer_to_host(routing: Routing, tensors: Sequence[torch.Tensor], stager: HostStager,
                  wide: bool = True) -> tuple[Routing, list[torch.Tensor]]:
    """One MoE layer's crossing: the routing (experts, weights, per-token counters; probs/selection too when `wide`)
    and `tensors` (e.g. hidden [T, H]) copied to host memory with one wait. -> (host routing, host tensors).
    Host inputs pass through untouched, with no wait."""
    on_host = routing.device.type == "cpu"
    names = [n for n in _ROUTING_TENSORS if getattr(routing, n) is not None and (wide or on_host or n not in _WIDE)]
    staged = [stager.stage(getattr(routing, n)) for n in names]
    extra = [stager.stage(t) for t in tensors]
    stager.finish()
    changed = {n: t for n, t in zip(names, staged) if t is not getattr(routing, n)}
    changed |= {n: None for n in _WIDE if not wide and not on_host}  # left on the device: not part of the host view
    return (replace(routing, **changed) if changed else routing), extra


def routing_on_host(routing: Routing) -> Routing:
    """The routing with every tensor in host memory: a no-op for a host routing (the router's, after
    `layer_to_host`); one read per tensor for a device one (the in-process reference's: not on a hot path)."""
    moved = {n: getattr(routing, n).cpu() for n in _ROUTING_TENSORS
             if getattr(routing, n) is not None and getattr(routing, n).device.type != "cpu"}
    return replace(routing, **moved) if moved else routing
