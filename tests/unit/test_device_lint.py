"""A static companion to the fake-CUDA double: tensor factories on the router path must say where they allocate.

``torch.zeros(n)`` without ``device=`` lands on the CPU whatever device the router runs on, and is the usual source
of the mixed-device errors ops/fake_cuda/__init__.py catches at run time. This scan finds them without running anything:
every call of a factory (below) in the router-path modules that has no ``device=`` keyword (nor ``**kwargs`` that
may carry one) is reported as "file:line". A tensor that is meant to live on the host (wire buffers, bookkeeping)
says so with a ``# host:`` comment on one of the call's lines, followed by the reason. ``*_like`` and ``new_*``
follow their input's device and are not factories here.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ROUTER_PATH = [
    "experts/gating.py", "experts/routed_rows.py", "router_service/dispatch_plan.py", "router_service/dispatch.py",
    "router_service/replica_health.py", "router_service/call_retry.py", "router_service/pending_layers.py",
    "router_service/table_switch.py", "router_service/prefetch.py",
    "router_service/batching.py", "router_service/sampling.py", "router_service/observability.py",
    "router_service/shedding.py", "cluster/load_stats.py", "experts/modeling.py", "experts/kv_cache.py",
    "experts/attention_core.py",
]
FACTORIES = frozenset({
    "zeros", "ones", "empty", "full", "arange", "tensor", "as_tensor", "asarray", "rand", "randn", "randint",
    "randperm", "eye", "linspace", "logspace", "empty_strided", "scalar_tensor", "tril_indices", "triu_indices",
})
MARKER = "# host:"


def _is_torch_factory(call: ast.Call) -> str | None:
    """The factory's name for ``torch.<factory>(...)`` calls, else None."""
    f = call.func
    if isinstance(f, ast.Attribute) and f.attr in FACTORIES and isinstance(f.value, ast.Name) \
            and f.value.id == "torch":
        return f.attr
    return None


def device_offenders(source: str, filename: str) -> list[str]:
    """"file:line: torch.<factory>(...) without device=" for each unmarked factory call in ``source``."""
    lines = source.splitlines()
    found = []
    for node in sorted(ast.walk(ast.parse(source, filename)), key=lambda n: getattr(n, "lineno", 0)):
        if not isinstance(node, ast.Call) or (name := _is_torch_factory(node)) is None:
            continue
        if any(kw.arg == "device" or kw.arg is None for kw in node.keywords):  # kw.arg None: **kwargs
            continue
        span = lines[node.lineno - 1:(node.end_lineno or node.lineno)]
        if any(MARKER in line for line in span):
            continue
        found.append(f"{filename}:{node.lineno}: torch.{name}(...) without device=")
    return found


def test_the_scan_flags_unmarked_factories_and_honours_the_marker():
    source = "\n".join([
        "import torch",
        "a = torch.zeros(3)",
        "b = torch.zeros(3, device=x.device)",
        "c = torch.tensor([1, 2])  # host: wire buffer",
        "d = torch.zeros_like(x)",
        "e = torch.arange(",
        "    4, dtype=torch.int64)",
        "f = torch.full((2,), 0,",
        "               dtype=torch.int64)  # host: bookkeeping",
        "g = torch.empty(2, **opts)",
        "h = x.new_zeros(2)",
    ])
    assert device_offenders(source, "m.py") == ["m.py:2: torch.zeros(...) without device=",
                                                "m.py:6: torch.arange(...) without device="]


def test_router_path_factories_name_their_device():
    offenders = [hit for rel in ROUTER_PATH for hit in device_offenders((ROOT / rel).read_text(), rel)]
    assert not offenders, "tensor factories without device= (mark deliberate host tensors '# host: why'):\n" + \
        "\n".join(offenders)
