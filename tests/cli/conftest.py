"""Fixtures of the CLI tests: `orchard …` run in-process against a live orchestrator on the
service-tier fake backend."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner, Result

from orchard_cli.main import app
from tests.orchestrator.conftest import make_settings
from tests.orchestrator.fakes import AgentProcessBackend
from tests.servers import fake_backend, live_service

runner = CliRunner()


@pytest.fixture
def backend() -> Iterator[AgentProcessBackend]:
    with fake_backend() as fake:
        yield fake


@pytest.fixture
def orchard(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, backend: AgentProcessBackend
) -> Iterator[Callable[..., Result]]:
    """Run `orchard …` against a live orchestrator (ORCHARD_URL/ORCHARD_API_KEY set)."""
    settings = make_settings(tmp_path / "state")
    with live_service(settings, key_name="cli", backend=backend, thread_name="uvicorn-cli") as live:
        monkeypatch.setenv("ORCHARD_CONFIG", str(tmp_path / "config.toml"))
        monkeypatch.setenv("ORCHARD_URL", live.url)
        monkeypatch.setenv("ORCHARD_API_KEY", live.api_key)

        def invoke(*args: str) -> Result:
            return runner.invoke(app, list(args))

        yield invoke


def ok(result: Result) -> str:
    assert result.exit_code == 0, (result.output, result.exception)
    return result.stdout
