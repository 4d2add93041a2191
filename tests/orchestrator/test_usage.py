"""Usage records: opened at create, closed at delete or death, clipped to the asked period."""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest

from tests.orchestrator.conftest import FakeClock, Service
from tests.orchestrator.fakes import AgentProcessBackend
from tests.orchestrator.test_sandboxes import detail


def iso(moment: datetime) -> str:
    return moment.isoformat()


async def test_usage_is_recorded_and_clipped(
    service: Service, clock: FakeClock, backend: AgentProcessBackend
) -> None:
    start = clock.now
    await service.create(sandbox_id="u1", cpu="2", memory="1Gi", labels={"team": "rl"})
    clock.advance(100)
    await service.http.delete("/sandboxes/u1")
    await service.create(sandbox_id="u2")
    clock.advance(50)

    report = (await service.http.get("/usage", params={"since": iso(start)})).json()
    records = {r["sandbox_id"]: r for r in report["records"]}
    assert set(records) == {"u1", "u2"}
    u1 = records["u1"]
    assert (u1["cpu"], u1["memory_bytes"], u1["labels"]) == (2.0, 1024**3, {"team": "rl"})
    assert u1["image"] == "debian:12" and u1["ended_at"] is not None
    assert u1["seconds"] == pytest.approx(100, abs=0.1)
    assert records["u2"]["ended_at"] is None  # still running: counted up to now
    assert records["u2"]["seconds"] == pytest.approx(50, abs=0.1)

    clipped = await service.http.get(
        "/usage",
        params={
            "since": iso(start + timedelta(seconds=40)),
            "until": iso(start + timedelta(seconds=70)),
        },
    )
    assert [(r["sandbox_id"], r["seconds"]) for r in clipped.json()["records"]] == [("u1", 30.0)]

    # A container that dies closes its record too.
    await backend.kill("u2")
    await service.orchard.reaper.run_pass()
    clock.advance(1000)
    after = (await service.http.get("/usage", params={"since": iso(start)})).json()
    u2 = next(r for r in after["records"] if r["sandbox_id"] == "u2")
    assert u2["ended_at"] is not None and u2["seconds"] == pytest.approx(50, abs=0.1)


async def test_usage_is_per_key_for_non_admins(service: Service, clock: FakeClock) -> None:
    alice = service.as_key(await service.new_key("alice"))
    await service.create(sandbox_id="admins")
    created = await alice.post("/sandboxes", json={"image": "debian:12", "sandbox_id": "alices"})
    assert created.status_code == 201
    clock.advance(10)
    mine = (await alice.get("/usage")).json()["records"]
    assert [r["sandbox_id"] for r in mine] == ["alices"]
    everyone = (await service.http.get("/usage")).json()["records"]
    assert {r["sandbox_id"] for r in everyone} == {"admins", "alices"}


async def test_bad_periods_are_400(service: Service) -> None:
    response = await service.http.get(
        "/usage", params={"since": "2026-02-01T00:00:00Z", "until": "2026-01-01T00:00:00Z"}
    )
    assert response.status_code == 400
    assert detail(response)["message"] == (
        "since (2026-02-01T00:00:00+00:00) must be before until (2026-01-01T00:00:00+00:00)"
    )
    naive = await service.http.get("/usage", params={"since": "2026-01-01T00:00:00"})
    assert naive.status_code == 400
    assert detail(naive)["message"] == (
        "since and until need a timezone, e.g. 2026-01-01T00:00:00Z"
    )
