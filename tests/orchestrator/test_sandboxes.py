"""Sandbox lifecycle over the wire: create, show, list, wait, delete, heartbeat, errors."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from orchard_env.orchestrator.sandboxes import pids_for
from tests.orchestrator.conftest import Service, StartService
from tests.orchestrator.fakes import CRASH_IMAGE, HANG_IMAGE, MISSING_IMAGE, AgentProcessBackend


def detail(response: httpx.Response) -> dict[str, Any]:
    body: dict[str, Any] = response.json()["detail"]
    return body


async def test_create_returns_upstream_fields_and_becomes_ready(
    service: Service, backend: AgentProcessBackend
) -> None:
    response = await service.http.post(
        "/sandboxes", json={"image": "debian:12", "sandbox_id": "box-1", "labels": {"team": "rl"}}
    )
    assert response.status_code == 201
    created = response.json()
    assert created["sandbox_id"] == "box-1"
    assert created["status"] in ("pending", "ready")
    for field in ("namespace", "image", "pod_name", "block_network", "cpu", "memory", "created_at"):
        assert field in created
    assert created["cpu"] == "1"
    assert created["memory"] == "2Gi"
    assert created["block_network"] is True
    assert (created["timeout"], created["status_message"]) == (20, "")  # the readiness timeout
    assert created["labels"] == {"team": "rl"}
    assert created["owner"] == service.admin.key_id if service.admin else None
    assert "box-1" in backend.sandboxes

    ready = await service.http.get("/sandboxes/box-1/wait", params={"timeout": 30})
    assert ready.status_code == 200
    info = ready.json()
    assert info["status"] == "ready" and info["ready"] is True
    # No idle expiry before a first heartbeat (upstream's clients never send one): the
    # lifetime cap (7200 s) alone; times are epoch seconds.
    assert info["idle_timeout_seconds"] is None
    assert info["expires_at"] == pytest.approx(info["created_at"] + 7200)
    assert (await service.http.get("/sandboxes/box-1")).json()["status"] == "ready"


async def test_generated_ids_are_dns_labels(service: Service) -> None:
    info = await service.create()
    assert info["sandbox_id"].startswith("sb-")
    assert len(info["sandbox_id"]) == 15


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            {"image": "Bad Image!"},
            "image: image 'Bad Image!' is not a valid image reference "
            "(expected [registry/]name[:tag][@sha256:digest], lowercase name)",
        ),
        (
            {"image": "debian:12", "sandbox_id": "Bad_ID"},
            "sandbox_id: sandbox id 'Bad_ID' is not a DNS label: use 1-63 lowercase letters, "
            "digits and '-', starting and ending with a letter or digit",
        ),
        (
            {"image": "debian:12", "cpu": "lots"},
            "cpu: cpu 'lots' is not a quantity (examples: 2, 0.5, 500m)",
        ),
        (
            {"image": "debian:12", "memory": "8 gigs"},
            "memory: memory '8 gigs' is not a quantity (examples: 512Mi, 8Gi, 1G)",
        ),
        ({"image": "debian:12", "cpu": "0"}, "cpu: cpu '0' must be greater than zero"),
        ({}, "image: Field required"),
    ],
)
async def test_bad_requests_are_400_naming_the_field(
    service: Service, backend: AgentProcessBackend, body: dict[str, Any], message: str
) -> None:
    response = await service.http.post("/sandboxes", json=body)
    assert response.status_code == 400
    assert detail(response) == {"code": "invalid_request", "message": message}
    assert backend.creates == 0


async def test_sizes_above_the_caps_are_422_naming_the_setting(
    start_service: StartService, backend: AgentProcessBackend
) -> None:
    service = await start_service(max_cpu=4.0, max_memory=8 * 1024**3)
    response = await service.http.post("/sandboxes", json={"image": "debian:12", "cpu": "8"})
    assert response.status_code == 422
    assert detail(response) == {
        "code": "limit_exceeded",
        "message": "cpu 8 is above this service's cap of 4 cores",
        "hint": "ask for less, or raise the cap with ORCHARD_MAX_CPU",
    }
    as_number = await service.http.post("/sandboxes", json={"image": "debian:12", "cpu": 64})
    assert detail(as_number)["message"] == "cpu 64 is above this service's cap of 4 cores"
    response = await service.http.post("/sandboxes", json={"image": "debian:12", "memory": "16Gi"})
    assert response.status_code == 422
    assert detail(response) == {
        "code": "limit_exceeded",
        "message": "memory 16Gi is above this service's cap of 8Gi",
        "hint": "ask for less, or raise the cap with ORCHARD_MAX_MEMORY",
    }
    assert backend.creates == 0


async def test_duplicate_id_is_409(service: Service, backend: AgentProcessBackend) -> None:
    await service.create(sandbox_id="twin")
    response = await service.http.post(
        "/sandboxes", json={"image": "debian:12", "sandbox_id": "twin"}
    )
    assert response.status_code == 409
    assert detail(response) == {
        "code": "sandbox_exists",
        "message": "sandbox twin already exists",
        "hint": "pick another sandbox_id, or delete the existing sandbox first",
    }
    assert backend.creates == 1


async def test_unknown_image_is_422_fast_and_leaves_nothing(
    service: Service, backend: AgentProcessBackend
) -> None:
    response = await service.http.post(
        "/sandboxes", json={"image": MISSING_IMAGE, "sandbox_id": "pull-me"}
    )
    assert response.status_code == 422
    assert detail(response) == {
        "code": "image_not_found",
        "message": "image missing/image is not present locally and could not be pulled: "
        "repository does not exist or may require authorization",
    }
    assert (await service.http.get("/sandboxes/pull-me")).status_code == 404
    assert (await service.http.get("/usage")).json()["records"] == []
    # The id is free again.
    await service.create(sandbox_id="pull-me")
    usage = (await service.http.get("/usage")).json()["records"]
    assert [(r["sandbox_id"], r["ended_at"]) for r in usage] == [("pull-me", None)]


async def test_unknown_ids_are_404_including_delete(service: Service) -> None:
    for method, path in [
        ("GET", "/sandboxes/nope"),
        ("GET", "/sandboxes/nope/wait"),
        ("DELETE", "/sandboxes/nope"),
        ("POST", "/sandboxes/nope/heartbeat"),
    ]:
        response = await service.http.request(method, path)
        assert response.status_code == 404, (method, path)
        assert detail(response) == {
            "code": "sandbox_not_found",
            "message": "sandbox nope does not exist",
            "hint": "`orchard sandbox list` shows your sandboxes",
        }


async def test_delete_removes_the_container_and_keeps_the_record(
    service: Service, backend: AgentProcessBackend
) -> None:
    info = await service.create(sandbox_id="gone-soon")
    response = await service.http.delete("/sandboxes/gone-soon")
    assert response.status_code == 200
    assert response.json() == {
        "status": "deleted",
        "sandbox_id": "gone-soon",
        "already_deleted": False,
    }
    assert "gone-soon" not in backend.sandboxes
    # As upstream: a deleted sandbox is 404 (saying why); include_deleted shows its record.
    hidden = await service.http.get("/sandboxes/gone-soon")
    assert hidden.status_code == 404
    assert detail(hidden) == {
        "code": "sandbox_not_found",
        "message": "sandbox gone-soon was deleted: deleted by request",
    }
    shown = (
        await service.http.get("/sandboxes/gone-soon", params={"include_deleted": "true"})
    ).json()
    assert shown["status"] == "deleted" and shown["ready"] is False
    assert shown["deleted_at"] is not None and shown["created_at"] == info["created_at"]

    # Idempotent, as upstream's clients delete on exit (maybe after the reaper did).
    again = await service.http.delete("/sandboxes/gone-soon")
    assert again.status_code == 200
    assert again.json()["already_deleted"] is True
    run = await service.http.post("/sandboxes/gone-soon/exec", json={"command": "true"})
    assert run.status_code == 404
    assert detail(run)["message"] == "sandbox gone-soon was deleted: deleted by request"
    # A deleted id can be used again.
    await service.create(sandbox_id="gone-soon")


async def test_agent_that_never_answers_fails_with_the_reason(
    service: Service, backend: AgentProcessBackend
) -> None:
    response = await service.http.post(
        "/sandboxes", json={"image": HANG_IMAGE, "sandbox_id": "stuck", "timeout": 1}
    )
    assert response.status_code == 201
    waited = await service.http.get("/sandboxes/stuck/wait", params={"timeout": 10})
    assert waited.status_code == 200
    info = waited.json()
    assert info["status"] == "failed"
    assert info["status_message"].startswith("it did not become ready within 1 s (agent: ")
    assert "stuck" in backend.deletes
    run = await service.http.post("/sandboxes/stuck/exec", json={"command": "true"})
    assert run.status_code == 409
    assert detail(run) == {
        "code": "sandbox_not_ready",
        "message": f"sandbox stuck failed: {info['status_message']}",
        "hint": "delete it and create a new one",
    }


async def test_container_that_exits_at_start_fails_with_its_exit_code(service: Service) -> None:
    response = await service.http.post(
        "/sandboxes", json={"image": CRASH_IMAGE, "sandbox_id": "boom"}
    )
    assert response.status_code == 201
    info = (await service.http.get("/sandboxes/boom/wait", params={"timeout": 10})).json()
    assert info["status"] == "failed"
    assert info["status_message"] == "its container stopped (exit code 1)"


async def test_wait_times_out_with_408(service: Service) -> None:
    await service.http.post(
        "/sandboxes", json={"image": HANG_IMAGE, "sandbox_id": "slow", "timeout": 60}
    )
    response = await service.http.get("/sandboxes/slow/wait", params={"timeout": 0.2})
    assert response.status_code == 408
    assert detail(response) == {
        "code": "timeout",
        "message": "sandbox slow is still pending after 0.2 s",
        "hint": "wait again, or check `orchard sandbox get slow`",
    }


async def test_list_filters_by_label_and_status(service: Service) -> None:
    await service.create(sandbox_id="a", labels={"team": "rl", "run": "1"})
    await service.create(sandbox_id="b", labels={"team": "rl", "run": "2"})
    await service.create(sandbox_id="c", labels={"team": "eval"})
    await service.http.delete("/sandboxes/c")

    async def ids(**params: Any) -> list[str]:
        response = await service.http.get("/sandboxes", params=params)
        assert response.status_code == 200, response.text
        return sorted(s["sandbox_id"] for s in response.json()["sandboxes"])

    assert await ids() == ["a", "b"]
    assert await ids(include_deleted="true") == ["a", "b", "c"]
    assert await ids(label="team=rl") == ["a", "b"]
    assert await ids(label=["team=rl", "run=2"]) == ["b"]
    assert await ids(status="deleted") == ["c"]
    assert await ids(status="ready", label="team=eval") == []
    bad = await service.http.get("/sandboxes", params={"label": "team"})
    assert bad.status_code == 400
    assert detail(bad)["message"] == "label filter 'team' must look like key=value"


async def test_list_pages_follow_continue_tokens_newest_first(service: Service, clock: Any) -> None:
    for name in ("p1", "p2", "p3"):
        await service.create(sandbox_id=name, labels={"page": "yes"})
    clock.advance(1)
    await service.create(sandbox_id="p0", labels={"page": "no"})
    clock.advance(1)
    await service.create(sandbox_id="p4", labels={"page": "yes"})

    async def pages(**params: Any) -> list[list[str]]:
        seen, token = [], None
        while True:
            query = params if token is None else {**params, "continue": token}
            response = await service.http.get("/sandboxes", params=query)
            assert response.status_code == 200, response.text
            body = response.json()
            seen.append([s["sandbox_id"] for s in body["sandboxes"]])
            token = body["continue"]
            if token is None:
                return seen

    assert await pages() == [["p4", "p0", "p3", "p2", "p1"]]
    assert await pages(limit=2) == [["p4", "p0"], ["p3", "p2"], ["p1"]]
    assert await pages(limit=5) == [["p4", "p0", "p3", "p2", "p1"], []]
    # label filters apply to each page: a page may hold fewer than the limit
    assert await pages(limit=2, label="page=yes") == [["p4"], ["p3", "p2"], ["p1"]]
    for bad in ({"continue": "garbage"}, {"continue": "bm90fGFuaWQ"}, {"limit": 0}):
        refused = await service.http.get("/sandboxes", params=bad)
        assert refused.status_code == 400, bad
    forged = await service.http.get("/sandboxes", params={"continue": "garbage"})
    assert detail(forged)["message"] == "continue token 'garbage' is not one this service gave"


async def test_heartbeat_extends_expiry(service: Service, clock: Any) -> None:
    info = await service.create(sandbox_id="beat", idle_timeout_seconds=1800)
    clock.advance(600)
    response = await service.http.post("/sandboxes/beat/heartbeat")
    assert response.status_code == 200
    body = response.json()
    assert (body["status"], body["sandbox_id"]) == ("ok", "beat")
    assert body["expires_at"] > info["expires_at"] + 599


def test_the_process_limit_fits_the_memory_limit() -> None:
    assert [pids_for(mib << 20, 4096) for mib in (16, 64, 512, 2048, 16384)] == [
        128,
        128,
        512,
        2048,
        4096,
    ]


async def test_idle_expiry_starts_with_the_first_heartbeat(service: Service, clock: Any) -> None:
    """Upstream's clients never heartbeat, and upstream idle-expired only sandboxes that sent
    one: without ``idle_timeout_seconds`` only the lifetime cap applies until a heartbeat."""
    info = await service.create(sandbox_id="quiet")
    assert info["idle_timeout_seconds"] is None
    clock.advance(3600)  # twice the service's idle timeout, without any activity
    await service.orchard.reaper.run_pass()
    assert (await service.http.get("/sandboxes/quiet")).json()["status"] == "ready"
    beat = (await service.http.post("/sandboxes/quiet/heartbeat")).json()
    shown = (await service.http.get("/sandboxes/quiet")).json()
    assert shown["idle_timeout_seconds"] == 1800
    assert beat["expires_at"] == pytest.approx(shown["last_activity_at"] + 1800)
    clock.advance(1801)
    await service.orchard.reaper.run_pass()
    gone = await service.http.get("/sandboxes/quiet")
    assert gone.status_code == 404
    assert "expired: idle for 1800 s" in detail(gone)["message"]
