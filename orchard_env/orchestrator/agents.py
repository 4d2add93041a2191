"""One :class:`AgentClient` per sandbox, reused across requests and closed with the sandbox."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from orchard_env.agent.client import AgentClient
from orchard_env.errors import AgentTampered, AgentUnavailable
from orchard_env.orchestrator.backends.base import AgentEndpoint
from orchard_env.orchestrator.gateway.harness import gateway_enrollment
from orchard_env.orchestrator.records import SandboxRecord


class AgentPool:
    def __init__(self) -> None:
        self._clients: dict[str, tuple[AgentEndpoint, AgentClient]] = {}
        # Clients replaced because a sandbox's endpoint changed; streams may still use them.
        self._stale: dict[str, list[AgentClient]] = {}
        self.on_tampered: Callable[[str, AgentTampered], None] | None = None
        """Hears (sandbox id, error) of every integrity failure of an agent."""

    def client(self, record: SandboxRecord) -> AgentClient:
        """The sandbox's client, made on first use (or again if its endpoint changed)."""
        endpoint = record.agent
        if endpoint is None:
            raise AgentUnavailable(
                f"sandbox {record.sandbox_id} has no agent endpoint yet (status {record.status})"
            )
        cached = self._clients.get(record.sandbox_id)
        if cached is not None:
            if cached[0] == endpoint:
                return cached[1]
            self._stale.setdefault(record.sandbox_id, []).append(cached[1])
        env, model = record.env, None
        if record.model_gateway is not None:
            # An agent on TCP cannot dial out (Kubernetes): the orchestrator parks connections.
            parked = endpoint.uds is None
            env, model = gateway_enrollment(record.model_gateway, record.env, parked=parked)
        client = AgentClient(
            token=endpoint.token,
            uds=endpoint.uds,
            base_url=None if endpoint.uds is not None else endpoint.base_url(),
            env=env,
            model=model,
            on_tampered=lambda error: self.tampered(record.sandbox_id, error),
        )
        self._clients[record.sandbox_id] = (endpoint, client)
        return client

    def tampered(self, sandbox_id: str, error: AgentTampered) -> None:
        """Report an integrity failure of a sandbox's agent (to :attr:`on_tampered`)."""
        if self.on_tampered is not None:
            self.on_tampered(sandbox_id, error)

    async def drop(self, sandbox_id: str) -> None:
        clients = self._stale.pop(sandbox_id, [])
        cached = self._clients.pop(sandbox_id, None)
        if cached is not None:
            clients.append(cached[1])
        await asyncio.gather(*(self._close(client) for client in clients))

    async def close(self) -> None:
        await asyncio.gather(*(self.drop(sandbox_id) for sandbox_id in list(self._clients)))
        await asyncio.gather(*(self.drop(sandbox_id) for sandbox_id in list(self._stale)))

    @staticmethod
    async def _close(client: AgentClient) -> None:
        with contextlib.suppress(Exception):
            await client.aclose()
