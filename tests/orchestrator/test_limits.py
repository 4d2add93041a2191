"""Bounded inputs: every out-of-range or malformed field is a 400 naming it (never a 500), and
a bad record in the store cannot break listing or the reaper for everyone else."""

from __future__ import annotations

import base64
import json
import logging
import os
import sqlite3
from collections.abc import AsyncIterator
from typing import Any

import pytest

from orchard_env.orchestrator.records import SandboxRecord
from orchard_env.protocol import MAX_TTL_SECONDS
from tests.orchestrator.conftest import FakeClock, Service, StartService
from tests.orchestrator.fakes import AgentProcessBackend


async def post_raw(service: Service, path: str, body: str) -> Any:
    """POST a JSON text as is (httpx's json= cannot send a lone surrogate escape)."""
    return await service.http.post(
        path, content=body.encode(), headers={"content-type": "application/json"}
    )


def assert_invalid(response: Any, *needles: str) -> None:
    assert response.status_code == 400, response.text
    detail = response.json()["detail"]
    assert detail["code"] == "invalid_request"
    for needle in needles:
        assert needle in detail["message"], detail["message"]


@pytest.mark.parametrize(
    ("body", "needles"),
    [
        ({"ttl_seconds": 10**12}, ["ttl_seconds", str(MAX_TTL_SECONDS)]),
        ({"idle_timeout_seconds": 10**12}, ["idle_timeout_seconds", str(MAX_TTL_SECONDS)]),
        ({"timeout": 10**9}, ["timeout", "86400"]),
        ({"cpu": 1e-10}, ["cpu", "below the minimum of 0.01"]),
        ({"cpu": "1m"}, ["cpu", "minimum", "did you mean 1 (1000m)"]),
        ({"cpu": "0.5m"}, ["cpu", "minimum", "did you mean 0.5 (500m)"]),
        ({"memory": "1"}, ["memory", "below the minimum of 32Mi"]),
        ({"memory": "1Ki"}, ["memory", "1024 bytes", "32Mi"]),
        ({"memory": 8192}, ["memory", "without a unit is bytes", "8192Mi"]),
        ({"disk": "1Ki"}, ["disk", "32Mi"]),
        ({"image": "a" * 300}, ["image", "255"]),
        ({"env": {"": "x"}}, ["env name ''"]),
        ({"env": {"A=B": "x"}}, ["env name 'A=B'", "'='"]),
        ({"env": {"A": "x\0y"}}, ["env 'A'", "NUL"]),
        ({"workdir": "/work\0space"}, ["workdir", "NUL"]),
        ({"labels": {f"k{i}": "v" for i in range(65)}}, ["labels", "64"]),
    ],
)
async def test_create_rejects_out_of_range_fields(
    service: Service, body: dict[str, Any], needles: list[str]
) -> None:
    response = await service.http.post("/sandboxes", json={"image": "debian:12", **body})
    assert_invalid(response, *needles)
    assert (await service.http.get("/sandboxes")).json() == {"sandboxes": [], "continue": None}


async def test_memory_keeps_kubernetes_quantities(service: Service) -> None:
    info = await service.create(memory="8G", cpu="250m")
    record = await service.orchard.store.get_sandbox(info["sandbox_id"])
    assert record is not None
    assert (record.memory_bytes, record.cpu) == (8 * 10**9, 0.25)


async def test_lone_surrogates_and_nul_are_400s(service: Service) -> None:
    sandbox_id = (await service.create())["sandbox_id"]
    base = f"/sandboxes/{sandbox_id}"
    cases = [
        ("/sandboxes", '{"image": "debian:12", "labels": {"a\\ud800": "b"}}', "labels"),
        (f"{base}/exec", '{"command": "echo \\ud800"}', "command"),
        (f"{base}/exec", '{"command": ["echo", "\\udfff"]}', "command"),
        (f"{base}/exec", '{"command": "true", "env": {"X": "\\ud800"}}', "env"),
        (f"{base}/exec", '{"command": ["printf", "a\\u0000b"]}', "NUL"),
        (f"{base}/exec", '{"command": "true", "cwd": "/tmp\\u0000"}', "cwd"),
        (f"{base}/files", '{"path": "/tmp/\\ud800", "content": ""}', "path"),
        (f"{base}/files/mkdir", '{"path": "/tmp/\\ud800"}', "path"),
        (f"{base}/snapshot", '{"name": "\\ud800"}', "name"),
    ]
    for path, body, needle in cases:
        assert_invalid(await post_raw(service, path, body), needle)
    assert (await service.http.get("/sandboxes")).status_code == 200


