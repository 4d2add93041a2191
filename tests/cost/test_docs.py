"""docs/cost.md embeds real output: each ``cost-example`` block must match what the command
prints today. Regenerate the blocks with ``python -m tests.cost.test_docs``."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from orchard_cli.cost import app as cost_app

DOC = Path(__file__).resolve().parents[2] / "docs" / "cost.md"
BLOCK = re.compile(
    r"(<!-- cost-example: (?P<command>orchard cost [^\n]*?) -->\n)"
    r"(?P<body>.*?)"
    r"(<!-- cost-example: end -->)",
    re.DOTALL,
)


def _output(command: str) -> str:
    root = typer.Typer()
    root.add_typer(cost_app, name="cost")

    @root.callback()
    def _root() -> None:
        """Mount point."""

    args = shlex.split(command)[1:]  # drop "orchard"
    env = {"XDG_CACHE_HOME": "/nonexistent-orchard-docs-cache", "COLUMNS": "200"}
    result = CliRunner().invoke(root, args, env=env)
    assert result.exit_code == 0, (command, result.output, result.exception)
    return result.stdout


def _blocks() -> list[re.Match[str]]:
    return list(BLOCK.finditer(DOC.read_text()))


def test_the_doc_has_examples() -> None:
    assert _blocks(), f"no cost-example blocks in {DOC}"


@pytest.mark.parametrize("block", _blocks(), ids=lambda m: m.group("command"))
def test_example_output_is_current(block: re.Match[str]) -> None:
    assert "--shipped" in block.group("command"), "examples must not depend on a price cache"
    assert block.group("body") == _output(block.group("command"))


PYTHON_BLOCK = re.compile(r"```python\n(?P<code>.*?)```", re.DOTALL)


def test_python_examples_run(capsys: pytest.CaptureFixture[str]) -> None:
    blocks = [m.group("code") for m in PYTHON_BLOCK.finditer(DOC.read_text())]
    assert blocks
    for code in blocks:
        exec(compile(code, str(DOC), "exec"), {})
    assert capsys.readouterr().out.startswith("Standard_D32as_v5 3134.87 790.13\n")


def regenerate() -> None:
    text = DOC.read_text()
    text = BLOCK.sub(lambda m: m.group(1) + _output(m.group("command")) + m.group(4), text)
    DOC.write_text(text)


if __name__ == "__main__":
    regenerate()
