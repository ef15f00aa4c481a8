"""expertmesh: elastic, fault-tolerant serving of Mixture-of-Experts models on Ray.

The public API, importable from here:

    from expertmesh import ExpertMesh, MeshConfig, ConfigError, __version__

    with ExpertMesh(MeshConfig()) as mesh:  # embedded default model, embedded Ray
        print(mesh.generate(prompt="def ", max_tokens=20).text)

The names resolve on first use (PEP 562 module `__getattr__`): `import expertmesh` itself imports nothing else, so
the CLI and tools that only need `MeshConfig` never load torch or Ray; `ExpertMesh` loads the data plane.

This file is the root package `expertmesh`. The repository's top level is fixed (cluster/ experts/ router_service/
protos/ ops/ tests/), so pyproject.toml maps the root package to this folder (`package-dir`), whose name has a hyphen
so it can never be imported a second time as `expertmesh.ops.<folder>`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # for type checkers and IDEs; at run time the names load lazily below
    from .experts.errors import ConfigError
    from .router_service.config import MeshConfig
    from .router_service.mesh import ExpertMesh

__all__ = ["ExpertMesh", "MeshConfig", "ConfigError", "__version__"]

# public name -> the module that defines it
_LAZY = {
    "ExpertMesh": "expertmesh.router_service.mesh",  # torch, Ray: loaded only when asked for
    "MeshConfig": "expertmesh.router_service.config",  # pure: no torch, Ray or gRPC
    "ConfigError": "expertmesh.experts.errors",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    elif name == "__version__":
        # The installed distribution's version: pyproject.toml stays its one source.
        from importlib.metadata import PackageNotFoundError, version

        try:
            value = version("expertmesh")
        except PackageNotFoundError:  # a source tree on sys.path without an install
            value = "0+unknown"
    else:
        raise AttributeError(f"module 'expertmesh' has no attribute {name!r}")
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
