"""Every Python package folder is in pyproject.toml's package list: a sub-package missing there still imports from
the editable install of a checkout, but is absent from a built wheel (and so from a cluster node that pip-installs
the project). The root package `expertmesh` (the public API) lives in ops/package-root/ and maps there."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python ≥ 3.11

ROOT = Path(__file__).resolve().parents[2]


def _setuptools() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_package_folder_is_listed_and_every_listed_one_exists():
    tool = _setuptools()
    roots = {folder: name for name, folder in tool["package-dir"].items()}
    found = set()
    for folder, name in roots.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            relative = init.parent.relative_to(ROOT / folder).parts
            # A folder that is itself the root of another mapping (the root package in ops/package-root/) is that
            # package, not a sub-package of the folder holding it.
            if init.parent != ROOT / folder and init.parent.relative_to(ROOT).as_posix() in roots:
                continue
            found.add(".".join((name, *relative)))
    assert found == set(tool["packages"])


def test_the_root_package_is_a_folder_that_cannot_be_imported_twice():
    folder = _setuptools()["package-dir"]["expertmesh"]
    assert (ROOT / folder / "__init__.py").is_file()
    # a name with a hyphen is no identifier: the file is `expertmesh`, never also `expertmesh.ops.<folder>`
    assert not Path(folder).name.isidentifier()


def test_the_installed_root_package_is_this_checkouts_and_finds_every_subpackage():
    import expertmesh

    assert Path(expertmesh.__file__).resolve() == (ROOT / _setuptools()["package-dir"]["expertmesh"] /
                                                   "__init__.py").resolve(), "reinstall: pip install -e ."
    for name in _setuptools()["packages"]:
        spec = importlib.util.find_spec(name)
        assert spec is not None and spec.origin is not None, name
        folder = _setuptools()["package-dir"].get(name)
        if folder is not None:
            assert Path(spec.origin).resolve().parent == (ROOT / folder).resolve(), name


_PROBE = r"""
import json, sys
import expertmesh
light = sorted({m.split(".")[0] for m in sys.modules} & {"torch", "ray", "grpc"})
from expertmesh import ConfigError, MeshConfig, __version__
config_light = sorted({m.split(".")[0] for m in sys.modules} & {"torch", "ray", "grpc"})
print(json.dumps({"light": light, "config_light": config_light, "version": __version__,
                  "config": MeshConfig.__module__, "error": ConfigError.__module__, "all": expertmesh.__all__}))
"""


def test_import_expertmesh_is_light_and_the_public_names_resolve():
    result = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    got = json.loads(result.stdout.strip().splitlines()[-1])
    assert got["light"] == [] and got["config_light"] == [], got
    from importlib.metadata import version

    assert got["version"] == version("expertmesh") == tomllib.loads((ROOT / "pyproject.toml").read_text())[
        "project"]["version"]
    assert got["config"] == "expertmesh.router_service.config"
    assert got["error"] == "expertmesh.experts.errors"
    assert set(got["all"]) == {"ExpertMesh", "MeshConfig", "ConfigError", "__version__"}


def test_expertmesh_gives_the_mesh_class_and_refuses_unknown_names():
    import expertmesh
    from expertmesh.router_service.mesh import ExpertMesh

    assert expertmesh.ExpertMesh is ExpertMesh
    with pytest.raises(AttributeError, match="no_such_name"):
        _ = expertmesh.no_such_name
