"""API keys, authentication and per-key ownership."""

from __future__ import annotations

import asyncio
from pathlib import Path

from orchard_env.config import ServiceSettings
from orchard_env.orchestrator.keys import (
    KEY_RE,
    create_key,
    create_key_sync,
    hash_key,
    key_is_valid_sync,
)
from orchard_env.orchestrator.store import SQLiteStore
from tests.orchestrator.conftest import Service, StartService, eventually, make_settings
from tests.orchestrator.test_sandboxes import detail


async def test_missing_and_wrong_keys(service: Service) -> None:
    anonymous = service.as_key(None)
    response = await anonymous.get("/sandboxes")
    assert response.status_code == 401
    assert detail(response) == {
        "code": "unauthenticated",
        "message": "missing API key: send it in the X-API-Key header",
        "hint": "send the key in the X-API-Key header (SDK: api_key=, CLI: --api-key or a context)",
    }
    for wrong in ("not-a-key", "ork_0123456789_" + "x" * 43):
        response = await service.as_key(wrong).get("/sandboxes")
        assert response.status_code == 403
        assert detail(response) == {
            "code": "forbidden",
            "message": "the API key is not valid",
            "hint": "check the key, or ask an admin",
        }
    # Health and the banner need no key.
    assert (await anonymous.get("/health")).status_code == 200
    banner = (await anonymous.get("/")).json()
    assert banner["service"] == "orchard"


async def test_no_keys_configured_is_401_with_a_hint(start_service: StartService) -> None:
    service = await start_service()
    store = service.orchard.store
    assert service.admin is not None
    await service.http.delete(f"/keys/{service.admin.key_id}")  # revoke the only key
    assert await store.count_active_keys() == 0
    for client in (service.as_key(None), service.as_key("ork_0123456789_" + "x" * 43)):
        response = await client.get("/sandboxes")
        assert response.status_code == 401
        assert detail(response) == {
            "code": "unauthenticated",
            "message": "this service requires an API key and none exists yet",
            "hint": "on the service's machine, create one with "
            "`orchard keys create admin --admin --local`",
        }
    revoked = await service.as_key(service.admin).get("/sandboxes")
    assert revoked.status_code == 403
    assert detail(revoked)["message"] == f"the API key {service.admin.key_id} was revoked"


async def test_key_management_is_admin_only(service: Service) -> None:
    created = await service.http.post("/keys", json={"name": "alice"})
    assert created.status_code == 201
    alice = created.json()
    assert KEY_RE.match(alice["api_key"])
    assert alice["api_key"].startswith(f"ork_{alice['key_id']}_")
    assert alice["admin"] is False

    as_alice = service.as_key(alice["api_key"])
    for method, path in [("GET", "/keys"), ("POST", "/keys"), ("DELETE", "/keys/x")]:
        response = await as_alice.request(method, path, json={"name": "bob"})
        assert response.status_code == 403, (method, path)
        assert detail(response)["message"] == "this needs an admin key"

    listed = (await service.http.get("/keys")).json()
    assert {k["name"] for k in listed} == {"admin", "alice"}
    assert all("api_key" not in k for k in listed)

    revoked = await service.http.delete(f"/keys/{alice['key_id']}")
    assert revoked.status_code == 200 and revoked.json()["revoked_at"] is not None
    response = await as_alice.get("/sandboxes")
    assert response.status_code == 403
    assert detail(response)["message"] == f"the API key {alice['key_id']} was revoked"
    missing = await service.http.delete("/keys/0000000000")
    assert missing.status_code == 404 and detail(missing)["code"] == "key_not_found"
    bad_name = await service.http.post("/keys", json={"name": "no spaces"})
    assert bad_name.status_code == 400


