"""The documentation: generated pages match the code, and every relative link in README.md and docs/ resolves.

The strict MkDocs build in CI (.ci/run) checks docs/ too; these run without MkDocs, in the quick unit loop.
"""

from __future__ import annotations

import re
from pathlib import Path

from expertmesh.ops import docs_gen

REPO = Path(__file__).resolve().parents[2]
REGENERATE = "regenerate with `python -m expertmesh.ops.docs_gen` and commit the pages"
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)


def test_generated_pages_are_current():
    stale = [str(path.relative_to(REPO)) for path, text in docs_gen.render().items()
             if not path.exists() or path.read_text() != text]
    assert not stale, f"generated docs out of date: {stale}; {REGENERATE}"


def test_generated_pages_cover_every_flag_field_and_metric():
    from expertmesh.ops.commands.mesh_flags import FLAGS
    from expertmesh.router_service.metrics import METRIC_SPECS

    pages = docs_gen.render()
    cli = pages[docs_gen.DOCS / "reference/cli.md"]
    config = pages[docs_gen.DOCS / "reference/configuration.md"]
    metrics = pages[docs_gen.DOCS / "operations/metrics.md"]
    for flag in FLAGS:
        assert f"`{flag.flag}`" in cli and f"`{flag.path}`" in cli, flag
        assert f"`{flag.flag}`" in config, flag  # beside the field it sets
    for spec in METRIC_SPECS.values():
        assert all(f"`{name}`" in metrics for name in spec.prometheus_names), spec.name
    assert "ExpertmeshBreakerOpen" in metrics


def test_generated_pages_do_not_depend_on_the_environment(monkeypatch):
    monkeypatch.setenv("EXPERTMESH_TOKEN", "secret-token-from-env")
    monkeypatch.setenv("EXPERTMESH_ADMIN_TOKEN", "secret-admin-from-env")
    cli = docs_gen.cli_page()
    assert "secret-" not in cli
    monkeypatch.delenv("EXPERTMESH_TOKEN")
    monkeypatch.delenv("EXPERTMESH_ADMIN_TOKEN")
    assert docs_gen.cli_page() == cli


def _slug(heading: str) -> str:
    """MkDocs' (Python-Markdown toc) anchor of a heading; GitHub's agrees for the headings used here."""
    text = re.sub(r"[`*]", "", heading).strip().lower()
    text = re.sub(r"[^\w\s-]", "", text)
    return re.sub(r"[\s-]+", "-", text).strip("-")


def _anchors(path: Path) -> set[str]:
    text = _FENCE.sub("", path.read_text())
    return {_slug(m.group(1)) for m in re.finditer(r"^#+ (.*)$", text, re.MULTILINE)}


def _broken_links(page: Path) -> list[str]:
    broken = []
    for target in _LINK.findall(_FENCE.sub("", page.read_text())):
        if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (page.parent / file_part).resolve() if file_part else page
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(target)
    return broken


def test_every_relative_link_in_the_readme_and_docs_resolves():
    pages = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    broken = {str(p.relative_to(REPO)): b for p in pages if (b := _broken_links(p))}
    assert not broken, broken


def test_the_readme_keeps_its_first_screen_and_ci_runs_its_test_command():
    readme = (REPO / "README.md").read_text()
    first_screen = "\n".join(readme.splitlines()[:25])
    assert 'bash ops/setup.sh && bash ops/quickstart.sh "def parse(self, text):"' in first_screen
    assert "bash ops/setup.sh && bash ops/test.sh" in first_screen
    ci = (REPO / ".ci" / "run").read_text()
    assert "bash ops/setup.sh" in ci and "bash ops/test.sh" in ci
    runs = (REPO / "ops" / "test.sh").read_text()
    assert ".venv/bin/pytest tests/unit -n auto" in runs and ".venv/bin/pytest tests/integration tests/gpu" in runs
    # Between them, the two runs collect every test folder (a new one would be missed by both).
    assert {p.name for p in (REPO / "tests").iterdir() if p.is_dir() and p.name != "__pycache__"} == {
        "unit", "integration", "gpu"}
    assert "mkdocs build --strict" in ci


def test_results_are_data_not_code():
    results = REPO / "docs" / "benchmarks" / "results"
    assert results.is_dir()
    code = [p for p in results.rglob("*") if p.suffix in (".py", ".sh")]
    assert not code, code
    assert not (REPO / "ops" / "reports").exists()
