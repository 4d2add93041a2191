"""PTY sessions: a client's WebSocket relayed to the sandbox agent's ``/pty``.

The client's ``init`` frame is checked here (10 s to send it, else close 4400) so a bad one
never reaches the agent; then JSON frames are relayed both ways until either side ends. An
open terminal counts as activity (the sandbox is not idle-expired under it).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable

from pydantic import ValidationError
from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from orchard_env.agent.client import AgentPty
from orchard_env.errors import OrchardError
from orchard_env.orchestrator.agents import AgentPool
from orchard_env.orchestrator.records import SandboxRecord
from orchard_env.orchestrator.sandboxes import SandboxService
from orchard_env.protocol import PtyInit

log = logging.getLogger(__name__)

INIT_TIMEOUT_SECONDS = 10.0
CLOSE_BAD_INIT = 4400
CLOSE_AGENT_UNAVAILABLE = 4503
CLOSE_REVOKED = 4403


async def _refuse(ws: WebSocket, code: int, message: str) -> None:
    with contextlib.suppress(Exception):
        await ws.send_json({"type": "error", "message": message})
        await ws.close(code, message[:120])


async def _read_init(ws: WebSocket) -> PtyInit | None:
    try:
        text = await asyncio.wait_for(ws.receive_text(), INIT_TIMEOUT_SECONDS)
    except TimeoutError:
        await _refuse(ws, CLOSE_BAD_INIT, "init frame not received within 10 s")
        return None
    except WebSocketDisconnect:
        return None
    try:
        return PtyInit.model_validate_json(text)
    except ValidationError as exc:
        reason = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" if e["loc"] else e["msg"]
            for e in exc.errors()
        )
        await _refuse(ws, CLOSE_BAD_INIT, f"bad init frame: {reason}")
        return None


async def _client_to_agent(
    ws: WebSocket, session: AgentPty, touch: Callable[[], Awaitable[object]]
) -> None:
    while True:
        message = await ws.receive()
        if message["type"] == "websocket.disconnect":
            with contextlib.suppress(OrchardError):
                await session.send({"type": "close"})
            return
        raw = message.get("text") or (message.get("bytes") or b"").decode(errors="replace")
        try:
            frame = json.loads(raw)
        except ValueError:
            frame = None
        if not isinstance(frame, dict):
            await ws.send_json({"type": "error", "message": f"bad frame: {raw[:200]}"})
            continue
        await session.send(frame)
        await touch()


async def _agent_to_client(ws: WebSocket, session: AgentPty) -> None:
    while True:
        frame = await session.recv()
        if frame is None:
            return
        await ws.send_json(frame)


async def relay(
    ws: WebSocket,
    record: SandboxRecord,
    sandboxes: SandboxService,
    agents: AgentPool,
    *,
    revoked: asyncio.Event,
) -> None:
    """Run one terminal session for an accepted, authorised WebSocket, until either side
    ends it or ``revoked`` is set (the key was revoked: close 4403, and the terminal ends)."""
    init = await _read_init(ws)
    if init is None:
        return
    try:
        session = await agents.client(record).open_pty()
    except OrchardError as exc:
        await _refuse(ws, CLOSE_AGENT_UNAVAILABLE, exc.message)
        return

    def touch() -> Awaitable[object]:
        return sandboxes.touch(record.sandbox_id)

    try:
        await session.send(init.model_dump(exclude_none=True))
        async with sandboxes.in_use(record.sandbox_id):
            upstream = asyncio.create_task(_client_to_agent(ws, session, touch))
            downstream = asyncio.create_task(_agent_to_client(ws, session))
            revocation = asyncio.create_task(revoked.wait())
            done, pending = await asyncio.wait(
                (upstream, downstream, revocation), return_when=asyncio.FIRST_COMPLETED
            )
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            if revocation in done:
                await _refuse(ws, CLOSE_REVOKED, "the API key of this session was revoked")
            for task in done:
                if not task.cancelled() and task.exception() is not None:
                    error = task.exception()
                    if not isinstance(error, (WebSocketDisconnect, OrchardError)):
                        log.warning(
                            "pty relay ended with an error",
                            extra={"sandbox_id": record.sandbox_id, "error": repr(error)},
                        )
    finally:
        await session.close()
        if (
            ws.application_state != WebSocketState.DISCONNECTED
            and ws.client_state != WebSocketState.DISCONNECTED
        ):
            with contextlib.suppress(Exception):
                await ws.close(session.close_code or 1000)
