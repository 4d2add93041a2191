"""``WS /sandboxes/{id}/exec/pty``: upstream's terminal protocol.

The key may come as the ``X-API-Key`` header, an ``api_key`` query parameter, or a
``api_key.<key>`` subprotocol (browsers cannot set headers); the chosen subprotocol is
echoed. Failures close after the handshake with 4401 (no key), 4403 (bad key), 4404 (no such
sandbox), 4409 (not ready) or 4503 (anything else), so clients see the reason instead of
upstream's bare HTTP 403. A session whose key is revoked while it is open ends with 4403.
"""

from __future__ import annotations

from fastapi import APIRouter, WebSocket

from orchard_env.errors import (
    AuthenticationRequired,
    Conflict,
    NotFound,
    OrchardError,
    PermissionDenied,
)
from orchard_env.orchestrator.auth import authenticate
from orchard_env.orchestrator.pty import relay
from orchard_env.orchestrator.services import Orchard

router = APIRouter(tags=["pty"])

SUBPROTOCOL_PREFIX = "api_key."
_CLOSE_CODES: tuple[tuple[type[OrchardError], int], ...] = (
    (AuthenticationRequired, 4401),
    (PermissionDenied, 4403),
    (NotFound, 4404),
    (Conflict, 4409),
)
CLOSE_OTHER = 4503


def _key_from(ws: WebSocket) -> tuple[str | None, str | None]:
    """(api key, subprotocol to echo)."""
    for protocol in ws.scope.get("subprotocols", []):
        if protocol.startswith(SUBPROTOCOL_PREFIX):
            return protocol.removeprefix(SUBPROTOCOL_PREFIX), protocol
    return ws.headers.get("x-api-key") or ws.query_params.get("api_key"), None


@router.websocket("/sandboxes/{sandbox_id}/exec/pty")
async def pty(ws: WebSocket, sandbox_id: str) -> None:
    orchard: Orchard = ws.app.state.orchard
    api_key, subprotocol = _key_from(ws)
    await ws.accept(subprotocol=subprotocol)
    try:
        caller = await authenticate(orchard.store, orchard.settings, api_key)
        record = await orchard.sandboxes.require_ready(sandbox_id, caller)
    except OrchardError as exc:
        code = next((c for cls, c in _CLOSE_CODES if isinstance(exc, cls)), CLOSE_OTHER)
        await ws.send_json({"type": "error", "message": exc.message})
        await ws.close(code, exc.message[:120])
        return
    async with orchard.sessions.hold(caller) as revoked:
        await relay(ws, record, orchard.sandboxes, orchard.agents, revoked=revoked)
