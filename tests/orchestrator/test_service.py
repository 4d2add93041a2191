"""Service-wide behaviour: error shapes, request ids, health, resources, logging, backends."""

from __future__ import annotations

import json
import logging
import re
from dataclasses import replace
from pathlib import Path

import pytest

from orchard_env.errors import BackendUnavailable, ConfigError, NotSupported
from orchard_env.orchestrator.backends import make_backend
from orchard_env.orchestrator.backends.base import SandboxSpec
from orchard_env.orchestrator.logs import JsonFormatter
from tests.orchestrator.conftest import Service, make_settings
from tests.orchestrator.fakes import AgentProcessBackend
from tests.orchestrator.test_sandboxes import detail


async def test_every_response_has_a_request_id(service: Service) -> None:
    generated = await service.http.get("/health")
    assert re.fullmatch(r"[0-9a-f]{32}", generated.headers["x-request-id"])
    echoed = await service.http.get("/sandboxes/nope", headers={"X-Request-ID": "trace-42"})
    assert echoed.status_code == 404
    assert echoed.headers["x-request-id"] == "trace-42"
    hostile = await service.http.get("/health", headers={"X-Request-ID": "a b\x7f"})
    assert hostile.headers["x-request-id"] != "a b\x7f"


async def test_unknown_routes_and_methods(service: Service) -> None:
    response = await service.http.get("/nothing/here")
    assert response.status_code == 404
    assert detail(response) == {"code": "not_found", "message": "no route GET /nothing/here"}
    response = await service.http.put("/health")
    assert response.status_code == 405
    assert detail(response) == {
        "code": "invalid_request",
        "message": "PUT is not allowed on /health",
    }


