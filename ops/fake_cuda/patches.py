"""What fake_cuda() swaps into torch.cuda, torch.accelerator, torch.backends.cuda and torch.Generator.

Part of the fake-CUDA double (ops/fake_cuda/__init__.py). ``patches(fc)`` lists (object, attribute, replacement); the
context manager installs them and puts the originals back on exit.
"""

from __future__ import annotations

from typing import Any

import torch

from ...experts import reproducible
from . import device as dev
from . import graphs
from . import tensor as ft
from .tensor import FakeCudaGenerator, check_cuda_device

_RealGenerator = torch.Generator


class _GeneratorMeta(type):
    """torch.Generator while the double is open: device "cuda" makes a FakeCudaGenerator; isinstance still works."""

    def __call__(cls, device: Any = "cpu") -> torch.Generator:
        d = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        if d.type == "cuda":
            check_cuda_device(d)
            return FakeCudaGenerator()
        return _RealGenerator(d)

    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, _RealGenerator)

    def __subclasscheck__(cls, sub: type) -> bool:
        return issubclass(sub, _RealGenerator)


class PatchedGenerator(metaclass=_GeneratorMeta):
    __doc__ = _RealGenerator.__doc__


def _seed_all(seed: int) -> None:
    ft.default_generator.manual_seed(int(seed))


def _seed() -> None:
    ft.default_generator.seed()


def _get_rng_state(device: Any = "cuda") -> torch.Tensor:
    check_cuda_device(device)
    return ft.default_generator.get_state()


def _set_rng_state(state: torch.Tensor, device: Any = "cuda") -> None:
    check_cuda_device(device)
    ft.default_generator.set_state(state)


def _per_device(value: Any) -> Any:
    """A torch.cuda query taking an optional device: checks it names the one device, then answers."""

    def query(device: Any = None) -> Any:
        check_cuda_device(device)
        return value() if callable(value) else value

    return query


def patches(fc: Any) -> list[tuple[object, str, object]]:
    """(object, attribute, replacement) for everything the double replaces while it is open."""
    props = dev.FakeDeviceProperties(total_memory=fc.total_memory)
    cuda: dict[str, object] = {
        "is_available": lambda: True,
        "is_initialized": lambda: True,
        "init": lambda: None,
        "device_count": lambda: 1,
        "current_device": lambda: 0,
        "set_device": check_cuda_device,
        "device": dev.device,
        "device_of": dev.device_of,
        "get_device_name": _per_device(props.name),
        "get_device_capability": _per_device((props.major, props.minor)),
        "get_device_properties": _per_device(props),
        "is_bf16_supported": lambda including_emulation=True: True,
        "synchronize": dev.synchronize,
        "Stream": dev.FakeStream,
        "Event": dev.FakeEvent,
        "current_stream": dev.current_stream,
        "default_stream": dev.default_stream,
        "set_stream": dev.set_stream,
        "stream": dev.stream,
        "mem_get_info": fc.mem_get_info,
        "memory_allocated": _per_device(fc.memory_allocated),
        "max_memory_allocated": _per_device(fc.max_memory_allocated),
        "memory_reserved": _per_device(fc.memory_allocated),  # no caching allocator: reserved is allocated
        "max_memory_reserved": _per_device(fc.max_memory_allocated),
        "reset_peak_memory_stats": _per_device(fc.reset_peak),
        "empty_cache": lambda: None,
        "manual_seed": _seed_all,
        "manual_seed_all": _seed_all,
        "seed": _seed,
        "seed_all": _seed,
        "initial_seed": lambda: ft.default_generator.initial_seed(),
        "get_rng_state": _get_rng_state,
        "set_rng_state": _set_rng_state,
        "get_rng_state_all": lambda: [ft.default_generator.get_state()],
        "set_rng_state_all": lambda states: ft.default_generator.set_state(states[0]),
        "default_generators": (ft.default_generator,),
        "CUDAGraph": graphs.FakeCUDAGraph,
        "graph": graphs.graph,
        "graph_pool_handle": graphs.graph_pool_handle,
        "is_current_stream_capturing": graphs.is_current_stream_capturing,
    }
    out: list[tuple[object, str, object]] = [(torch.cuda, name, value) for name, value in cuda.items()]
    # Its "cuda" products run on the CPU's kernels: padded like the CPU's (experts/reproducible.py), so a router
    # step on the double gives the CPU router's bits whatever this CPU's small-row kernels do.
    out.append((reproducible, "CPU_KERNEL_DEVICES", frozenset({"cpu", "cuda"})))
    out += [(torch, "Generator", PatchedGenerator), (torch.backends.cuda, "is_built", lambda: True),
            # Module.to("cuda") must make new Parameters around the fake tensors: its default, `param.data =
            # fake`, would leave a Parameter object over a CUDA TensorImpl that no Python class dispatches for
            (torch.__future__, "_overwrite_module_params_on_conversion", True)]
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None:
        acc: dict[str, object] = {
            "is_available": lambda: True,
            "current_accelerator": lambda check_available=False: torch.device("cuda"),
            "device_count": lambda: 1,
            "current_device_index": lambda: 0,
            "current_device_idx": lambda: 0,
            "set_device_index": check_cuda_device,
            "set_device_idx": check_cuda_device,
            "synchronize": dev.synchronize,
            "current_stream": dev.current_stream,
            "set_stream": dev.set_stream,
            "empty_cache": lambda: None,
            "memory_allocated": lambda device_index=None: fc.memory_allocated(),
            "max_memory_allocated": lambda device_index=None: fc.max_memory_allocated(),
        }
        out += [(accelerator, name, value) for name, value in acc.items() if hasattr(accelerator, name)]
    return out
