"""The tests' own layout: no test module (nor helper, nor conftest) imports a test module.

Shared fakes live in tests/fakes.py, traffic and polling helpers in tests/traffic.py, fixtures in conftest.py; a test
module that imported helpers from another test module would run (and break with) that module's tests too.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
# tests/*.py that are not tests and not conftest: what a test module may import.
HELPERS = {f"tests.{p.stem}" for p in TESTS.glob("*.py")
           if not p.stem.startswith("test_") and p.stem not in ("__init__", "conftest")}


def _imported_modules(tree: ast.Module, package: str) -> list[tuple[int, str]]:
    """(line, absolute module name) for every import in the tree, relative ones resolved against `package`."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
                # `from . import test_x` names the module in the alias, not in `module`.
                found += [(node.lineno, f"{module}.{a.name}") for a in node.names] if not node.module else []
                found.append((node.lineno, module))
            else:
                found.append((node.lineno, node.module or ""))
    return found


def _bad_imports(path: Path) -> list[str]:
    rel = path.relative_to(TESTS.parent)
    package = ".".join(rel.parent.parts)
    bad = []
    for line, module in _imported_modules(ast.parse(path.read_text(), str(path)), package):
        if module != "tests" and not module.startswith("tests."):
            continue
        if module not in HELPERS:
            bad.append(f"{rel}:{line} imports {module}")
    return bad


def test_helper_modules_are_found():
    assert {"tests.fakes", "tests.traffic", "tests.tiny_checkpoints", "tests.served"} <= HELPERS
    assert not any(h.split(".")[-1].startswith("test_") for h in HELPERS)


def test_no_test_module_imports_another_test_module():
    modules = sorted(TESTS.rglob("test_*.py"))
    assert len(modules) > 30  # unit and integration both scanned
    modules += sorted(TESTS.rglob("conftest.py")) + [TESTS / f"{h.split('.')[-1]}.py" for h in sorted(HELPERS)]
    bad = [b for path in modules for b in _bad_imports(path)]
    assert not bad, "import helpers from tests/fakes.py, tests/traffic.py (or fixtures from conftest.py):\n" + \
        "\n".join(bad)


def test_the_check_catches_what_it_forbids():
    """The checker itself: each forbidden form is reported, the helper modules are not."""
    source = "\n".join([
        "from tests.unit.test_dispatch_plan import FakeTransport",
        "import tests.integration.test_failover",
        "from .test_live_remap import thing",
        "from . import test_overlap",
        "from tests.integration.conftest import local_ray",
        "from tests.fakes import FakeTransport",
        "from tests.traffic import wait_for",
        "import torch",
    ])
    found = _imported_modules(ast.parse(source), "tests.unit")
    modules = [m for _, m in found]
    assert "tests.unit.test_live_remap" in modules and "tests.unit.test_overlap" in modules
    bad = [m for m in modules if (m == "tests" or m.startswith("tests.")) and m not in HELPERS]
    assert bad == ["tests.unit.test_dispatch_plan", "tests.integration.test_failover", "tests.unit.test_live_remap",
                   "tests.unit.test_overlap", "tests.unit", "tests.integration.conftest"]
