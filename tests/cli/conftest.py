"""A live orchestrator (the service-tier fake backend) for the CLI's tests, driven in-process
(:func:`orchard`) or as a user runs it, in a subprocess (:func:`orchard_process`)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import pytest
from typer.testing import CliRunner, Result

from orchard_cli.main import app
from tests.orchestrator.conftest import make_settings
from tests.orchestrator.fakes import AgentProcessBackend
from tests.servers import Live, fake_backend, live_service

runner = CliRunner()


@pytest.fixture
def backend() -> Iterator[AgentProcessBackend]:
    with fake_backend() as fake:
        yield fake


@pytest.fixture
def live(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, backend: AgentProcessBackend
) -> Iterator[Live]:
    """A live orchestrator; ORCHARD_URL/ORCHARD_API_KEY point at it."""
    settings = make_settings(tmp_path / "state")
    with live_service(settings, key_name="cli", backend=backend, thread_name="uvicorn-cli") as up:
        monkeypatch.setenv("ORCHARD_CONFIG", str(tmp_path / "config.toml"))
        monkeypatch.setenv("ORCHARD_URL", up.url)
        monkeypatch.setenv("ORCHARD_API_KEY", up.api_key)
        monkeypatch.delenv("ORCHARD_CONTEXT", raising=False)
        yield up


@pytest.fixture
def orchard(live: Live) -> Callable[..., Result]:
    """Run `orchard …` in-process (CliRunner) against the live orchestrator."""

    def invoke(*args: str) -> Result:
        return runner.invoke(app, list(args))

    return invoke


def run_orchard(
    *args: str, stdin: bytes | None = None, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[bytes]:
    """The real entry point (its error boundary and exit codes) in a subprocess; ``env``
    replaces this process's environment."""
    return subprocess.run(
        [sys.executable, "-c", "from orchard_cli.main import main; main()", *args],
        capture_output=True,
        input=stdin,
        timeout=120,
        check=False,
        env=dict(os.environ if env is None else env),
    )


def run_orchard_text(
    *args: str, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """:func:`run_orchard`, its output decoded."""
    done = run_orchard(*args, env=env)
    return subprocess.CompletedProcess(
        done.args, done.returncode, done.stdout.decode(), done.stderr.decode()
    )


def ok(result: Result) -> str:
    """The stdout of an in-process run that succeeded."""
    assert result.exit_code == 0, (result.output, result.exception)
    return result.stdout
