"""Model gateway routes: a sandbox's recorded model calls, its trajectories, and the current
trajectory its calls go to."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query
from fastapi.responses import StreamingResponse

from orchard_env.orchestrator.api.deps import CallerDep, OrchardDep
from orchard_env.orchestrator.gateway.readback import follow_calls, list_calls
from orchard_env.protocol import (
    ModelCallList,
    SandboxInfo,
    TrajectoryList,
    TrajectoryRequest,
    TrajectorySummary,
)

router = APIRouter(tags=["model gateway"])

TrajectoryQuery = Annotated[
    str | None, Query(max_length=128, description="only this trajectory's calls")
]
AfterQuery = Annotated[
    int, Query(ge=0, le=2**63 - 1, description="only calls after this cursor (a row id)")
]


@router.get("/sandboxes/{sandbox_id}/model-calls")
async def get_model_calls(
    sandbox_id: str,
    orchard: OrchardDep,
    caller: CallerDep,
    trajectory_id: TrajectoryQuery = None,
    after: AfterQuery = 0,
    limit: Annotated[int, Query(ge=1, le=1000)] = 1000,
) -> ModelCallList:
    """The sandbox's recorded calls (``orchard.model_call/v1``), oldest first; each carries
    a ``cursor`` to page on with ``after``."""
    await orchard.sandboxes.get_record(sandbox_id, caller)
    calls = await list_calls(orchard.store, sandbox_id, trajectory_id, after, limit)
    return ModelCallList(calls=calls)


@router.get(
    "/sandboxes/{sandbox_id}/model-calls/stream",
    response_class=StreamingResponse,
    responses={200: {"content": {"application/x-ndjson": {}}, "description": "call records"}},
)
async def stream_model_calls(
    sandbox_id: str,
    orchard: OrchardDep,
    caller: CallerDep,
    trajectory_id: TrajectoryQuery = None,
    after: AfterQuery = 0,
    follow: bool = False,
) -> StreamingResponse:
    """The calls as NDJSON; ``follow=true`` keeps sending new ones while the sandbox runs."""
    await orchard.sandboxes.get_record(sandbox_id, caller)
    lines = follow_calls(orchard.store, orchard.gateway, sandbox_id, trajectory_id, after, follow)
    return StreamingResponse(lines, media_type="application/x-ndjson")


@router.get("/sandboxes/{sandbox_id}/trajectories")
async def get_trajectories(
    sandbox_id: str, orchard: OrchardDep, caller: CallerDep
) -> TrajectoryList:
    await orchard.sandboxes.get_record(sandbox_id, caller)
    rows = await orchard.store.list_trajectories(sandbox_id)
    return TrajectoryList(trajectories=[TrajectorySummary(**row) for row in rows])


@router.put("/sandboxes/{sandbox_id}/trajectory")
async def put_trajectory(
    sandbox_id: str, request: TrajectoryRequest, orchard: OrchardDep, caller: CallerDep
) -> SandboxInfo:
    """Send the sandbox's next model calls (those without a ``/t/<traj>`` prefix) to this
    trajectory; no restart, nothing rewritten in the sandbox."""
    return await orchard.sandboxes.set_trajectory(sandbox_id, caller, request.trajectory_id)