async def test_file_routes_reject_bad_content_and_paths(service: Service) -> None:
    sandbox_id = (await service.create())["sandbox_id"]
    base = f"/sandboxes/{sandbox_id}"
    upload = await service.http.post(f"{base}/files", json={"path": "a", "content": "héllo=="})
    assert_invalid(upload, "content is not valid base64")
    nul = await service.http.get(f"{base}/files", params={"path": "/etc/\0passwd"})
    assert nul.status_code == 400, nul.text
    long = await service.http.get(f"{base}/files", params={"path": "/" + "a" * 5000})
    assert_invalid(long, "path")


async def test_exec_snapshot_and_restore_bounds(service: Service) -> None:
    sandbox_id = (await service.create())["sandbox_id"]
    base = f"/sandboxes/{sandbox_id}"
    cases = [
        (f"{base}/exec", {"command": "true", "timeout_seconds": 10**12}, "timeout_seconds"),
        (f"{base}/exec", {"command": "true", "max_output_bytes": 2**40}, "max_output_bytes"),
        (f"{base}/snapshot", {"ttl_seconds": 10**12}, "ttl_seconds"),
        (f"{base}/fork", {"count": 65}, "count"),
        ("/snapshots/x/restore", {"ttl_seconds": 10**12}, "ttl_seconds"),
        ("/snapshots/x/restore", {"env": {"": "x"}}, "env name"),
    ]
    for path, body, needle in cases:
        assert_invalid(await service.http.post(path, json=body), needle)


async def test_the_model_call_cursor_is_bounded(service: Service) -> None:
    sandbox_id = (await service.create())["sandbox_id"]
    calls = f"/sandboxes/{sandbox_id}/model-calls"
    past = await service.http.get(calls, params={"after": 2**63})  # SQLite's integers end here
    assert_invalid(past, "after")
    last = await service.http.get(calls, params={"after": 2**63 - 1})
    assert last.status_code == 200, last.text
    assert last.json()["calls"] == []


def poisoned_records(clock: FakeClock) -> list[tuple[str, str]]:
    """(id, stored JSON) of records no API call could write: an absurd TTL, timestamps without
    a timezone, and a row that is not a sandbox record at all."""
    now = clock()
    huge = SandboxRecord(
        sandbox_id="huge-ttl",
        image="debian:12",
        cpu=1,
        memory_bytes=2**30,
        created_at=now,
        ready_timeout_seconds=10**12,
        ttl_seconds=10**12,
        idle_timeout_seconds=10**12,
        last_activity_at=now,
    ).model_dump_json()
    naive = json.loads(huge.replace("huge-ttl", "naive-time"))
    naive["created_at"] = naive["last_activity_at"] = "2025-12-31T00:00:00"
    naive["ttl_seconds"] = 5
    return [("huge-ttl", huge), ("naive-time", json.dumps(naive)), ("garbage", '{"cpu": "x"}')]


def write_rows(service: Service, rows: list[tuple[str, str]], status: str) -> None:
    with sqlite3.connect(service.orchard.settings.db_path) as db:
        for sandbox_id, record in rows:
            db.execute(
                "INSERT INTO sandboxes (id, owner, status, created_at, ended_at, record) "
                "VALUES (?, NULL, ?, '2026-01-01T00:00:00.000000Z', NULL, ?)",
                (sandbox_id, status, record),
            )


