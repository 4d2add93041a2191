"""docs/cli.md and docs/openapi.json are generated (scripts/gen-docs) and must be current."""

from __future__ import annotations

import difflib
import importlib.machinery
import importlib.util
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

from tests.docs import clitree
from tests.docs.markdown import ROOT

SCRIPT = ROOT / "scripts" / "gen-docs"


def _load_script() -> ModuleType:
    loader = importlib.machinery.SourceFileLoader("orchard_gen_docs", str(SCRIPT))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


GEN_DOCS = _load_script()


@pytest.mark.parametrize(
    ("path", "render"),
    [(GEN_DOCS.CLI_DOC, GEN_DOCS.cli_reference), (GEN_DOCS.OPENAPI_DOC, GEN_DOCS.openapi_schema)],
    ids=["cli.md", "openapi.json"],
)
def test_generated_doc_is_current(path: Path, render: Callable[[], str]) -> None:
    current = render()
    written = path.read_text() if path.is_file() else ""
    if written != current:
        diff = "".join(
            difflib.unified_diff(
                written.splitlines(keepends=True),
                current.splitlines(keepends=True),
                "written",
                "generated now",
                n=1,
            )
        )
        pytest.fail(
            f"{path.relative_to(ROOT)} is stale: run scripts/gen-docs\n{diff[:4000]}",
            pytrace=False,
        )


def test_the_cli_reference_has_a_section_per_command() -> None:
    text = GEN_DOCS.CLI_DOC.read_text()
    missing = [path for path in clitree.leaves(clitree.tree()) if f"## `{path}`" not in text]
    assert not missing, f"docs/cli.md has no section for: {missing}"
