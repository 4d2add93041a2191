"""find_engine: which socket it picks, in which order, and what it says when none answers;
and what the backend says when its engine stops answering.

The engines here are tiny HTTP servers on real unix sockets in a temporary directory that
answer the ping (GET /_ping) and hang up on every other request.
"""

from __future__ import annotations

import socket
import socketserver
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest

from orchard_env import errors
from orchard_env.config import service_settings
from orchard_env.errors import EngineNotFound
from orchard_env.orchestrator.backends import docker_engine
from orchard_env.orchestrator.backends.docker_engine import DockerEngineBackend, find_engine


class _FakeEngine(BaseHTTPRequestHandler):
    """Answers the ping; hangs up on anything else, like an engine that just died."""

    def do_GET(self) -> None:
        if not self.path.endswith("/_ping"):
            return
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"OK")

    def log_message(self, format: str, *args: object) -> None:
        pass


class _UnixHTTPServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True

    def get_request(self) -> tuple[socket.socket, tuple[str, int]]:
        conn, _ = super().get_request()
        return conn, ("local", 0)  # BaseHTTPRequestHandler wants a (host, port) address


@pytest.fixture
def engine_at(tmp_path: Path) -> Iterator[Callable[[str], str]]:
    """Start a fake engine on ``tmp_path/<name>``; returns its unix:// URL."""
    servers: list[_UnixHTTPServer] = []

    def start(name: str) -> str:
        server = _UnixHTTPServer(str(tmp_path / name), _FakeEngine)
        threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True).start()
        servers.append(server)
        return f"unix://{tmp_path / name}"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


@pytest.fixture
def defaults(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path, Path]:
    """Point the well-known sockets and $XDG_RUNTIME_DIR into tmp_path; no DOCKER_HOST."""
    podman, docker_sock = tmp_path / "podman.sock", tmp_path / "docker.sock"
    monkeypatch.setattr(docker_engine, "WELL_KNOWN_SOCKETS", (str(podman), str(docker_sock)))
    monkeypatch.delenv("DOCKER_HOST", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "xdg"))
    (tmp_path / "xdg" / "podman").mkdir(parents=True)
    return podman, docker_sock, tmp_path / "xdg" / "podman" / "podman.sock"


def test_the_podman_socket_comes_first(
    defaults: tuple[Path, Path, Path], engine_at: Callable[[str], str]
) -> None:
    podman = engine_at("podman.sock")
    engine_at("docker.sock")
    assert find_engine(None) == podman


def test_falls_back_to_docker_then_the_user_podman_socket(
    defaults: tuple[Path, Path, Path], engine_at: Callable[[str], str]
) -> None:
    user_podman = engine_at("xdg/podman/podman.sock")
    assert find_engine(None) == user_podman
    docker_sock = engine_at("docker.sock")
    assert find_engine(None) == docker_sock


def test_docker_host_is_used_alone(
    defaults: tuple[Path, Path, Path],
    engine_at: Callable[[str], str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    engine_at("podman.sock")
    explicit = engine_at("elsewhere.sock")
    monkeypatch.setenv("DOCKER_HOST", explicit)
    assert find_engine(None) == explicit
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/gone.sock")
    with pytest.raises(EngineNotFound) as caught:
        find_engine(None)
    assert caught.value.message == (
        f"no container engine answers at unix://{tmp_path}/gone.sock "
        "(no such socket, from DOCKER_HOST)"
    )


def test_the_setting_beats_docker_host(
    defaults: tuple[Path, Path, Path],
    engine_at: Callable[[str], str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("DOCKER_HOST", engine_at("from-env.sock"))
    setting = engine_at("from-setting.sock")
    assert find_engine(setting) == setting


def test_nothing_answers_names_every_path_and_how_to_fix_it(
    defaults: tuple[Path, Path, Path],
) -> None:
    podman, docker_sock, user_podman = defaults
    # A socket file nobody listens on (a dead service) is tried and reported too.
    dead = socket.socket(socket.AF_UNIX)
    dead.bind(str(docker_sock))
    dead.close()
    with pytest.raises(EngineNotFound) as caught:
        find_engine(None, timeout=1)
    message = caught.value.message
    assert message.startswith(f"no container engine answers at unix://{podman} (no such socket); ")
    assert f"unix://{docker_sock} (" in message
    assert "Connection refused" in message
    assert message.endswith(f"; unix://{user_podman} (no such socket)")
    assert caught.value.hint is not None
    assert "podman system service --time=0 unix:///run/podman/podman.sock" in caught.value.hint


async def test_an_engine_that_stops_answering_makes_the_backend_unavailable(
    engine_at: Callable[[str], str], tmp_path: Path
) -> None:
    url = engine_at("dying.sock")
    settings = service_settings(state_dir=tmp_path / "state", docker_host=url, instance="unit")
    backend = DockerEngineBackend(settings, bundle_dir=tmp_path)
    try:
        with pytest.raises(errors.BackendUnavailable) as caught:
            await backend.list()
    finally:
        await backend.close()
    assert caught.value.message.startswith(f"the container engine at {url} did not answer: ")
    assert caught.value.hint is not None and "podman system service" in caught.value.hint
