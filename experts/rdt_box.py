"""How the `rdt` expert transport (router_service/transports/rdt.py) hands a tensor to the other side: as an ObjectRef
in Ray's RDT store that the reader reads out of the writer's memory through NIXL, one-sided, on its own thread.

NIXL is Ray Direct Transport's one-sided transport: the driver (an embedded router) may put and read, no collective
group is needed, and a failed read is aborted instead of killing the actors (docs/concepts/transports.md: Device to
device). Refs travel boxed (in a list or tuple) so Ray never starts its own receive task for them.
"""

from __future__ import annotations

import os

import ray
import torch

# NIXL's Python package logs every agent start at INFO to stdout, where it lands in the output of commands that
# print JSON (`expertmesh bench dispatch --json`), also from actors (Ray forwards their stdout). Ray imports NIXL on
# its first use, after this module, in the router and in every actor; an explicit NIXL_LOG_LEVEL wins.
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

RDT_TENSOR_TRANSPORT = "nixl"
RDT_READ_TIMEOUT_S = 30.0  # an actor reading the router's rows: a router gone mid-call must not hold it for long


def rdt_box(tensor: torch.Tensor) -> ray.ObjectRef | torch.Tensor:
    """What travels for `tensor`: an ObjectRef to read through NIXL, or an empty tensor itself (NIXL cannot register
    zero bytes: a read of one fails)."""
    if tensor.numel() == 0:
        return tensor.cpu()
    return ray.put(tensor, _tensor_transport=RDT_TENSOR_TRANSPORT)


def rdt_unbox(box: ray.ObjectRef | torch.Tensor, timeout: float = RDT_READ_TIMEOUT_S) -> torch.Tensor:
    """The tensor `rdt_box` sent, read out of the sender's memory (an empty one came as itself)."""
    return box if isinstance(box, torch.Tensor) else ray.get(box, timeout=timeout)
