from __future__ import annotations

import base64
import json
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from orchard_env.snapshotter.server import SnapshotterServer, SnapshotterSettings
from tests.orchestrator.backends.registry_fake import PASSWORD, USER, FakeRegistry

TOKEN = "snapshotter-token"


@pytest.fixture
def registry() -> Iterator[FakeRegistry]:
    server = FakeRegistry().start()
    yield server
    server.stop()


@pytest.fixture
def docker_config(tmp_path: Path, registry: FakeRegistry) -> Path:
    """A docker config JSON with the fake registry's credentials."""
    path = tmp_path / "config.json"
    auth = base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
    path.write_text(json.dumps({"auths": {registry.host: {"auth": auth}}}))
    return path


@pytest.fixture
def snapshotter(
    registry: FakeRegistry, docker_config: Path, tmp_path: Path
) -> Iterator[SnapshotterServer]:
    """The snapshotter's HTTP server on 127.0.0.1, token ``TOKEN``, pushing to the fake
    registry under ``<registry>/orchard/snapshots:``."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    settings = SnapshotterSettings.from_env(
        {
            "ORCHARD_SNAPSHOTTER_TOKEN_FILE": str(token_file),
            "ORCHARD_SNAPSHOTTER_TARGET_PREFIX": f"{registry.host}/orchard/snapshots:",
            "ORCHARD_REGISTRY_CONFIG": str(docker_config),
            "ORCHARD_SNAPSHOTTER_PLAIN_HTTP": f" {registry.host} ,",
            "ORCHARD_SNAPSHOTTER_PORT": "0",
        }
    )
    server = SnapshotterServer(replace(settings, host="127.0.0.1"))
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join()


def snapshotter_url(server: SnapshotterServer) -> str:
    host, port = server.server_address[:2]
    return f"http://{host}:{port}"
