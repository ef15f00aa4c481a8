"""Every Python package folder is in pyproject.toml's package list: a sub-package missing there still imports from
the editable install of a checkout, but is absent from a built wheel (and so from a cluster node that pip-installs
the project)."""

from __future__ import annotations

from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python ≥ 3.11

ROOT = Path(__file__).resolve().parents[2]


def test_every_package_folder_is_listed_and_every_listed_one_exists():
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    roots = {folder: name for name, folder in tool["package-dir"].items()}
    found = set()
    for folder, name in roots.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            relative = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join((name, *relative)))
    assert found == set(tool["packages"])
