"""Reading a sandbox's recorded model calls back: a page, or NDJSON that follows the calls
as they are recorded until the sandbox's gateway closes."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

from orchard_env.orchestrator.gateway.proxy import ModelGateway
from orchard_env.orchestrator.store import Store

PAGE = 200
FOLLOW_POLL_SECONDS = 5.0  # a missed wake-up costs at most this much delay


async def list_calls(
    store: Store, sandbox_id: str, trajectory_id: str | None, after: int, limit: int
) -> list[dict[str, Any]]:
    rows = await store.list_model_calls(
        sandbox_id, trajectory_id=trajectory_id, after=after, limit=limit
    )
    return [_with_cursor(cursor, text) for cursor, text in rows]


def _with_cursor(cursor: int, text: str) -> dict[str, Any]:
    record: dict[str, Any] = json.loads(text)
    record["cursor"] = cursor
    return record


async def follow_calls(
    store: Store,
    gateway: ModelGateway,
    sandbox_id: str,
    trajectory_id: str | None,
    after: int,
    follow: bool,
) -> AsyncIterator[bytes]:
    """NDJSON lines of the calls after ``after``; with ``follow``, new ones as they come,
    until the sandbox's gateway is closed (the sandbox ended) and every call was sent."""
    condition = gateway.condition(sandbox_id)
    while True:
        rows = await store.list_model_calls(
            sandbox_id, trajectory_id=trajectory_id, after=after, limit=PAGE
        )
        for cursor, text in rows:
            after = cursor
            yield json.dumps(_with_cursor(cursor, text)).encode() + b"\n"
        if len(rows) == PAGE:
            continue
        if not follow or not gateway.attached(sandbox_id):
            return
        async with condition:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(condition.wait(), FOLLOW_POLL_SECONDS)
