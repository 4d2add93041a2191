"""Request dependencies: the service container and the authenticated caller."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import APIKeyHeader

from orchard_env.orchestrator.auth import Caller, authenticate
from orchard_env.orchestrator.services import Orchard

api_key_header = APIKeyHeader(name="X-API-Key", auto_error=False)


async def get_orchard(request: Request) -> Orchard:
    orchard: Orchard = request.app.state.orchard
    return orchard


OrchardDep = Annotated[Orchard, Depends(get_orchard)]


async def get_caller(
    request: Request, api_key: Annotated[str | None, Depends(api_key_header)]
) -> Caller:
    # The service from the request, not as a sub-dependency: one less for FastAPI to solve on
    # every request.
    orchard = await get_orchard(request)
    return await authenticate(orchard.store, orchard.settings, api_key)


CallerDep = Annotated[Caller, Depends(get_caller)]
