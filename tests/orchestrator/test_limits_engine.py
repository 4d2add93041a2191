"""The bounded-input attacks against the service on real containers (engine tier): each was a
500 (or a sandbox the engine could not make) before; each is a 400 that names the field, and
the service keeps answering everyone."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import sqlite3
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import docker
import httpx
import pytest

from orchard_env.config import ServiceSettings, service_settings
from tests.quota_engine import quota_engine
from tests.servers import live_service

pytestmark = pytest.mark.engine


@pytest.fixture
def settings(
    tmp_path_factory: pytest.TempPathFactory, engine_instance: str, agent_bundle: Path
) -> ServiceSettings:
    return service_settings(
        state_dir=tmp_path_factory.mktemp("lim"),
        instance=f"{engine_instance}-limits",
        agent_bundle_dir=agent_bundle,
        max_body_bytes=1024**2,
    )


@contextlib.contextmanager
def serving(settings: ServiceSettings) -> Iterator[httpx.Client]:
    with (
        live_service(settings, key_name="limits") as (url, key),
        httpx.Client(base_url=url, headers={"X-API-Key": key}, timeout=120) as client,
    ):
        yield client


@pytest.fixture
def http(settings: ServiceSettings) -> Iterator[httpx.Client]:
    with serving(settings) as client:
        yield client


def refused(response: httpx.Response, *needles: str) -> None:
    assert response.status_code == 400, response.text
    message = response.json()["detail"]["message"]
    for needle in needles:
        assert needle in message, message


def raw_json(client: httpx.Client, path: str, body: str) -> httpx.Response:
    return client.post(path, content=body.encode(), headers={"content-type": "application/json"})


def test_bad_creates_are_400s_and_listing_survives(http: httpx.Client, busybox_image: str) -> None:
    bad: list[tuple[dict[str, Any], str]] = [
        ({"ttl_seconds": 10**12}, "ttl_seconds"),
        ({"idle_timeout_seconds": 10**12}, "idle_timeout_seconds"),
        ({"cpu": 1e-10}, "cpu"),
        ({"cpu": "1m"}, "cpu"),
        ({"memory": "1"}, "memory"),
        ({"memory": "1Ki"}, "memory"),
        ({"memory": 8192}, "8192Mi"),
        ({"image": "a" * 300}, "image"),
        ({"env": {"": "x"}}, "env name"),
        ({"env": {"A=B": "x"}}, "env name"),
        ({"env": {"A": "x\0"}}, "NUL"),
        ({"workdir": "/work\0space"}, "NUL"),
    ]
    for body, needle in bad:
        refused(http.post("/sandboxes", json={"image": busybox_image, **body}), needle)
    refused(raw_json(http, "/sandboxes", '{"image": "busybox", "env": {"A": "\\ud800"}}'), "env")
    listed = http.get("/sandboxes")
    assert listed.status_code == 200 and listed.json() == {"sandboxes": [], "continue": None}
    too_big = http.post("/sandboxes", json={"image": busybox_image, "env": {"A": "x" * 2**21}})
    assert too_big.status_code == 413, too_big.text


def test_file_and_exec_attacks_on_a_real_sandbox(
    http: httpx.Client, busybox_image: str, settings: ServiceSettings
) -> None:
    created = http.post("/sandboxes", json={"image": busybox_image, "ttl_seconds": 600})
    assert created.status_code == 201, created.text
    sandbox_id = created.json()["sandbox_id"]
    assert http.get(f"/sandboxes/{sandbox_id}/wait", params={"timeout": 60}).json()["ready"]
    base = f"/sandboxes/{sandbox_id}"

    upload = http.post(f"{base}/files", json={"path": "x", "content": "héllo"})
    refused(upload, "base64")
    refused(raw_json(http, f"{base}/files", '{"path": "\\ud800", "content": ""}'), "path")
    refused(raw_json(http, f"{base}/exec", '{"command": "echo \\ud800"}'), "command")
    # Only ever against a container: on the service-tier fake, whose agents are host processes
    # as root, a regression here would delete the host's files.
    for root in ("/", "//", "///", "/./", "/tmp/..", "//tmp/../"):
        deleted = http.delete(f"{base}/files", params={"path": root, "recursive": "true"})
        refused(deleted, "refusing to delete /")
    alive = http.post(f"{base}/exec", json={"command": "ls /bin/sh && echo ok", "wait": True})
    assert alive.json()["stdout"].endswith("ok\n"), alive.text

    # A poisoned record written straight into the store: listing still answers everyone.
    with sqlite3.connect(settings.db_path) as db:
        row = db.execute("SELECT record FROM sandboxes WHERE id = ?", (sandbox_id,)).fetchone()
        record = json.loads(row[0])
        record.update(sandbox_id="poisoned", ttl_seconds=10**12, idle_timeout_seconds=10**12)
        db.execute(
            "INSERT INTO sandboxes (id, owner, status, created_at, ended_at, record) "
            "SELECT 'poisoned', owner, status, created_at, NULL, ? FROM sandboxes WHERE id = ?",
            (json.dumps(record), sandbox_id),
        )
        db.execute(
            "INSERT INTO sandboxes (id, owner, status, created_at, ended_at, record) "
            "VALUES ('garbage', NULL, 'ready', '2026-01-01T00:00:00.000000Z', NULL, '{}')"
        )
    listed = http.get("/sandboxes")
    assert listed.status_code == 200, listed.text
    assert {s["sandbox_id"] for s in listed.json()["sandboxes"]} == {sandbox_id, "poisoned"}

    # A snapshot whose workdir is now a file: its restore is a 400 naming the workdir.
    replaced = http.post(
        f"{base}/exec",
        json={"command": "cd / && rm -rf /workspace && echo file > /workspace", "wait": True},
    )
    assert replaced.json()["exit_code"] == 0, replaced.text
    snapshot = http.post(f"{base}/snapshot")
    assert snapshot.status_code == 201, snapshot.text
    restored = http.post(f"/snapshots/{snapshot.json()['snapshot_id']}/restore")
    refused(restored, "workdir '/workspace' is not a directory")
    assert http.delete(f"/snapshots/{snapshot.json()['snapshot_id']}").status_code == 200
    assert http.delete(base).status_code == 200


def _engine_can_limit_disk(client: docker.DockerClient) -> tuple[bool, str]:
    info = client.info()
    status = {str(k): str(v) for k, v in info.get("DriverStatus") or []}
    driver, backing = str(info.get("Driver")), status.get("Backing Filesystem", "")
    capable = driver in ("btrfs", "zfs") or (driver.startswith("overlay") and backing == "xfs")
    return capable, f"storage driver {driver} on {backing or 'an unknown file system'}"


@pytest.fixture(params=["this machine's engine", "an engine on btrfs"])
def disk_service(
    request: pytest.FixtureRequest,
    settings: ServiceSettings,
    docker_client: docker.DockerClient,
    busybox_image: str,
) -> Iterator[tuple[httpx.Client, docker.DockerClient]]:
    """The service on this machine's engine (CI's storage cannot cap a disk), and on a
    second engine on btrfs with quotas (tests/quota_engine.py), which can."""
    if request.param == "an engine on btrfs":
        with quota_engine(docker_client, busybox_image) as url:
            engine = docker.DockerClient(base_url=url, timeout=120)
            with serving(replace(settings, docker_host=url)) as client:
                yield client, engine
            engine.close()
    else:
        with serving(settings) as client:
            yield client, docker_client


def test_a_sandbox_cannot_fill_the_disk(
    disk_service: tuple[httpx.Client, docker.DockerClient],
    busybox_image: str,
    request: pytest.FixtureRequest,
) -> None:
    http, engine = disk_service
    capable, storage = _engine_can_limit_disk(engine)
    created = http.post(
        "/sandboxes", json={"image": busybox_image, "disk": "100Mi", "ttl_seconds": 600}
    )
    if not capable:  # overlay on ext4: refused, never ignored
        assert "btrfs" not in request.node.name, storage  # the btrfs engine must enforce it
        refused(
            created,
            f"disk cannot be limited on this engine: its {storage} cannot cap a container's "
            "disk, and Orchard refuses a limit it cannot enforce",
        )
        return
    assert created.status_code == 201, created.text
    sandbox_id = created.json()["sandbox_id"]
    assert http.get(f"/sandboxes/{sandbox_id}/wait", params={"timeout": 60}).json()["ready"]
    base = f"/sandboxes/{sandbox_id}"

    def run(command: str) -> dict[str, Any]:
        body = {"command": command, "wait": True, "timeout_seconds": 120}
        done = http.post(f"{base}/exec", json=body)
        assert done.status_code == 200, done.text
        return dict(done.json())

    host_free = shutil.disk_usage("/").free
    # 1 GiB, into the image's tree and into /tmp: both are the container's own layer.
    flood = run("dd if=/dev/zero of=/big bs=1M count=1024; dd if=/dev/zero of=/tmp/big bs=1M")
    assert flood["exit_code"] != 0, flood
    assert re.search("Disk quota exceeded|No space left on device", flood["stderr"]), flood
    written = run("du -sk /big /tmp/big | cut -f1")["stdout"].split()
    # 100 MiB, and the margin a btrfs limit gets for the image's metadata (busybox: 2 MiB).
    assert 90 * 1024 < sum(int(kib) for kib in written) < 104 * 1024, written
    # The host's disk did not take the gigabyte (other work on the machine may move it a
    # little either way).
    assert host_free - shutil.disk_usage("/").free < 512 * 1024**2
    # The sandbox and its agent still work, and space freed is space again.
    again = run("rm -f /big /tmp/big && dd if=/dev/zero of=/small bs=1M count=50 && echo ok")
    assert again["exit_code"] == 0 and again["stdout"] == "ok\n", again
    assert http.get(base).json()["status"] == "ready"
    assert http.delete(base).status_code == 200
