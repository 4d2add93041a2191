"""``GET /usage``: sandbox-seconds for cost reports."""

from __future__ import annotations

from datetime import datetime

from fastapi import APIRouter

from orchard_env.orchestrator.api.deps import CallerDep, OrchardDep
from orchard_env.orchestrator.usage import usage_report
from orchard_env.protocol import UsageReport

router = APIRouter(tags=["usage"])


@router.get("/usage")
async def usage(
    orchard: OrchardDep,
    caller: CallerDep,
    since: datetime | None = None,
    until: datetime | None = None,
) -> UsageReport:
    return await usage_report(orchard.store, caller, now=orchard.clock(), since=since, until=until)
