"""HTTP and WebSocket routes, one module per area. Thin: parse, call a service, return."""

from __future__ import annotations

from fastapi import APIRouter

from orchard_env.orchestrator.api import (
    files,
    health,
    jobs,
    keys,
    model_calls,
    pools,
    pty,
    sandboxes,
    snapshots,
    usage,
)


def router() -> APIRouter:
    root = APIRouter()
    for module in (health, sandboxes, snapshots, jobs, files, pty, keys, pools, usage, model_calls):
        root.include_router(module.router)
    return root
