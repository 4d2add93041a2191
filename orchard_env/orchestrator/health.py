"""Agent health: a sandbox whose agent is gone, or was tampered with, is failed, not ``ready``.

Two sources: every :class:`~orchard_env.errors.AgentTampered` an agent client raises (an
impostor, a planted symlink, a reply over the protocol's bounds) fails its sandbox at once;
and a probe on a fresh connection (each reaper pass, and whenever a request could not reach
the agent) fails a ready sandbox whose agent socket is gone or refuses connections. An agent
that is merely slow to answer (a sandbox under load) is left alone.
"""

from __future__ import annotations

import asyncio
import logging

from orchard_env.errors import AgentTampered
from orchard_env.orchestrator.agents import AgentPool
from orchard_env.orchestrator.backends.base import SandboxState
from orchard_env.orchestrator.records import SandboxRecord
from orchard_env.orchestrator.sandboxes import SandboxService, dead_reason
from orchard_env.orchestrator.store import Store
from orchard_env.protocol import SandboxStatus

log = logging.getLogger(__name__)

PROBE_TIMEOUT_SECONDS = 5.0
PROBE_CONCURRENCY = 16
PROBES_PER_PASS = 1000
"""At most this many agents are probed in one reaper pass, those probed longest ago first:
the pass stays bounded with tens of thousands of sandboxes (each is then probed every
``ready sandboxes / PROBES_PER_PASS`` passes), and every one is probed each pass below it."""


class AgentHealth:
    def __init__(self, store: Store, sandboxes: SandboxService, agents: AgentPool) -> None:
        self.store = store
        self.sandboxes = sandboxes
        self._pending: set[asyncio.Task[None]] = set()
        self._probed: dict[str, int] = {}  # sandbox id -> the pass that last probed it
        self._passes = 0
        agents.on_tampered = self.tampered

    def tampered(self, sandbox_id: str, error: AgentTampered) -> None:
        """Fail the sandbox (from a task: the caller is in the middle of a request)."""
        log.warning("agent tampered with", extra={"sandbox_id": sandbox_id, "error": str(error)})
        task = asyncio.get_running_loop().create_task(
            self._fail(sandbox_id, f"its agent failed an integrity check: {error.message}")
        )
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _fail(self, sandbox_id: str, reason: str) -> None:
        await self.sandboxes.end(sandbox_id, SandboxStatus.FAILED, reason)

    async def check(self, record: SandboxRecord) -> bool:
        """Probe a ready sandbox's agent; False (and the sandbox failed) if it is gone."""
        if record.status != SandboxStatus.READY or record.agent is None:
            return record.status == SandboxStatus.READY
        try:
            gone = await self.sandboxes.agents.client(record).probe(PROBE_TIMEOUT_SECONDS)
        except AgentTampered:
            return False  # reported through tampered()
        if gone is None:
            return True
        reason = f"its agent is gone ({gone}): its socket was removed or the agent died"
        try:
            found = await self.sandboxes.backend.inspect(record.sandbox_id)
        except Exception:  # the engine's view is a better reason, not a required one
            found = None
        if found is not None and found.state in (SandboxState.EXITED, SandboxState.FAILED):
            reason = dead_reason(found, record.memory_bytes)
        await self._fail(record.sandbox_id, reason)
        return False

    async def probe_all(self) -> None:
        """Check the agents of ready sandboxes (the reaper's pass): every one, or the
        :data:`PROBES_PER_PASS` probed longest ago."""
        self._passes += 1
        limit = asyncio.Semaphore(PROBE_CONCURRENCY)

        async def one(record: SandboxRecord) -> None:
            async with limit:
                try:
                    await self.check(record)
                except Exception as exc:
                    log.warning(
                        "agent probe failed",
                        extra={"sandbox_id": record.sandbox_id, "error": str(exc)},
                    )

        ready = [
            r
            for r in await self.store.list_sandboxes(pooled=True)
            if r.status == SandboxStatus.READY
        ]
        self._probed = {r.sandbox_id: self._probed.get(r.sandbox_id, 0) for r in ready}
        if len(ready) > PROBES_PER_PASS:
            ready.sort(key=lambda r: self._probed[r.sandbox_id])
            del ready[PROBES_PER_PASS:]
        for record in ready:
            self._probed[record.sandbox_id] = self._passes
        await asyncio.gather(*(one(r) for r in ready))

    async def close(self) -> None:
        await asyncio.gather(*self._pending, return_exceptions=True)