async def test_poisoned_records_break_neither_listing_nor_the_reaper(
    service: Service, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    await service.create(sandbox_id="short-lived", ttl_seconds=20)
    write_rows(service, poisoned_records(clock), "ready")
    listed = await service.http.get("/sandboxes")
    assert listed.status_code == 200, listed.text
    ids = {info["sandbox_id"] for info in listed.json()["sandboxes"]}
    assert {"short-lived", "huge-ttl"} <= ids
    assert "garbage" not in ids
    assert (await service.http.get("/sandboxes/huge-ttl")).status_code == 200

    # Expiry on its own (reconciliation would fail the container-less records first): the
    # record that cannot be compared with the clock is logged, the others still expire.
    clock.advance(21)
    with caplog.at_level(logging.ERROR):
        await service.orchard.sandboxes.expire(clock())
    assert "expiring a sandbox failed; carrying on with the rest" in caplog.text
    gone = (
        await service.http.get("/sandboxes/short-lived", params={"include_deleted": "true"})
    ).json()
    assert gone["status"] == "deleted"
    assert "ttl_seconds" in gone["status_message"]

    await service.orchard.reaper.run_pass()
    listed = await service.http.get("/sandboxes", params={"include_deleted": "true"})
    assert listed.status_code == 200, listed.text
    statuses = {info["sandbox_id"]: info["status"] for info in listed.json()["sandboxes"]}
    assert statuses["huge-ttl"] == "failed"  # reconciled: it has no container
    assert statuses["short-lived"] == "deleted"


async def test_json_bodies_are_capped_raw_uploads_are_not(start_service: StartService) -> None:
    service = await start_service(max_body_bytes=4096)
    sandbox_id = (await service.create())["sandbox_id"]
    base = f"/sandboxes/{sandbox_id}"
    content = base64.b64encode(os.urandom(6000)).decode()
    sized = await service.http.post(f"{base}/files", json={"path": "big", "content": content})
    assert sized.status_code == 413, sized.text
    detail = sized.json()["detail"]
    assert detail["code"] == "payload_too_large"
    assert "4096 bytes" in detail["message"]
    assert "files/raw" in detail["hint"]

    async def chunked() -> AsyncIterator[bytes]:  # no Content-Length: counted as it comes
        yield b'{"path": "big", "content": "'
        for _ in range(10):
            yield b"A" * 1000
        yield b'"}'

    streamed = await service.http.post(
        f"{base}/files", content=chunked(), headers={"content-type": "application/json"}
    )
    assert streamed.status_code == 413, streamed.text
    assert streamed.json()["detail"]["code"] == "payload_too_large"

    raw = await service.http.put(
        f"{base}/files/raw", params={"path": "big"}, content=os.urandom(10**5)
    )
    assert raw.status_code == 200, raw.text
    assert raw.json()["size"] == 10**5


@pytest.mark.parametrize("size", [0, 1, 2, 3, 65537, 300_001])
async def test_base64_download_is_streamed_and_exact(
    start_service: StartService, size: int
) -> None:
    service = await start_service(max_body_bytes=4096)  # the answer may be larger than a body
    sandbox_id = (await service.create())["sandbox_id"]
    data = os.urandom(size)
    await service.http.put(f"/sandboxes/{sandbox_id}/files/raw", params={"path": "f"}, content=data)
    response = await service.http.get(f"/sandboxes/{sandbox_id}/files", params={"path": "f"})
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert body == {"path": "f", "content": base64.b64encode(data).decode(), "size": size}
    missing = await service.http.get(f"/sandboxes/{sandbox_id}/files", params={"path": "nope"})
    assert missing.status_code == 404


async def test_disk_is_passed_to_the_backend_capped_and_kept_by_restore(
    service: Service, backend: AgentProcessBackend
) -> None:
    info = await service.create(sandbox_id="disky", disk="1Gi")
    assert info["disk"] == "1Gi"
    assert backend.sandboxes["disky"].spec.disk_bytes == 1024**3
    over = await service.http.post("/sandboxes", json={"image": "debian:12", "disk": "11Gi"})
    assert over.status_code == 422, over.text
    assert "ORCHARD_EPHEMERAL_STORAGE" in over.json()["detail"]["hint"]
    snapshot = (await service.http.post("/sandboxes/disky/snapshot")).json()
    restored = await service.http.post(f"/snapshots/{snapshot['snapshot_id']}/restore")
    assert restored.status_code == 201, restored.text
    assert restored.json()["disk"] == "1Gi"
    assert (await service.http.get("/sandboxes")).status_code == 200
