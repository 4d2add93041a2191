"""A live orchestrator on the fake backend (real agents as host processes) for the
benchmarks' tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.orchestrator.conftest import make_settings
from tests.orchestrator.fakes import AgentProcessBackend
from tests.servers import Live, fake_backend, live_service


@pytest.fixture
def live(tmp_path: Path) -> Iterator[Live]:
    backend: AgentProcessBackend
    with (
        fake_backend() as backend,
        live_service(
            make_settings(tmp_path / "state"), key_name="bench", backend=backend
        ) as running,
    ):
        yield running
