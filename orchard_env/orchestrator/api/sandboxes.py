"""Sandbox routes: create, list, show, wait, delete, heartbeat."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from orchard_env.errors import InvalidRequest
from orchard_env.orchestrator.api.deps import CallerDep, OrchardDep
from orchard_env.protocol import (
    CreateSandboxRequest,
    DeleteResponse,
    HeartbeatResponse,
    SandboxInfo,
    SandboxList,
    SandboxStatus,
    check_labels,
)

MAX_PAGE = 10_000

router = APIRouter(tags=["sandboxes"])


def parse_label_filters(values: list[str]) -> dict[str, str]:
    labels = {}
    for value in values:
        key, sep, wanted = value.partition("=")
        if not sep or not key:
            raise InvalidRequest(f"label filter {value!r} must look like key=value")
        labels[key] = wanted
    try:
        return check_labels(labels)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from exc


@router.post("/sandboxes", status_code=201)
async def create_sandbox(
    request: CreateSandboxRequest, orchard: OrchardDep, caller: CallerDep
) -> SandboxInfo:
    return await orchard.sandboxes.create(request, caller)


@router.get("/sandboxes")
async def list_sandboxes(
    orchard: OrchardDep,
    caller: CallerDep,
    label: Annotated[list[str], Query(description="key=value; repeat to AND them")] = [],  # noqa: B006
    status: SandboxStatus | None = None,
    include_deleted: bool = False,
    limit: Annotated[
        int | None, Query(ge=1, le=MAX_PAGE, description="at most this many per page")
    ] = None,
    continue_token: Annotated[
        str | None,
        Query(alias="continue", max_length=512, description="the previous page's `continue`"),
    ] = None,
) -> SandboxList:
    return await orchard.sandboxes.list(
        caller,
        labels=parse_label_filters(label),
        status=status,
        include_deleted=include_deleted,
        limit=limit,
        continue_token=continue_token,
    )


@router.get("/sandboxes/{sandbox_id}")
async def get_sandbox(
    sandbox_id: str, orchard: OrchardDep, caller: CallerDep, include_deleted: bool = False
) -> SandboxInfo:
    """A deleted sandbox is 404 (as upstream), with why in the message; ``include_deleted``
    shows its record instead."""
    return await orchard.sandboxes.get(sandbox_id, caller, include_deleted=include_deleted)


@router.get("/sandboxes/{sandbox_id}/wait")
async def wait_sandbox(
    sandbox_id: str,
    orchard: OrchardDep,
    caller: CallerDep,
    timeout: Annotated[float, Query(ge=0, le=86400)] = 3600,  # noqa: ASYNC109 (upstream's name)
) -> SandboxInfo:
    return await orchard.sandboxes.wait(sandbox_id, caller, timeout)


@router.delete("/sandboxes/{sandbox_id}")
async def delete_sandbox(sandbox_id: str, orchard: OrchardDep, caller: CallerDep) -> DeleteResponse:
    return await orchard.sandboxes.delete(sandbox_id, caller)


@router.post("/sandboxes/{sandbox_id}/heartbeat")
async def heartbeat(sandbox_id: str, orchard: OrchardDep, caller: CallerDep) -> HeartbeatResponse:
    return await orchard.sandboxes.heartbeat(sandbox_id, caller)
