"""Exec and job routes: run (optionally waiting or streamed), show, wait, list, cancel."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, Query
from fastapi.responses import StreamingResponse

from orchard_env.errors import PermissionDenied
from orchard_env.orchestrator.api.deps import CallerDep, OrchardDep
from orchard_env.orchestrator.auth import Caller
from orchard_env.orchestrator.keys import revoked_message
from orchard_env.orchestrator.services import Orchard
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
    return StreamingResponse(_ndjson(events, orchard, caller), media_type="application/x-ndjson")


async def _ndjson(
    events: AsyncIterator[ExecEvent], orchard: Orchard, caller: Caller
) -> AsyncIterator[bytes]:
    """The events as NDJSON lines, until the stream ends or the caller's key is revoked
    (then an ``error`` event ends it; the command runs on)."""
    job_id = ""
    async with orchard.sessions.hold(caller) as revoked:
        async for event in _until(events, revoked):
            job_id = event.job_id
            yield event.model_dump_json(exclude_none=True).encode() + b"\n"
        if revoked.is_set():
            error = PermissionDenied(revoked_message(caller.key_id))
            ended = ExecEvent(event="error", job_id=job_id, code=error.code, message=error.message)
            yield ended.model_dump_json(exclude_none=True).encode() + b"\n"


async def _until(events: AsyncIterator[ExecEvent], stop: asyncio.Event) -> AsyncIterator[ExecEvent]:
    """``events`` until they end or ``stop`` is set, whichever comes first."""
    iterator = aiter(events)
    stopped = asyncio.ensure_future(stop.wait())
    following: asyncio.Future[ExecEvent] | None = None
    try:
        while not stop.is_set():
            following = asyncio.ensure_future(anext(iterator))
            await asyncio.wait((following, stopped), return_when=asyncio.FIRST_COMPLETED)
            if not following.done():
                return
            try:
                event = following.result()
            except StopAsyncIteration:
                return
            yield event
    finally:  # stopped, or the client went away: nothing is left waiting on the job
        stopped.cancel()
        if following is not None and not following.done():
            following.cancel()
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                await following


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
