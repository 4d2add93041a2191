"""``GET /``, ``GET /health`` (no auth) and ``GET /resources``."""

from __future__ import annotations

from fastapi import APIRouter

from orchard_env import __version__
from orchard_env.orchestrator.api.deps import CallerDep, OrchardDep
from orchard_env.orchestrator.resources import resources_report
from orchard_env.protocol import Health, ResourcesReport, ServiceBanner

router = APIRouter(tags=["service"])


@router.get("/")
async def banner() -> ServiceBanner:
    return ServiceBanner(version=__version__)


@router.get("/health")
async def health(orchard: OrchardDep) -> Health:
    return Health(version=__version__, backend=orchard.backend.name)


@router.get("/resources")
async def resources(orchard: OrchardDep, caller: CallerDep) -> ResourcesReport:
    return await resources_report(orchard.store, orchard.backend, orchard.settings, caller)
