"""Fixtures of the provisioning tests: no user config, kubeconfig, cache or Azure login."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import responses

from tests.provision.arm_fake import FakeArm


@pytest.fixture(autouse=True)
def _isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORCHARD_CONFIG", str(tmp_path / "config.toml"))
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "kube" / "config"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    for name in ("AZURE_SUBSCRIPTION_ID", "AZURE_CLIENT_ID", "AZURE_TENANT_ID"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def arm() -> Iterator[FakeArm]:
    """The fake Resource Manager, intercepting every request to management.azure.com."""
    fake = FakeArm()
    with responses.RequestsMock(assert_all_requests_are_fired=False) as mock:
        fake.install(mock)
        yield fake
