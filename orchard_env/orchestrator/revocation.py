"""Long-lived requests end when their API key is revoked.

A PTY session, a streamed exec or a wait (an exec that waits for its command, or
``GET /jobs/{id}/wait``) is authenticated once, when it opens. :class:`KeySessions` keeps an
event per open session, by key, and sets it when the key is revoked: at once when the
revocation goes through this service (``DELETE /keys/{id}``), and within
:data:`REVOCATION_POLL_SECONDS` when another process writes it to the store (another
orchestrator on the same database). The session then ends with an error naming the
revocation; the command it was following runs on.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from orchard_env.errors import PermissionDenied
from orchard_env.orchestrator.auth import Caller
from orchard_env.orchestrator.keys import revoked_message
from orchard_env.orchestrator.store import Store

_T = TypeVar("_T")

REVOCATION_POLL_SECONDS = 1.0


class KeySessions:
    def __init__(self, store: Store, *, poll_seconds: float = REVOCATION_POLL_SECONDS) -> None:
        self._store = store
        self._poll_seconds = poll_seconds
        self._open: dict[str, set[asyncio.Event]] = {}
        self._watcher: asyncio.Task[None] | None = None

    @contextlib.asynccontextmanager
    async def hold(
        self, caller: Caller, event: asyncio.Event | None = None
    ) -> AsyncIterator[asyncio.Event]:
        """An event (``event``, else a new one) set when ``caller``'s key is revoked, for as
        long as the block runs (never set when authentication is off)."""
        event = asyncio.Event() if event is None else event
        key_id = caller.key_id
        if key_id is None:
            yield event
            return
        self._open.setdefault(key_id, set()).add(event)
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.create_task(self._watch(), name="key-revocations")
        try:
            yield event
        finally:
            events = self._open.get(key_id)
            if events is not None:
                events.discard(event)
                if not events:
                    del self._open[key_id]

    async def unless_revoked(self, caller: Caller, waiting: Awaitable[_T]) -> _T:
        """What ``waiting`` returns, unless ``caller``'s key is revoked first: then it is
        cancelled and :class:`~orchard_env.errors.PermissionDenied` raised. ``waiting`` must
        be safe to cancel (it only waits: nothing it started is lost)."""
        # Awaited in this task, which the revocation cancels (as asyncio.timeout does): no
        # task of its own and none waiting on the event, on every exec that waits.
        task = asyncio.current_task()
        assert task is not None
        async with self.hold(caller, _Cancelling(task)) as revoked:
            try:
                return await waiting
            except asyncio.CancelledError:
                if revoked.is_set() and task.uncancel() == 0:
                    raise PermissionDenied(revoked_message(caller.key_id)) from None
                raise  # cancelled by someone else too

    def revoked(self, key_id: str) -> None:
        """End every open session of ``key_id``."""
        for event in self._open.pop(key_id, set()):
            event.set()

    async def _watch(self) -> None:
        """Notice revocations written by other processes, while sessions are open."""
        while self._open:
            await asyncio.sleep(self._poll_seconds)
            for key_id in list(self._open):
                record = await self._store.get_key(key_id)
                if record is None or record.revoked_at is not None:
                    self.revoked(key_id)

    async def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
            self._watcher = None


class _Cancelling(asyncio.Event):
    """An event that, once set, also cancels ``task``."""

    def __init__(self, task: asyncio.Task[Any]) -> None:
        super().__init__()
        self._task = task

    def set(self) -> None:
        if not self.is_set():
            super().set()
            self._task.cancel()
