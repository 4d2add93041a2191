"""The relay path to a sandbox whose agent listens on TCP and cannot dial out (Kubernetes):
the orchestrator keeps a few connections parked at the agent (:func:`orchard_env.agent.
relay.park`), each taken by the next harness connection to ``127.0.0.1:4000`` in the
sandbox, and hands each taken one to the gateway as if it came in on the sandbox's socket.

Bounds: :data:`PARKED` connections wait at the agent at once, and parked plus taken ones
never exceed the gateway's per-sandbox limit, so a sandbox flooding its loopback port makes
the orchestrator open no more (its extra connections get the agent's 503). A parked
connection that fails is opened again after a growing delay; one whose answer lacks the
agent's proof is reported (the sandbox is failed) and never used.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from orchard_env.agent import peer, relay
from orchard_env.errors import AgentTampered, AgentUnavailable
from orchard_env.orchestrator.backends.base import AgentEndpoint
from orchard_env.orchestrator.gateway import wire

log = logging.getLogger(__name__)

PARKED = 4
"""Connections kept waiting at the agent: as many harness connections as this can start at
once without waiting for a round trip to the orchestrator."""
RETRY_DELAYS = (0.1, 0.5, 1.0, 2.0, 5.0)
"""Between attempts to park at an agent that cannot be reached (the last one repeats)."""

Serve = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
Tampered = Callable[[AgentTampered], None]


class Parks:
    """Connections parked at one sandbox's agent, kept until :meth:`close`."""

    def __init__(
        self, sandbox_id: str, agent: AgentEndpoint, serve: Serve, tampered: Tampered, limit: int
    ) -> None:
        """``serve`` takes each connection a harness took (and closes it); ``tampered``
        hears of an answer without the agent's proof; ``limit``: parked and taken
        connections at most."""
        if agent.host is None or agent.port is None:
            raise ValueError(f"sandbox {sandbox_id}: parks need an agent on TCP, not {agent}")
        self.sandbox_id = sandbox_id
        self._host, self._port, self._key = agent.host, agent.port, agent.token.encode()
        self._serve = serve
        self._report = tampered
        self._slots = asyncio.Semaphore(limit)
        self._tasks: set[asyncio.Task[None]] = set()
        for _ in range(PARKED):
            self._spawn(self._keep())

    def _spawn(self, coro: Awaitable[None]) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _tampered(self, message: str) -> AgentTampered:
        error = peer.tampered_error(f"{self._host}:{self._port}", message)
        self._report(error)
        return error

    async def _keep(self) -> None:
        """Keep one connection parked: again after each one a harness took, while the
        sandbox has room for one more connection."""
        failures = 0
        while True:
            await self._slots.acquire()
            try:
                reader, writer = await relay.park(
                    self._host, self._port, self._key, self._tampered, limit=wire.MAX_LINE
                )
            except AgentTampered:
                self._slots.release()
                return  # reported: the sandbox is failed, and nothing here is trusted
            except AgentUnavailable as exc:
                log.info(
                    "could not park a model relay connection",
                    extra={"sandbox_id": self.sandbox_id, "error": exc.message},
                )
                taken = False
            else:
                taken = await self._wait(reader, writer)
            if taken:
                failures = 0
                continue
            self._slots.release()
            await asyncio.sleep(RETRY_DELAYS[min(failures, len(RETRY_DELAYS) - 1)])
            failures += 1

    async def _wait(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Until a harness takes the parked connection (then served, True) or it ends."""
        taken = False
        try:
            taken = await relay.paired(reader)
        finally:
            if taken:
                self._spawn(self._taken(reader, writer))
            else:
                writer.close()
        return taken

    async def _taken(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await self._serve(reader, writer)
        finally:
            writer.close()
            self._slots.release()

    async def close(self) -> None:
        """Close every parked connection and every one a harness took."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        with contextlib.suppress(Exception):
            await asyncio.gather(*tasks, return_exceptions=True)