async def test_keys_only_see_their_own_sandboxes_and_jobs(service: Service) -> None:
    alice = service.as_key(await service.new_key("alice"))
    bob = service.as_key(await service.new_key("bob"))
    response = await alice.post("/sandboxes", json={"image": "debian:12", "sandbox_id": "alices"})
    assert response.status_code == 201
    await alice.get("/sandboxes/alices/wait")
    job = (
        await alice.post("/sandboxes/alices/exec", json={"command": "true", "wait": True})
    ).json()

    for method, path in [
        ("GET", "/sandboxes/alices"),
        ("GET", "/sandboxes/alices/wait"),
        ("DELETE", "/sandboxes/alices"),
        ("POST", "/sandboxes/alices/heartbeat"),
        ("GET", "/sandboxes/alices/jobs"),
        ("GET", "/sandboxes/alices/files/list"),
    ]:
        response = await bob.request(method, path)
        assert response.status_code == 404, (method, path)
        assert detail(response)["code"] == "sandbox_not_found"
    exec_as_bob = await bob.post("/sandboxes/alices/exec", json={"command": "true"})
    assert exec_as_bob.status_code == 404
    for path in (f"/jobs/{job['job_id']}", f"/jobs/{job['job_id']}/wait"):
        response = await bob.get(path)
        assert response.status_code == 404 and detail(response)["code"] == "job_not_found"
    assert (await bob.post(f"/jobs/{job['job_id']}/cancel")).status_code == 404
    assert (await bob.get("/sandboxes")).json() == {"sandboxes": [], "continue": None}

    mine = (await alice.get("/sandboxes")).json()["sandboxes"]
    assert [s["sandbox_id"] for s in mine] == ["alices"]
    # The admin sees everyone's.
    everyone = (await service.http.get("/sandboxes")).json()["sandboxes"]
    assert [s["sandbox_id"] for s in everyone] == ["alices"]
    assert (await service.http.get(f"/jobs/{job['job_id']}")).status_code == 200


async def test_without_require_api_key_everything_is_open_and_unowned(
    start_service: StartService,
) -> None:
    service = await start_service(require_api_key=False)
    info = await service.create()
    assert info["owner"] is None
    assert (await service.http.get("/keys")).status_code == 200


def test_sync_helpers_for_the_cli(tmp_path: Path) -> None:
    settings: ServiceSettings = make_settings(tmp_path / "state")
    first = create_key_sync(settings, "admin", admin=True)
    assert first.admin
    assert key_is_valid_sync(settings, first.api_key, admin=True)
    user = create_key_sync(settings, "ci")
    assert key_is_valid_sync(settings, user.api_key)
    assert not key_is_valid_sync(settings, user.api_key, admin=True)
    assert not key_is_valid_sync(settings, user.api_key + "x")


async def test_only_the_hash_is_stored(tmp_path: Path) -> None:
    settings = make_settings(tmp_path / "state")
    store = SQLiteStore(settings.db_path)
    await store.open()
    try:
        created = await create_key(store, "hashed")
        record = await store.get_key(created.key_id)
    finally:
        await store.close()
    assert record is not None and record.sha256 == hash_key(created.api_key)
    assert created.api_key.encode() not in settings.db_path.read_bytes()


async def test_revoking_a_key_ends_its_waits_and_the_command_runs_on(service: Service) -> None:
    key = await service.new_key("alice")
    alice = service.as_key(key)
    created = await alice.post("/sandboxes", json={"image": "debian:12", "sandbox_id": "waits"})
    assert created.status_code == 201
    await alice.get("/sandboxes/waits/wait")
    long = {"command": "sleep 600", "job_id": "long", "wait": True}
    waiting_exec = asyncio.ensure_future(alice.post("/sandboxes/waits/exec", json=long))

    async def running() -> bool:
        job = await service.http.get("/jobs/long")
        return job.status_code == 200 and job.json()["status"] == "running"

    await eventually(running)
    waiting_job = asyncio.ensure_future(alice.get("/jobs/long/wait", params={"timeout": 600}))
    await asyncio.sleep(0.2)  # both requests are waiting now (a late one is refused anyway)
    assert not waiting_exec.done() and not waiting_job.done()

    assert (await service.http.delete(f"/keys/{key.key_id}")).status_code == 200
    for response in await asyncio.gather(waiting_exec, waiting_job):
        assert response.status_code == 403
        assert detail(response)["message"] == f"the API key {key.key_id} was revoked"
    assert (await service.http.get("/jobs/long")).json()["status"] == "running"
    cancelled = await service.http.post("/jobs/long/cancel")
    assert cancelled.json()["status"] == "failed"
