from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.orchestrator.backends.registry_fake import PASSWORD, USER, FakeRegistry


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
