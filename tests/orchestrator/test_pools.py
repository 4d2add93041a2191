"""Warm pools in the service tier (real agents as host processes behind the fake backend):
filling, claiming, refilling, expiry, resize, removal, restarts, and who may see what."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from orchard_env.orchestrator import pools
from orchard_env.orchestrator.keys import create_key
from orchard_env.protocol import KeyQuota
from tests.orchestrator.conftest import FakeClock, Service, StartService, eventually
from tests.orchestrator.fakes import MISSING_IMAGE, AgentProcessBackend
from tests.orchestrator.test_sandboxes import detail

POOL = {"name": "small", "image": "debian:12", "cpu": "0.5", "memory": "256Mi"}
MATCHING = {"image": "debian:12", "cpu": 0.5, "memory": "256Mi"}


async def make_pool(service: Service, size: int, **body: Any) -> dict[str, Any]:
    response = await service.http.post("/pools", json={**POOL, "size": size, **body})
    assert response.status_code == 201, response.text
    await wait_ready(service, body.get("name", POOL["name"]), size)
    pool: dict[str, Any] = (await service.http.get(f"/pools/{response.json()['name']}")).json()
    return pool


async def wait_ready(service: Service, name: str, ready: int) -> None:
    async def full() -> bool:
        info = (await service.http.get(f"/pools/{name}")).json()
        return bool(info["ready"] == ready and info["starting"] == 0)

    await eventually(full, 60)


async def members(service: Service, name: str = "small") -> set[str]:
    records = await service.orchard.store.list_sandboxes(pooled=name)
    return {record.sandbox_id for record in records if record.live}


async def test_a_matching_create_takes_a_ready_sandbox_and_the_pool_refills(
    service: Service, backend: AgentProcessBackend, clock: FakeClock
) -> None:
    pool = await make_pool(service, 2)
    assert (pool["cpu"], pool["memory"], pool["ready"], pool["error"]) == ("0.5", "256Mi", 2, None)
    waiting = await members(service)
    assert len(waiting) == 2 and waiting <= set(backend.sandboxes)
    # Waiting sandboxes are nobody's: not listed, not even an admin may reach them.
    assert (await service.http.get("/sandboxes")).json()["sandboxes"] == []
    some = next(iter(waiting))
    assert (await service.http.get(f"/sandboxes/{some}")).status_code == 404
    ran = await service.http.post(f"/sandboxes/{some}/exec", json={"command": "true"})
    assert ran.status_code == 404

    alice = service.as_key(await service.new_key("alice"))
    claimed_at = clock.now
    created = await alice.post(
        "/sandboxes", json={**MATCHING, "labels": {"team": "rl"}, "ttl_seconds": 600}
    )
    assert created.status_code == 201, created.text
    info = created.json()
    assert info["sandbox_id"] in waiting
    assert info["status"] == "ready" and info["labels"] == {"team": "rl"}
    assert service.admin is not None and info["owner"] not in (None, service.admin.key_id)
    assert info["created_at"] >= claimed_at.timestamp()  # its life starts at the claim
    job = await alice.post(
        f"/sandboxes/{info['sandbox_id']}/exec", json={"command": "echo hi", "wait": True}
    )
    assert job.json()["stdout"] == "hi\n"
    listed = (await alice.get("/sandboxes")).json()["sandboxes"]
    assert [s["sandbox_id"] for s in listed] == [info["sandbox_id"]]

    await wait_ready(service, "small", 2)  # refilled in the background
    assert info["sandbox_id"] not in await members(service)


async def test_waiting_is_not_billed_and_usage_starts_at_the_claim(
    service: Service, clock: FakeClock
) -> None:
    start = clock.now
    await make_pool(service, 1)
    clock.advance(500)
    claimed = (await service.http.post("/sandboxes", json=MATCHING)).json()
    clock.advance(30)
    report = (await service.http.get("/usage", params={"since": start.isoformat()})).json()
    [record] = report["records"]
    assert record["sandbox_id"] == claimed["sandbox_id"]
    assert 29.9 < record["seconds"] < 30.1


async def test_each_pooled_sandbox_is_handed_out_once(
    service: Service, backend: AgentProcessBackend
) -> None:
    await make_pool(service, 3)
    waiting = await members(service)
    answers = await asyncio.gather(
        *(service.http.post("/sandboxes", json=MATCHING) for _ in range(6))
    )
    ids = [answer.json()["sandbox_id"] for answer in answers]
    assert all(answer.status_code == 201 for answer in answers)
    assert len(set(ids)) == 6  # three from the pool, three made cold
    assert len(set(ids) & waiting) == 3
    tokens = {backend.sandboxes[i].spec.agent_token for i in ids}
    assert len(tokens) == 6  # every sandbox its own agent credential


async def test_creates_that_differ_from_the_pool_are_made_cold(service: Service) -> None:
    await make_pool(service, 1)
    waiting = await members(service)
    for body in (
        {**MATCHING, "env": {"A": "1"}},
        {**MATCHING, "block_network": False},
        {**MATCHING, "memory": "512Mi"},
        {**MATCHING, "workdir": "/srv"},
        {**MATCHING, "sandbox_id": "named"},
    ):
        created = await service.http.post("/sandboxes", json=body)
        assert created.status_code == 201
        assert created.json()["sandbox_id"] not in waiting, body
    assert await members(service) == waiting


async def test_expired_pooled_sandboxes_are_replaced(
    service: Service, clock: FakeClock, backend: AgentProcessBackend
) -> None:
    await make_pool(service, 2, ttl_seconds=300)
    before = await members(service)
    clock.advance(301)
    await service.orchard.reaper.run_pass()
    await wait_ready(service, "small", 2)
    after = await members(service)
    assert not before & after
    assert not before & set(backend.sandboxes)
    # A claimed sandbox lives by its own lifetime, counted from the claim.
    claimed = (await service.http.post("/sandboxes", json={**MATCHING, "ttl_seconds": 1000})).json()
    clock.advance(301)
    await service.orchard.reaper.run_pass()
    assert (await service.http.get(f"/sandboxes/{claimed['sandbox_id']}")).json()["ready"]


async def test_resize_and_remove(service: Service, backend: AgentProcessBackend) -> None:
    await make_pool(service, 3)
    claimed = (await service.http.post("/sandboxes", json=MATCHING)).json()["sandbox_id"]
    shrunk = await service.http.patch("/pools/small", json={"size": 1})
    assert shrunk.json()["size"] == 1
    await wait_ready(service, "small", 1)
    grown = await service.http.patch("/pools/small", json={"size": 2})
    assert grown.status_code == 200
    await wait_ready(service, "small", 2)
    waiting = await members(service)
    [listed] = (await service.http.get("/pools")).json()["pools"]
    assert (listed["name"], listed["size"], listed["ready"]) == ("small", 2, 2)

    removed = await service.http.delete("/pools/small")
    assert removed.status_code == 200
    assert await members(service) == set()
    assert not waiting & set(backend.sandboxes)
    assert claimed in backend.sandboxes  # the claimed one is its owner's, not the pool's
    assert (await service.http.get("/pools/small")).status_code == 404
    after = await service.http.post("/sandboxes", json=MATCHING)
    assert after.json()["status"] == "pending"  # made cold: no pool serves it any more


async def test_pools_survive_a_restart(
    start_service: StartService, backend: AgentProcessBackend
) -> None:
    first = await start_service()
    await make_pool(first, 2)
    waiting = await members(first)
    await first.stop()
    second = await start_service()
    assert await members(second) == waiting  # the same sandboxes, not new ones
    await wait_ready(second, "small", 2)
    claimed = (await second.http.post("/sandboxes", json=MATCHING)).json()
    assert claimed["sandbox_id"] in waiting and claimed["status"] == "ready"
    await wait_ready(second, "small", 2)
    assert len(backend.sandboxes) == 3  # none leaked


async def test_pooled_sandboxes_adopted_without_their_record_are_never_handed_out(
    start_service: StartService, backend: AgentProcessBackend
) -> None:
    first = await start_service()
    await make_pool(first, 1)
    [waiting] = await members(first)
    await first.stop()
    # The state is lost: the container is adopted from its annotation, outside any pool.
    first.orchard.settings.db_path.unlink()
    second = await start_service()
    adopted = await second.orchard.store.get_sandbox(waiting)
    assert adopted is not None and adopted.pool is None and adopted.owner is None
    assert adopted.status_message is not None and "not handed out again" in adopted.status_message
    assert (await second.http.get("/pools")).json()["pools"] == []
    assert waiting in backend.sandboxes  # never deleted either


async def test_only_admins_manage_pools_and_bad_input_names_the_field(service: Service) -> None:
    bob = service.as_key(await service.new_key("bob"))
    assert (await bob.post("/pools", json={**POOL, "size": 1})).status_code == 403
    assert (await bob.get("/pools")).status_code == 403
    bad = await service.http.post("/pools", json={**POOL, "name": "Not_A_Label", "size": 1})
    assert (
        bad.status_code == 400
        and "pool name 'Not_A_Label' is not a DNS label" in detail(bad)["message"]
    )
    too_big = await service.http.post("/pools", json={**POOL, "size": 501})
    assert too_big.status_code == 400 and "size" in detail(too_big)["message"]
    capped = await service.http.post("/pools", json={**POOL, "size": 1, "cpu": "64"})
    assert capped.status_code == 422 and "above this service's cap" in detail(capped)["message"]
    await make_pool(service, 0)
    again = await service.http.post("/pools", json={**POOL, "size": 1})
    assert again.status_code == 409 and "already exists" in detail(again)["message"]
    same_spec = await service.http.post("/pools", json={**POOL, "name": "other", "size": 1})
    assert (
        same_spec.status_code == 409
        and "pool small already serves this spec" in detail(same_spec)["message"]
    )
    missing = await service.http.patch("/pools/nope", json={"size": 1})
    assert missing.status_code == 404 and "pool nope does not exist" in detail(missing)["message"]


async def test_a_pool_whose_sandboxes_cannot_start_says_why(
    service: Service, backend: AgentProcessBackend
) -> None:
    response = await service.http.post("/pools", json={**POOL, "image": MISSING_IMAGE, "size": 1})
    assert response.status_code == 201

    async def failed() -> bool:
        info = (await service.http.get("/pools/small")).json()
        return info["error"] is not None

    await eventually(failed)
    info = (await service.http.get("/pools/small")).json()
    assert info["error"].startswith("could not start a sandbox: image ")
    assert (info["ready"], info["starting"]) == (0, 0)


async def test_a_claim_counts_against_the_callers_quota(service: Service) -> None:
    await make_pool(service, 2)
    key = await create_key(service.orchard.store, "carol", quota=KeyQuota(max_sandboxes=1))
    carol = service.as_key(key)
    assert (await carol.post("/sandboxes", json=MATCHING)).json()["status"] == "ready"
    refused = await carol.post("/sandboxes", json=MATCHING)
    assert refused.status_code == 429
    assert "may have at most 1 live sandboxes" in detail(refused)["message"]
    assert len(await members(service)) >= 1  # the refused create took nothing from the pool


async def test_waiting_sandboxes_count_toward_the_service_cap_and_a_claim_needs_no_room(
    start_service: StartService,
) -> None:
    service = await start_service(max_sandboxes=2)
    await make_pool(service, 2)
    cold = await service.http.post("/sandboxes", json={**MATCHING, "sandbox_id": "cold"})
    assert cold.status_code == 429
    assert "at most 2 live sandboxes (max_sandboxes) and 2 are live" in detail(cold)["message"]
    claimed = await service.http.post("/sandboxes", json=MATCHING)
    assert claimed.status_code == 201 and claimed.json()["status"] == "ready"

    async def refill_refused() -> bool:
        await service.orchard.pools.wake_all()
        info = (await service.http.get("/pools/small")).json()
        return info["error"] is not None

    await eventually(refill_refused)  # the cap holds the pool at 1, and it says why
    info = (await service.http.get("/pools/small")).json()
    assert "max_sandboxes" in info["error"] and info["ready"] == 1


async def test_a_crash_mid_fill_loses_no_record_and_leaks_no_container(
    start_service: StartService, backend: AgentProcessBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_create = backend.create
    started = asyncio.Event()

    async def create_then_hang(spec: Any) -> Any:
        await real_create(spec)  # the container exists; its answer never comes back
        started.set()
        await asyncio.Event().wait()

    monkeypatch.setattr(backend, "create", create_then_hang)
    monkeypatch.setattr(pools, "CLOSE_WAIT_SECONDS", 0.1)
    first = await start_service()
    made = await first.http.post("/pools", json={**POOL, "size": 2})
    assert made.status_code == 201
    await asyncio.wait_for(started.wait(), 30)
    await first.stop()  # the fill is cut off mid-create, as by a crash
    made_before = set(backend.sandboxes)
    assert made_before

    monkeypatch.setattr(backend, "create", real_create)
    second = await start_service()
    await wait_ready(second, "small", 2)
    assert made_before <= await members(second)  # their records kept: the same, now ready
    assert set(backend.sandboxes) == await members(second)  # none leaked
