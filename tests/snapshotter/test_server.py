"""The snapshotter's HTTP API: token, request checks, error shape, settings."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from orchard_env import errors
from orchard_env.snapshotter.server import SnapshotterServer, SnapshotterSettings
from tests.orchestrator.backends.registry_fake import FakeRegistry
from tests.snapshotter.conftest import TOKEN, snapshotter_url

AUTH = {"Authorization": f"Bearer {TOKEN}"}


def test_health_needs_no_token(snapshotter: SnapshotterServer) -> None:
    response = httpx.get(f"{snapshotter_url(snapshotter)}/healthz")
    assert (response.status_code, response.json()) == (200, {"ok": True})
    missing = httpx.get(f"{snapshotter_url(snapshotter)}/nope")
    assert missing.json()["detail"]["code"] == "not_found"


def test_snapshot_needs_the_token(snapshotter: SnapshotterServer) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        response = httpx.post(f"{snapshotter_url(snapshotter)}/snapshot", json={}, headers=headers)
        assert response.status_code == 401
        assert response.json()["detail"]["code"] == "unauthenticated"


@pytest.mark.parametrize(
    ("body", "status", "code", "message"),
    [
        ({"container_id": "x"}, 400, "invalid_request", "container_id, base_image and target"),
        ([1, 2], 400, "invalid_request", "container_id, base_image and target"),
        (
            {"container_id": 1, "base_image": "a:1", "target": "b:1"},
            400,
            "invalid_request",
            "must be strings",
        ),
        (
            {"container_id": "0" * 64, "base_image": "r.io/a:1", "target": "evil.io/x:1"},
            403,
            "forbidden",
            "outside",
        ),
        (
            {"container_id": "0" * 64, "base_image": "r.io/a:1", "target": "{prefix}s1"},
            404,
            "not_found",
            "no process of container 000000000000",
        ),
    ],
)
def test_snapshot_request_errors(
    snapshotter: SnapshotterServer,
    registry: FakeRegistry,
    body: object,
    status: int,
    code: str,
    message: str,
) -> None:
    if isinstance(body, dict) and body.get("target") == "{prefix}s1":
        body["target"] = f"{snapshotter.settings.target_prefix}s1"
    response = httpx.post(f"{snapshotter_url(snapshotter)}/snapshot", json=body, headers=AUTH)
    assert response.status_code == status
    detail = response.json()["detail"]
    assert detail["code"] == code
    assert message in detail["message"]


def test_settings_from_env(tmp_path: Path) -> None:
    with pytest.raises(errors.ConfigError, match="ORCHARD_SNAPSHOTTER_TOKEN_FILE"):
        SnapshotterSettings.from_env({"ORCHARD_SNAPSHOTTER_TARGET_PREFIX": "r.io/s:"})
    base = {
        "ORCHARD_SNAPSHOTTER_TOKEN_FILE": str(tmp_path / "missing"),
        "ORCHARD_SNAPSHOTTER_TARGET_PREFIX": "r.io/s:",
    }
    with pytest.raises(errors.ConfigError, match="cannot read the snapshotter token"):
        SnapshotterSettings.from_env(base)
    (tmp_path / "missing").write_text("\n")
    with pytest.raises(errors.ConfigError, match="is empty"):
        SnapshotterSettings.from_env(base)
    (tmp_path / "missing").write_text("t0k\n")
    with pytest.raises(errors.ConfigError, match="must be a port number"):
        SnapshotterSettings.from_env({**base, "ORCHARD_SNAPSHOTTER_PORT": "x"})
    settings = SnapshotterSettings.from_env(base)
    assert (settings.token, settings.port, settings.credentials) == ("t0k", 9091, {})
