"""`status`, `down` and `up` act on the context they are given, never on another service.

Two real local orchestrators (each its own state dir, port and context) run side by side;
the CLI runs as a user runs it, in a subprocess, with --context or ORCHARD_CONTEXT.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchard_env import config, contexts
from provision.local import LocalProvider, _pid_alive
from tests.cli.conftest import run_orchard_text

pytestmark = pytest.mark.engine


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _start(name: str, root: Path, instance: str) -> LocalProvider:
    """A real orchestrator of its own state dir, recorded as context ``name``."""
    settings = config.service_settings(
        port=_free_port(), state_dir=root / name, instance=f"{instance}-{name}"
    )
    provider = LocalProvider(settings, context=name)
    provider.deploy(lambda _message: None)
    return provider


def _orchard(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return run_orchard_text(*args, env={**os.environ, **(env or {})})


def _pid(provider: LocalProvider) -> int:
    return int(provider.paths.pid_file.read_text())


@pytest.fixture
def services(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, engine_instance: str
) -> Iterator[dict[str, LocalProvider]]:
    monkeypatch.setenv("ORCHARD_CONFIG", str(tmp_path / "config.toml"))
    for name in ("ORCHARD_CONTEXT", "ORCHARD_URL", "ORCHARD_API_KEY", "ORCHARD_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("ORCHARD_STATE_DIR", raising=False)
    started = {name: _start(name, tmp_path, engine_instance) for name in ("mine", "other")}
    yield started
    for provider in started.values():
        provider.down(lambda _message: None)


def test_first_context_is_current_and_later_ones_are_not(
    services: dict[str, LocalProvider],
) -> None:
    data = contexts.load_config_file()
    assert data["current_context"] == "mine"
    assert set(data["contexts"]) == {"mine", "other"}


@pytest.mark.parametrize("how", ["flag", "env"])
def test_status_reports_the_context_it_is_given(
    services: dict[str, LocalProvider], how: str
) -> None:
    other = services["other"]
    args, env = (
        (["--context", "other"], None) if how == "flag" else ([], {"ORCHARD_CONTEXT": "other"})
    )
    done = _orchard("status", "--json", *args, env=env)
    assert done.returncode == 0, done.stderr
    shown = json.loads(done.stdout)
    assert shown["url"] == other.url
    assert shown["state_dir"] == str(other.paths.state_dir)
    assert shown["pid"] == str(_pid(other))
    assert shown["sandboxes"] == "0"  # answered with other's key by other's service


def test_down_stops_only_the_named_context_and_says_what_it_stops(
    services: dict[str, LocalProvider],
) -> None:
    mine, other = services["mine"], services["other"]
    mine_pid, other_pid = _pid(mine), _pid(other)
    done = _orchard("down", "--context", "other", "--yes")
    assert done.returncode == 0, done.stderr
    flat = " ".join(done.stderr.split())
    assert (
        f"stop the orchestrator at {other.url} (pid {other_pid}, state dir "
        f"{other.paths.state_dir}); delete 0 sandbox container(s)" in flat
    )
    assert "remove context 'other'" in flat
    assert _pid_alive(mine_pid)
    assert not _pid_alive(other_pid)
    data = contexts.load_config_file()
    assert set(data["contexts"]) == {"mine"} and data["current_context"] == "mine"


def test_down_never_stops_a_process_of_another_state_dir(
    services: dict[str, LocalProvider],
) -> None:
    """A pid file naming another service's orchestrator (copied, or a reused pid)."""
    mine, other = services["mine"], services["other"]
    other_pid = _pid(other)
    other.paths.pid_file.write_text(f"{_pid(mine)}\n")
    done = _orchard("down", "--context", "other", "--yes")
    assert done.returncode == 0, done.stderr
    assert "no orchestrator runs for state dir" in " ".join(done.stderr.split())
    assert _pid_alive(_pid(mine))
    os.kill(other_pid, signal.SIGTERM)


def test_flags_that_contradict_the_context_are_refused(
    services: dict[str, LocalProvider],
) -> None:
    mine, other = services["mine"], services["other"]
    done = _orchard("down", "--context", "other", "--state-dir", str(mine.paths.state_dir), "--yes")
    assert done.returncode == 125
    assert f"context 'other' is the service of state dir {other.paths.state_dir}" in done.stderr
    assert _pid_alive(_pid(mine)) and _pid_alive(_pid(other))
    port = _orchard("status", "--context", "other", "--port", str(mine.settings.port))
    assert port.returncode == 125
    assert f"context 'other' is the service at {other.url}" in port.stderr


def test_an_unknown_context_is_an_error_not_the_default_service(
    services: dict[str, LocalProvider],
) -> None:
    for args, env in ((["--context", "nope"], None), ([], {"ORCHARD_CONTEXT": "nope"})):
        done = _orchard("down", "--yes", *args, env=env)
        assert done.returncode == 125
        assert "context 'nope'" in done.stderr and "known: mine, other" in done.stderr
    assert all(_pid_alive(_pid(p)) for p in services.values())


def test_up_of_another_context_keeps_the_current_one_unless_asked(
    services: dict[str, LocalProvider],
) -> None:
    other = services["other"]
    summary = other.deploy(lambda _message: None).summary
    assert "context 'other' (not the current one)" in summary
    assert contexts.load_config_file()["current_context"] == "mine"
    other.make_current = True
    assert "context 'other' (the current one)" in other.deploy(lambda _message: None).summary
    assert contexts.load_config_file()["current_context"] == "other"
