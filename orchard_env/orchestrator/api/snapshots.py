"""Snapshot routes: snapshot and fork a sandbox; list, show, delete and restore snapshots."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Body, Query

from orchard_env.orchestrator.api.deps import CallerDep, OrchardDep
from orchard_env.orchestrator.api.sandboxes import parse_label_filters
from orchard_env.protocol import (
    ForkRequest,
    ForkResult,
    RestoreRequest,
    SandboxInfo,
    Snapshot,
    SnapshotDeleteResult,
    SnapshotList,
    SnapshotRequest,
)

router = APIRouter(tags=["snapshots"])


@router.post("/sandboxes/{sandbox_id}/snapshot", status_code=201)
async def snapshot_sandbox(
    sandbox_id: str,
    orchard: OrchardDep,
    caller: CallerDep,
    request: Annotated[SnapshotRequest | None, Body()] = None,
) -> Snapshot:
    """Commit the sandbox's filesystem (not its running processes) to a new snapshot."""
    return await orchard.snapshots.snapshot(sandbox_id, request or SnapshotRequest(), caller)


@router.post("/sandboxes/{sandbox_id}/fork", status_code=201)
async def fork_sandbox(
    sandbox_id: str, request: ForkRequest, orchard: OrchardDep, caller: CallerDep
) -> ForkResult:
    """Snapshot the sandbox and restore it ``count`` times at once; each is ready on return,
    and each one that failed is listed in ``failures``."""
    return await orchard.snapshots.fork(sandbox_id, request, caller)


@router.get("/snapshots")
async def list_snapshots(
    orchard: OrchardDep,
    caller: CallerDep,
    label: Annotated[list[str], Query(description="key=value; repeat to AND them")] = [],  # noqa: B006
    include_deleted: bool = False,
) -> SnapshotList:
    """Snapshots visible to this key, oldest first (parents before their children)."""
    return await orchard.snapshots.list(
        caller, labels=parse_label_filters(label), include_deleted=include_deleted
    )


@router.get("/snapshots/{snapshot_id}")
async def get_snapshot(snapshot_id: str, orchard: OrchardDep, caller: CallerDep) -> Snapshot:
    return await orchard.snapshots.get(snapshot_id, caller)


@router.delete("/snapshots/{snapshot_id}")
async def delete_snapshot(
    snapshot_id: str, orchard: OrchardDep, caller: CallerDep, recursive: bool = False
) -> SnapshotDeleteResult:
    """Delete a snapshot (``recursive``: with its descendants; without, one that has child
    snapshots is refused with 409). Its image goes once no sandbox uses it."""
    return await orchard.snapshots.delete(snapshot_id, caller, recursive=recursive)


@router.post("/snapshots/{snapshot_id}/restore", status_code=201)
async def restore_snapshot(
    snapshot_id: str,
    orchard: OrchardDep,
    caller: CallerDep,
    request: Annotated[RestoreRequest | None, Body()] = None,
) -> SandboxInfo:
    """A new sandbox from the snapshot, with the source's resources, workdir, env and labels
    (``env`` and ``labels`` given here are added over them); ready when this returns."""
    return await orchard.snapshots.restore(snapshot_id, request or RestoreRequest(), caller)