async def test_validation_errors_name_the_field(service: Service) -> None:
    sandbox_id = (await service.create())["sandbox_id"]
    response = await service.http.post(
        f"/sandboxes/{sandbox_id}/exec", json={"command": "true", "job_id": "no spaces"}
    )
    assert response.status_code == 400
    assert detail(response) == {
        "code": "invalid_request",
        "message": "job_id: String should match pattern '^[\\w.-]+$'",
    }
    response = await service.http.post(f"/sandboxes/{sandbox_id}/exec", json={"command": " "})
    assert detail(response)["message"] == "command: command is empty"
    response = await service.http.post(
        "/sandboxes", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert response.status_code == 400
    assert detail(response)["message"].startswith("the request body is not valid JSON")
    response = await service.http.get("/jobs/x/wait", params={"timeout": "-1"})
    assert response.status_code == 400
    assert detail(response)["message"] == "timeout: Input should be greater than or equal to 0"


async def test_unexpected_errors_are_500_with_the_request_id(
    service: Service,
    backend: AgentProcessBackend,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def explode(spec: SandboxSpec) -> None:
        raise RuntimeError("engine exploded")

    monkeypatch.setattr(backend, "create", explode)
    response = await service.http.post("/sandboxes", json={"image": "debian:12"})
    assert response.status_code == 500
    request_id = response.headers["x-request-id"]
    assert detail(response) == {
        "code": "internal",
        "message": f"internal error (request id {request_id})",
        "hint": "this is a bug in Orchard: the service log has the details",
    }
    logged = [r for r in caplog.records if r.getMessage() == "unhandled error"]
    assert logged and logged[0].exc_info is not None
    assert "engine exploded" in str(logged[0].exc_info[1])
    # The failed create left no record behind.
    assert (await service.http.get("/sandboxes")).json() == {"sandboxes": [], "continue": None}


async def test_transient_errors_are_503_with_retry_after(
    service: Service, backend: AgentProcessBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def down(spec: SandboxSpec) -> None:
        raise BackendUnavailable("the container engine did not answer")

    monkeypatch.setattr(backend, "create", down)
    response = await service.http.post("/sandboxes", json={"image": "debian:12"})
    assert response.status_code == 503
    assert response.headers["retry-after"] == "5"
    assert detail(response) == {
        "code": "backend_unavailable",
        "message": "the container engine did not answer",
    }


async def test_health_and_resources(service: Service) -> None:
    health = (await service.http.get("/health")).json()
    assert health["status"] == "healthy" and health["backend"] == "fake"
    first = await service.create(cpu="0.5", memory="256Mi")
    await service.create(cpu="1", memory="1Gi")
    report = (await service.http.get("/resources")).json()
    # Upstream's fields, with upstream's shapes.
    assert report["status"] == "ok"
    assert report["nodes"] == [
        {
            "name": "fake-node",
            "capacity": {"cpu": 8.0, "memory_bytes": 32 * 1024**3},
            "allocatable": {"cpu": 7.5, "memory_bytes": 30 * 1024**3},
        }
    ]
    assert report["total_capacity"] == {"cpu": 8.0, "memory_bytes": 32 * 1024**3}
    assert report["total_allocatable"] == {"cpu": 7.5, "memory_bytes": 30 * 1024**3}
    requested = {"cpu": 1.5, "memory_bytes": (256 + 1024) * 1024**2}
    assert report["total_requested"] == requested
    assert report["available"] == {"cpu": 6.0, "memory_bytes": 30 * 1024**3 - (1280 * 1024**2)}
    pod = next(p for p in report["sandbox_pods"] if p["name"] == first["sandbox_id"])
    assert pod == {
        "name": first["sandbox_id"],
        "namespace": "test",
        "phase": "Running",
        "cpu_request": 0.5,
        "memory_request_bytes": 256 * 1024**2,
        "sandbox_id": first["sandbox_id"],
    }
    # Orchard's fields.
    assert report["scope"] == "service" and report["backend"] == "fake"
    assert report["sandboxes"] == 2 and len(report["sandbox_pods"]) == 2
    assert (report["totals"], report["requests"]) == (report["total_allocatable"], requested)


async def test_a_non_admin_key_sees_only_its_own_sandboxes_in_resources(
    service: Service,
) -> None:
    await service.create(cpu="2", memory="1Gi")  # the admin's
    key = await service.new_key("alice")
    async with service.as_key(key) as alice:
        empty = (await alice.get("/resources")).json()
        assert empty["scope"] == "key"
        assert (empty["sandboxes"], empty["sandbox_pods"]) == (0, [])
        assert empty["total_requested"] == {"cpu": 0.0, "memory_bytes": 0}
        assert empty["available"] == empty["total_allocatable"]
        created = await alice.post("/sandboxes", json={"image": "debian:12", "cpu": "0.5"})
        assert created.status_code == 201, created.text
        mine = created.json()["sandbox_id"]
        report = (await alice.get("/resources")).json()
    assert [p["sandbox_id"] for p in report["sandbox_pods"]] == [mine]
    assert report["total_requested"] == {"cpu": 0.5, "memory_bytes": 2 * 1024**3}
    assert report["total_capacity"] == empty["total_capacity"]  # the substrate is no secret
    everything = (await service.http.get("/resources")).json()
    assert everything["total_requested"]["cpu"] == 2.5 and everything["sandboxes"] == 2


async def test_logs_are_json_and_never_carry_keys(
    service: Service, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    sandbox_id = (await service.create())["sandbox_id"]
    await service.exec(sandbox_id, "true")
    await service.http.delete(f"/sandboxes/{sandbox_id}")
    formatter = JsonFormatter()
    lines = [json.loads(formatter.format(record)) for record in caplog.records]
    assert any(line["msg"] == "sandbox created" for line in lines)
    assert all({"ts", "level", "logger", "msg"} <= set(line) for line in lines)
    assert service.admin is not None
    text = "\n".join(formatter.format(record) for record in caplog.records)
    assert service.admin.api_key not in text
    record = await service.orchard.store.get_sandbox(sandbox_id)
    assert record is not None and record.agent is not None
    assert record.agent.token not in text


def test_backend_factory(tmp_path: Path) -> None:
    settings = make_settings(tmp_path)
    with pytest.raises(ConfigError) as raised:  # the kubernetes backend; details in backends/
        make_backend(replace(settings, backend="kubernetes"))
    assert raised.value.message == (
        "the kubernetes backend needs the agent-injector image, and agent_image is not set"
    )
    with pytest.raises(NotSupported) as unknown:
        make_backend(replace(settings, backend="nomad"))
    assert unknown.value.message == "unknown backend 'nomad'"
