"""Restarts and reconciliation: nothing lost, nothing run twice, live sandboxes never killed."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime

import pytest

from orchard_env.config import ServiceSettings
from orchard_env.orchestrator.backends.base import SandboxSpec
from orchard_env.orchestrator.jobs import RESTART_LOST
from orchard_env.orchestrator.records import JobRecord, SandboxRecord
from orchard_env.orchestrator.store import SQLiteStore
from orchard_env.protocol import ExecRequest, JobStatus, SandboxStatus
from tests.orchestrator.conftest import Service, StartService, eventually
from tests.orchestrator.fakes import AgentProcessBackend
from tests.orchestrator.test_jobs import UNTIL_GO, job_status, release


@asynccontextmanager
async def offline_store(settings: ServiceSettings) -> AsyncIterator[SQLiteStore]:
    """The database while no orchestrator runs."""
    store = SQLiteStore(settings.db_path)
    await store.open()
    try:
        yield store
    finally:
        await store.close()


async def test_restart_finds_records_jobs_and_sandboxes(
    start_service: StartService, backend: AgentProcessBackend
) -> None:
    first = await start_service()
    sandbox = await first.create(sandbox_id="keeper", labels={"k": "v"})
    done = await first.exec("keeper", "echo finished")
    command = f"echo begin; {UNTIL_GO}; echo once >> count.txt"
    running = await first.http.post(
        "/sandboxes/keeper/exec", json={"command": command, "job_id": "long"}
    )
    assert running.status_code == 200

    async def acknowledged() -> bool:  # the agent answered: the row says running
        rows = await first.orchard.store.find_jobs("long")
        return bool(rows) and rows[0].status == "running"

    await eventually(acknowledged)
    await first.stop()
    assert "keeper" in backend.sandboxes  # stopping the service never touches sandboxes

    second = await start_service()
    info = (await second.http.get("/sandboxes/keeper")).json()
    assert info["status"] == "ready" and info["labels"] == {"k": "v"}
    assert info["created_at"] == sandbox["created_at"]
    assert (await second.http.get(f"/jobs/{done['job_id']}")).json() == done
    assert await job_status(second, "long") == "running"  # re-attached, not re-run
    # Submitting the same job id again still returns the one job.
    again = await second.http.post(
        "/sandboxes/keeper/exec", json={"command": command, "job_id": "long"}
    )
    assert again.json()["job_id"] == "long"

    await release(second, "keeper")
    finished = (await second.http.get("/jobs/long/wait", params={"timeout": 10})).json()
    assert finished["status"] == "succeeded"
    assert finished["stdout"] == "begin\nreleased\n"
    count = await second.http.get("/sandboxes/keeper/files/raw", params={"path": "count.txt"})
    assert count.content == b"once\n"
    assert backend.creates == 1


async def test_queued_jobs_are_sent_and_forgotten_ones_fail(
    start_service: StartService, settings: ServiceSettings
) -> None:
    first = await start_service()
    await first.create(sandbox_id="box")
    await first.stop()
    now = datetime.now(UTC)
    async with offline_store(settings) as store:
        for job_id, status in (("never-sent", "queued"), ("agent-forgot", "running")):
            request = ExecRequest(command="echo sent", job_id=job_id)
            await store.insert_job(
                JobRecord(
                    job_id=job_id,
                    sandbox_id="box",
                    command="echo sent",
                    request=request,
                    status=JobStatus(status),
                    created_at=now,
                )
            )

    second = await start_service()
    sent = (await second.http.get("/jobs/never-sent/wait", params={"timeout": 10})).json()
    assert (sent["status"], sent["stdout"]) == ("succeeded", "sent\n")
    lost = (await second.http.get("/jobs/agent-forgot/wait", params={"timeout": 10})).json()
    assert lost["status"] == "failed"
    assert (
        lost["error"]
        == RESTART_LOST
        == ("orchestrator restarted and the agent no longer has this job")
    )


def spec_for(record: SandboxRecord | None, sandbox_id: str) -> SandboxSpec:
    return SandboxSpec(
        sandbox_id=sandbox_id,
        image="debian:12",
        cpu=1.0,
        memory_bytes=1024**3,
        block_network=True,
        workdir="/workspace",
        agent_token=secrets.token_urlsafe(16),
        record_annotation=None if record is None else record.annotation(),
    )


async def test_unrecorded_sandboxes_are_adopted(
    start_service: StartService, backend: AgentProcessBackend
) -> None:
    now = datetime.now(UTC)
    record = SandboxRecord(
        sandbox_id="orphan",
        image="python:3.11",
        cpu=2.0,
        memory_bytes=4 * 1024**3,
        labels={"from": "annotation"},
        owner="0123456789",
        created_at=now,
        ready_timeout_seconds=60,
        last_activity_at=now,
        backend="fake",
    )
    await backend.create(spec_for(record, "orphan"))
    await backend.create(spec_for(None, "bare"))

    service = await start_service()
    orphan = (await service.http.get("/sandboxes/orphan/wait", params={"timeout": 10})).json()
    assert orphan["status"] == "ready"
    assert (orphan["image"], orphan["cpu"], orphan["memory"]) == ("python:3.11", "2", "4Gi")
    assert (orphan["labels"], orphan["owner"]) == ({"from": "annotation"}, "0123456789")
    bare = (await service.http.get("/sandboxes/bare/wait", params={"timeout": 10})).json()
    assert bare["status"] == "ready"
    assert bare["image"] == "unknown"
    assert bare["status_message"] == (
        "adopted without its record: image, size and owner are unknown"
    )
    assert (await service.exec("bare", "echo adopted"))["stdout"] == "adopted\n"
    assert set(backend.sandboxes) == {"orphan", "bare"}  # nothing deleted

    # A reaper pass adopts one that appears while running, too.
    await backend.create(spec_for(None, "later"))
    await service.orchard.reaper.run_pass()
    later = (await service.http.get("/sandboxes/later/wait", params={"timeout": 10})).json()
    assert later["status"] == "ready"


async def test_a_record_whose_container_is_gone_fails(
    start_service: StartService, backend: AgentProcessBackend
) -> None:
    first = await start_service()
    await first.create(sandbox_id="vanished")
    await first.stop()
    await backend.forget("vanished")
    second = await start_service()
    info = (await second.http.get("/sandboxes/vanished")).json()
    assert info["status"] == "failed"
    assert info["status_message"] == (
        "its container no longer exists (removed outside Orchard, or never created)"
    )


async def test_dead_containers_are_marked_failed_with_the_reason(
    service: Service, backend: AgentProcessBackend
) -> None:
    await service.create(sandbox_id="oom", memory="256Mi")
    job = (
        await service.http.post(
            "/sandboxes/oom/exec", json={"command": UNTIL_GO, "job_id": "in-oom"}
        )
    ).json()
    await backend.kill("oom", exit_code=137, reason="OOMKilled")
    oom = (
        "OOMKilled: its container was killed for using more than its memory limit of 256Mi, "
        "exit code 137; give it more with `memory` at create"
    )
    # The job that was running learns it at once (not at the next reconciliation).
    failed = (await service.http.get(f"/jobs/{job['job_id']}/wait", params={"timeout": 10})).json()
    assert failed["status"] == "failed"
    assert failed["error"] == f"sandbox oom is failed: {oom}"
    info = (await service.http.get("/sandboxes/oom")).json()
    assert (info["status"], info["status_message"]) == ("failed", oom)
    assert "oom" not in backend.sandboxes  # its remains are removed
    # Every later request says why (the SDK raises SandboxNotReady with this message).
    later = await service.http.post("/sandboxes/oom/exec", json={"command": "true"})
    assert later.status_code == 409
    assert later.json()["detail"]["message"] == f"sandbox oom failed: {oom}"

    await service.create(sandbox_id="crashed")
    await backend.kill("crashed", exit_code=3, reason="exited with code 3")
    await service.orchard.reaper.run_pass()
    info = (await service.http.get("/sandboxes/crashed")).json()
    assert info["status_message"] == "its container stopped (exit code 3, exited with code 3)"


async def test_containers_of_deleted_records_are_removed(
    start_service: StartService, backend: AgentProcessBackend, settings: ServiceSettings
) -> None:
    first = await start_service()
    await first.create(sandbox_id="half-deleted")
    await first.stop()
    async with offline_store(settings) as store:  # a crash between the record and the engine
        record = await store.get_sandbox("half-deleted")
        assert record is not None
        await store.put_sandbox(record.model_copy(update={"status": SandboxStatus.DELETED}))
    await start_service()
    assert "half-deleted" not in backend.sandboxes


async def test_stuck_pending_fails_when_nothing_probes_it(
    start_service: StartService,
    backend: AgentProcessBackend,
    clock: object,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    first = await start_service()
    response = await first.http.post(
        "/sandboxes", json={"image": "hang/image", "sandbox_id": "limbo", "timeout": 30}
    )
    assert response.status_code == 201
    await first.stop()

    async def engine_down() -> list[object]:
        raise ConnectionError("engine down")

    monkeypatch.setattr(backend, "list", engine_down)  # reconciliation cannot run
    second = await start_service()
    assert (await second.http.get("/sandboxes/limbo")).json()["status"] == "pending"
    await second.orchard.reaper.run_pass(
        (await second.orchard.store.get_sandbox("limbo")).ready_deadline()  # type: ignore[union-attr]
    )
    info = (await second.http.get("/sandboxes/limbo")).json()
    assert info["status"] == "failed"
    assert info["status_message"] == "it did not become ready within 30 s"
