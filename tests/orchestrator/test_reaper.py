"""The reaper pass, driven with a hand-moved clock: TTL, idle expiry, heartbeats, purges."""

from __future__ import annotations

from tests.orchestrator.conftest import FakeClock, Service
from tests.orchestrator.fakes import AgentProcessBackend
from tests.orchestrator.test_jobs import UNTIL_GO, release


async def status(service: Service, sandbox_id: str) -> tuple[str, str | None]:
    shown = await service.http.get(f"/sandboxes/{sandbox_id}", params={"include_deleted": "true"})
    info = shown.json()
    return info["status"], info["status_message"]


async def test_ttl_removes_a_sandbox_however_busy(
    service: Service, clock: FakeClock, backend: AgentProcessBackend
) -> None:
    await service.create(sandbox_id="short-lived", ttl_seconds=100)
    reaper = service.orchard.reaper
    clock.advance(50)
    await service.http.post("/sandboxes/short-lived/heartbeat")
    await reaper.run_pass()
    assert await status(service, "short-lived") == ("ready", "")
    clock.advance(51)
    await reaper.run_pass()
    assert await status(service, "short-lived") == (
        "deleted",
        "expired: its lifetime of 100 s (ttl_seconds) ran out",
    )
    assert "short-lived" not in backend.sandboxes


async def test_idle_expiry_and_heartbeats(service: Service, clock: FakeClock) -> None:
    await service.create(sandbox_id="idler", idle_timeout_seconds=60)
    reaper = service.orchard.reaper
    clock.advance(59)
    await reaper.run_pass()
    assert (await status(service, "idler"))[0] == "ready"
    await service.http.post("/sandboxes/idler/heartbeat")  # activity now: 59 s after start
    clock.advance(59)
    await reaper.run_pass()
    assert (await status(service, "idler"))[0] == "ready"
    clock.advance(2)
    await reaper.run_pass()
    assert await status(service, "idler") == (
        "deleted",
        "expired: idle for 60 s (idle_timeout_seconds); heartbeats keep it alive",
    )


async def test_exec_is_activity_and_a_running_command_keeps_it_alive(
    service: Service, clock: FakeClock
) -> None:
    await service.create(sandbox_id="worker", idle_timeout_seconds=60)
    reaper = service.orchard.reaper
    clock.advance(50)
    await service.exec("worker", "true")
    clock.advance(50)  # 100 s since creation, 50 s since the exec
    await reaper.run_pass()
    assert (await status(service, "worker"))[0] == "ready"

    job = (await service.http.post("/sandboxes/worker/exec", json={"command": UNTIL_GO})).json()
    clock.advance(3600)
    await reaper.run_pass()
    assert (await status(service, "worker"))[0] == "ready"  # busy, not idle
    await release(service, "worker")
    await service.http.get(f"/jobs/{job['job_id']}/wait", params={"timeout": 10})
    clock.advance(59)  # the idle clock restarted when the command finished
    await reaper.run_pass()
    assert (await status(service, "worker"))[0] == "ready"
    clock.advance(2)
    await reaper.run_pass()
    assert (await status(service, "worker"))[0] == "deleted"


async def test_zero_disables_ttl_and_idle_expiry(start_service: object, clock: FakeClock) -> None:
    service: Service = await start_service(  # type: ignore[operator]
        sandbox_ttl_seconds=0, idle_timeout_seconds=0
    )
    info = await service.create(sandbox_id="forever")
    assert info["expires_at"] is None and info["idle_timeout_seconds"] is None
    clock.advance(10 * 365 * 86400)
    await service.orchard.reaper.run_pass()
    assert (await status(service, "forever"))[0] == "ready"


async def test_old_jobs_and_ended_sandboxes_are_purged(service: Service, clock: FakeClock) -> None:
    await service.create(sandbox_id="keep", idle_timeout_seconds=10**6, ttl_seconds=10**6)
    await service.create(sandbox_id="drop")
    job = await service.exec("keep", "echo old")
    await service.http.delete("/sandboxes/drop")
    retention = service.orchard.settings.job_retention_seconds
    clock.advance(retention - 10)
    await service.orchard.reaper.run_pass()
    assert (await service.http.get(f"/jobs/{job['job_id']}")).status_code == 200
    dropped = await service.http.get("/sandboxes/drop", params={"include_deleted": "true"})
    assert dropped.status_code == 200
    clock.advance(20)
    await service.orchard.reaper.run_pass()
    assert (await service.http.get(f"/jobs/{job['job_id']}")).status_code == 404
    assert (await service.http.get("/sandboxes/drop")).status_code == 404
    assert (await status(service, "keep"))[0] == "ready"
