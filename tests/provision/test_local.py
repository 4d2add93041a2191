"""The local provider without an engine: port checks, pid files, status."""

from __future__ import annotations

import re
import socket
from pathlib import Path

import pytest

from orchard_env.config import service_settings
from orchard_env.errors import OrchardError
from provision.local import LocalProvider


@pytest.fixture(autouse=True)
def config_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORCHARD_CONFIG", str(tmp_path / "config.toml"))


def test_deploy_refuses_a_port_another_program_holds(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        provider = LocalProvider(service_settings(port=port, state_dir=tmp_path / "state"))
        with pytest.raises(OrchardError) as info:
            provider.deploy(lambda _message: None)
    assert info.value.message.startswith(f"port {port} on 127.0.0.1 is taken")
    # The port suggested is one that was free, with this service's own state dir.
    hint = info.value.hint or ""
    match = re.search(r"`orchard up --port (\d+) --state-dir (\S+)`", hint)
    assert match is not None, hint
    assert int(match.group(1)) != port and match.group(2) == str(tmp_path / "state")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", int(match.group(1))))
    assert not provider.paths.pid_file.exists()


def test_status_ignores_a_stale_pid_file(tmp_path: Path) -> None:
    provider = LocalProvider(service_settings(state_dir=tmp_path))
    provider.paths.pid_file.write_text("999999999\n")
    state = provider.status()
    assert not state.running
    assert state.detail["state_dir"] == str(tmp_path)
