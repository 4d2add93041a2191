"""The tables in the docs that restate the code match it, and the `orchard` command lines in
the docs name real commands and options."""

from __future__ import annotations

import importlib
import pkgutil
import re

import pytest
from fastapi import APIRouter
from fastapi.routing import APIRoute, APIWebSocketRoute

from orchard_env import errors
from orchard_env.config import SERVICE_SETTINGS
from orchard_env.orchestrator import api
from tests.docs import clitree
from tests.docs.markdown import DOCS, ROOT, blocks, markdown_files, prose

API = DOCS / "api.md"
DEPLOYMENT = DOCS / "deployment.md"
GENERATED = {DOCS / "cli.md"}


def _table_rows(text: str) -> list[list[str]]:
    rows = []
    for line in text.splitlines():
        if line.startswith("|") and not re.match(r"^\|[-| :]+\|$", line):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def _code(cell: str) -> str | None:
    match = re.fullmatch(r"`([^`]*)`", cell)
    return match.group(1) if match else None


def test_the_error_table_matches_errors_py() -> None:
    classes = {
        cls
        for cls in vars(errors).values()
        if isinstance(cls, type) and issubclass(cls, errors.OrchardError)
    }
    expected = {(cls.code, str(cls.http_status), cls.__name__) for cls in classes}
    documented = {
        (_code(row[0]), row[1], _code(row[2]))
        for row in _table_rows(API.read_text())
        if len(row) == 4 and _code(row[0]) and _code(row[2]) and row[1].isdigit()
    }
    assert documented == expected, (
        f"missing from docs/api.md: {sorted(map(str, expected - documented))}; "
        f"not in errors.py: {sorted(map(str, documented - expected))}"
    )


def test_the_settings_table_matches_config_py() -> None:
    rows = {_code(row[0]): row for row in _table_rows(DEPLOYMENT.read_text()) if len(row) == 4}
    problems = []
    for setting in SERVICE_SETTINGS:
        row = rows.get(setting.key)
        if row is None:
            problems.append(f"{setting.key}: no row")
            continue
        if _code(row[1]) != setting.env:
            problems.append(f"{setting.key}: variable {row[1]}, expected `{setting.env}`")
        default = "(none)" if setting.default is None else f"`{setting.default}`"
        if row[2] != default:
            problems.append(f"{setting.key}: default {row[2]}, expected {default}")
    documented = {key for key in rows if key is not None and key.islower() and "_" in key}
    unknown = documented - {s.key for s in SERVICE_SETTINGS} - {"setting"}
    assert not problems and not unknown, "\n".join([*problems, f"unknown: {sorted(unknown)}"])


def _routes() -> list[str]:
    """Every route the API modules declare, as `METHOD /path` (`WS` for WebSockets)."""
    routes = []
    for info in pkgutil.iter_modules(api.__path__):
        router = importlib.import_module(f"{api.__name__}.{info.name}").__dict__.get("router")
        if not isinstance(router, APIRouter):
            continue
        for route in router.routes:
            if isinstance(route, APIWebSocketRoute):
                routes.append(f"WS {route.path}")
            elif isinstance(route, APIRoute):
                routes += [f"{method} {route.path}" for method in sorted(route.methods or ())]
    return routes


def test_every_route_is_documented() -> None:
    routes = _routes()
    text = API.read_text()
    missing = [route for route in routes if f"`{route}`" not in text]
    assert len(routes) > 25
    assert not missing, f"docs/api.md does not mention: {missing}"


def _command_lines() -> list[tuple[str, str]]:
    found = []
    for path in markdown_files():
        if path in GENERATED:
            continue
        for block in blocks(path):
            if block.lang not in ("bash", "sh", "console", "shell"):
                continue
            pending = ""
            for offset, raw in enumerate(block.code.splitlines(), start=1):
                line = pending + raw.strip().removeprefix("$ ")
                if line.endswith("\\"):
                    pending = line[:-1] + " "
                    continue
                pending = ""
                words = line.split()
                if words and words[0].rsplit("/", 1)[-1] == "orchard":
                    found.append((f"{block.location}+{offset}", line))
        for number, text in prose(path, code_spans=True):
            for span in re.findall(r"`(orchard [^`]+)`", text):
                found.append((f"{path.relative_to(ROOT)}:{number}", span))
    return found


@pytest.mark.parametrize(("where", "line"), _command_lines(), ids=lambda v: str(v))
def test_command_lines_name_real_commands(where: str, line: str) -> None:
    problem = clitree.check_command_line(clitree.tree(), line)
    assert problem is None, f"{where}: {line!r}: {problem}"
