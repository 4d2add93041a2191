"""Quotas over the wire: per-key limits on live sandboxes, CPU and memory (the key's own, set at
creation, or the service's per-key defaults), the service-wide cap, and fork's count."""

from __future__ import annotations

from typing import Any

import httpx

from tests.orchestrator.conftest import Service, StartService
from tests.orchestrator.test_sandboxes import detail

HINT = (
    "delete sandboxes no longer needed, or ask an admin for a key with a larger quota "
    "(`orchard keys create --max-sandboxes/--max-cpu/--max-memory`)"
)


async def key(service: Service, **quota: Any) -> tuple[str, httpx.AsyncClient]:
    created = await service.http.post("/keys", json={"name": "tenant", **quota})
    assert created.status_code == 201, created.text
    info = created.json()
    return info["key_id"], service.as_key(info["api_key"])


async def create(client: httpx.AsyncClient, **body: Any) -> httpx.Response:
    return await client.post("/sandboxes", json={"image": "debian:12", **body})


async def test_a_keys_own_limits_say_which_one_was_hit(service: Service) -> None:
    key_id, tenant = await key(service, max_sandboxes=2, max_cpu=1.5, max_memory="1Gi")
    shown = [k for k in (await service.http.get("/keys")).json() if k["key_id"] == key_id]
    assert (shown[0]["max_sandboxes"], shown[0]["max_cpu"], shown[0]["max_memory"]) == (
        2,
        1.5,
        "1Gi",
    )
    assert (await create(tenant, cpu=1, memory="512Mi", sandbox_id="a")).status_code == 201
    cpu = await create(tenant, cpu=1, memory="256Mi")
    assert cpu.status_code == 429
    assert detail(cpu) == {
        "code": "quota_exceeded",
        "message": f"key {key_id} may use at most 1.5 CPU cores (max_cpu); its sandboxes use 1 "
        "and 1 more were asked for",
        "hint": HINT,
    }
    memory = await create(tenant, cpu=0.5, memory="768Mi")
    assert memory.status_code == 429
    assert detail(memory)["message"] == (
        f"key {key_id} may use at most 1Gi of memory (max_memory); its sandboxes use 512Mi "
        "and 768Mi more were asked for"
    )
    assert (await create(tenant, cpu=0.5, memory="512Mi", sandbox_id="b")).status_code == 201
    count = await create(tenant, cpu=0.1, memory="32Mi")
    assert count.status_code == 429
    assert detail(count)["message"] == (
        f"key {key_id} may have at most 2 live sandboxes (max_sandboxes) and has 2; "
        "1 more do not fit"
    )
    # What is deleted no longer counts.
    await tenant.delete("/sandboxes/b")
    assert (await create(tenant, cpu=0.5, memory="512Mi")).status_code == 201


async def test_the_services_per_key_defaults_and_its_cap(start_service: StartService) -> None:
    service = await start_service(key_max_sandboxes=1, max_sandboxes=3)
    _, tenant = await key(service)
    assert (await create(tenant)).status_code == 201
    second = await create(tenant)
    assert second.status_code == 429 and "at most 1 live sandboxes" in detail(second)["message"]
    # Admin keys have no per-key limits; the service's cap holds for every key.
    assert (await create(service.http)).status_code == 201
    assert (await create(service.http)).status_code == 201
    full = await create(service.http)
    assert full.status_code == 429
    assert detail(full) == {
        "code": "quota_exceeded",
        "message": "this service runs at most 3 live sandboxes (max_sandboxes) and 3 are live; "
        "1 more do not fit",
        "hint": "delete sandboxes no longer needed, or raise ORCHARD_MAX_SANDBOXES",
    }


async def test_fork_must_fit_the_quota_as_a_whole(service: Service) -> None:
    key_id, tenant = await key(service, max_sandboxes=3)
    assert (await create(tenant, sandbox_id="src")).status_code == 201
    await tenant.get("/sandboxes/src/wait", params={"timeout": 30})
    refused = await tenant.post("/sandboxes/src/fork", json={"count": 3})
    assert refused.status_code == 429
    assert detail(refused)["message"] == (
        f"key {key_id} may have at most 3 live sandboxes (max_sandboxes) and has 1; "
        "3 more do not fit"
    )
    assert (await tenant.get("/snapshots")).json()["snapshots"] == []  # nothing was taken
    forked = await tenant.post("/sandboxes/src/fork", json={"count": 2})
    assert forked.status_code == 201, forked.text
    assert len(forked.json()["sandboxes"]) == 2


async def test_a_bad_quota_is_a_400_naming_the_field(service: Service) -> None:
    for body, field in (({"max_memory": "lots"}, "max_memory"), ({"max_cpu": 0}, "max_cpu")):
        response = await service.http.post("/keys", json={"name": "x", **body})
        assert response.status_code == 400, response.text
        assert field in detail(response)["message"]
