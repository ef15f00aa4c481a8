"""Import layering read from the source: no two modules import each other, even through imports inside functions.

A cycle hidden behind late imports (weights.py <-> weights_deepseek.py used to be one) works until someone moves an
import to the top; the fix is a shared lower module (experts/dense_weights.py) and a table, not a later import.
Read with `ast`, so nothing is imported and the test is fast.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = {"cluster": "expertmesh.cluster", "experts": "expertmesh.experts",
           "router_service": "expertmesh.router_service", "protos": "expertmesh.protos", "ops": "expertmesh.ops"}
# The fake-CUDA test double: a package whose submodules patch torch together and import one another by design.
ALLOWED_CYCLES = [{"expertmesh.ops.fake_cuda", "expertmesh.ops.fake_cuda.device", "expertmesh.ops.fake_cuda.graphs",
                   "expertmesh.ops.fake_cuda.patches",
                   "expertmesh.ops.fake_cuda.tensor"}]


def _modules() -> dict[str, tuple[Path, bool]]:
    """module name -> (file, is a package)."""
    found = {}
    for folder, package in FOLDERS.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            is_package = parts[-1] == "__init__"
            found[".".join((package, *(parts[:-1] if is_package else parts)))] = (path, is_package)
    return found


def import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports anywhere in its body (module level or inside a function)."""
    modules = _modules()
    graph = {}
    for name, (path, is_package) in modules.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name.split(".") if is_package else name.split(".")[:-1]
                    base = base[:len(base) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                deps |= {c for c in (target, *(f"{target}.{a.name}" for a in node.names)) if c in modules}
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name in modules}
        graph[name] = deps - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components with more than one module (iterative Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(component)
    return found


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_two_modules_import_each_other():
    found = [c for c in cycles(import_graph()) if c not in ALLOWED_CYCLES]
    assert found == [], f"import cycles: {[sorted(c) for c in found]}"


def test_the_dense_weights_loaders_do_not_import_each_other():
    graph = import_graph()
    assert "expertmesh.experts.weights" not in graph["expertmesh.experts.weights_deepseek"]
    assert "expertmesh.experts.weights" not in graph["expertmesh.experts.dense_weights"]
