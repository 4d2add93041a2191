"""Fixtures of the cost tests: HTTP fakes on loopback, and no user cache or config."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cost.fakes import NODES, FakeKubeApi, serving


@pytest.fixture(autouse=True)
def _isolated_dirs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Keep the price cache and the Orchard config of the machine out of every test."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("ORCHARD_CONFIG", str(tmp_path / "config.toml"))
    monkeypatch.delenv("ORCHARD_RETAIL_PRICES_URL", raising=False)


@pytest.fixture
def kube_api() -> Iterator[FakeKubeApi]:
    server = FakeKubeApi(NODES)
    with serving(server):
        yield server
