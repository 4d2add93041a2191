"""API key routes (admin only)."""

from __future__ import annotations

from fastapi import APIRouter

from orchard_env.orchestrator import keys
from orchard_env.orchestrator.api.deps import CallerDep, OrchardDep
from orchard_env.protocol import KeyCreated, KeyCreateRequest, KeyInfo, KeyQuota

router = APIRouter(tags=["keys"])


@router.post("/keys", status_code=201)
async def create_key(
    request: KeyCreateRequest, orchard: OrchardDep, caller: CallerDep
) -> KeyCreated:
    caller.require_admin()
    quota = KeyQuota.model_validate(request.model_dump(include=set(KeyQuota.model_fields)))
    return await keys.create_key(orchard.store, request.name, admin=request.admin, quota=quota)


@router.get("/keys")
async def list_keys(orchard: OrchardDep, caller: CallerDep) -> list[KeyInfo]:
    caller.require_admin()
    return await keys.list_keys(orchard.store)


@router.delete("/keys/{key_id}")
async def revoke_key(key_id: str, orchard: OrchardDep, caller: CallerDep) -> KeyInfo:
    caller.require_admin()
    revoked = await keys.revoke_key(orchard.store, key_id)
    orchard.sessions.revoked(key_id)  # its open PTY sessions and streamed execs end now
    return revoked
