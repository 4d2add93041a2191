"""Fixtures of the manifests tests: a fake Kubernetes API over real HTTP and its kubeconfig."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.manifests.kube_fake import FakeKube, start_fake


@pytest.fixture
def kube() -> Iterator[FakeKube]:
    running = start_fake()
    yield running.fake
    running.stop()


@pytest.fixture
def kubeconfig(kube: FakeKube, tmp_path: Path) -> Path:
    return kube.kubeconfig(tmp_path / "kubeconfig")
