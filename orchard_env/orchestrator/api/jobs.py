"""Exec and job routes: run (optionally waiting or streamed), show, wait, list, cancel."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, Query
from fastapi.responses import StreamingResponse

from orchard_env.orchestrator.api.deps import CallerDep, OrchardDep
from orchard_env.protocol import ExecEvent, ExecRequest, Job

router = APIRouter(tags=["jobs"])


@router.post("/sandboxes/{sandbox_id}/exec")
async def exec_command(
    sandbox_id: str, request: ExecRequest, orchard: OrchardDep, caller: CallerDep
) -> Job:
    return await orchard.jobs.exec(sandbox_id, request, caller)


@router.post(
    "/sandboxes/{sandbox_id}/exec/stream",
    response_class=StreamingResponse,
    responses={200: {"content": {"application/x-ndjson": {}}, "description": "ExecEvent lines"}},
)
async def exec_stream(
    sandbox_id: str, request: ExecRequest, orchard: OrchardDep, caller: CallerDep
) -> StreamingResponse:
    events = await orchard.jobs.stream(sandbox_id, request, caller)
    return StreamingResponse(_ndjson(events), media_type="application/x-ndjson")


async def _ndjson(events: AsyncIterator[ExecEvent]) -> AsyncIterator[bytes]:
    async for event in events:
        yield event.model_dump_json(exclude_none=True).encode() + b"\n"


@router.get("/sandboxes/{sandbox_id}/jobs")
async def list_jobs(sandbox_id: str, orchard: OrchardDep, caller: CallerDep) -> list[Job]:
    return await orchard.jobs.list(sandbox_id, caller)


@router.get("/jobs/{job_id}")
async def get_job(job_id: str, orchard: OrchardDep, caller: CallerDep) -> Job:
    return await orchard.jobs.get(job_id, caller)


@router.get("/jobs/{job_id}/wait")
async def wait_job(
    job_id: str,
    orchard: OrchardDep,
    caller: CallerDep,
    timeout: Annotated[float, Query(ge=0, le=86400)] = 300,  # noqa: ASYNC109 (upstream's name)
) -> Job:
    return await orchard.jobs.wait(job_id, caller, timeout)


@router.post("/jobs/{job_id}/cancel")
async def cancel_job(job_id: str, orchard: OrchardDep, caller: CallerDep) -> Job:
    return await orchard.jobs.cancel(job_id, caller)
