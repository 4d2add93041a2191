"""Warm pool routes (admin only): create, list, show, resize, delete."""

from __future__ import annotations

from fastapi import APIRouter

from orchard_env.orchestrator.api.deps import CallerDep, OrchardDep
from orchard_env.protocol import PoolCreateRequest, PoolInfo, PoolList, PoolResizeRequest

router = APIRouter(tags=["pools"])


@router.post("/pools", status_code=201)
async def create_pool(
    request: PoolCreateRequest, orchard: OrchardDep, caller: CallerDep
) -> PoolInfo:
    caller.require_admin()
    return await orchard.pools.create(request)


@router.get("/pools")
async def list_pools(orchard: OrchardDep, caller: CallerDep) -> PoolList:
    caller.require_admin()
    return await orchard.pools.list_pools()


@router.get("/pools/{name}")
async def get_pool(name: str, orchard: OrchardDep, caller: CallerDep) -> PoolInfo:
    caller.require_admin()
    return await orchard.pools.get(name)


@router.patch("/pools/{name}")
async def resize_pool(
    name: str, request: PoolResizeRequest, orchard: OrchardDep, caller: CallerDep
) -> PoolInfo:
    caller.require_admin()
    return await orchard.pools.resize(name, request.size)


@router.delete("/pools/{name}")
async def delete_pool(name: str, orchard: OrchardDep, caller: CallerDep) -> PoolInfo:
    """Removes the pool and the sandboxes waiting in it; claimed ones are not touched."""
    caller.require_admin()
    return await orchard.pools.delete(name)
