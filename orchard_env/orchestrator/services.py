"""Everything a request handler needs, built once per app in its lifespan."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

from orchard_env.config import ServiceSettings
from orchard_env.orchestrator.agents import AgentPool
from orchard_env.orchestrator.backends.base import Backend
from orchard_env.orchestrator.files import FileService
from orchard_env.orchestrator.gateway.endpoints import load_endpoints
from orchard_env.orchestrator.gateway.proxy import ModelGateway
from orchard_env.orchestrator.health import AgentHealth
from orchard_env.orchestrator.jobs import JobService
from orchard_env.orchestrator.pools import PoolService
from orchard_env.orchestrator.reaper import Reaper
from orchard_env.orchestrator.revocation import KeySessions
from orchard_env.orchestrator.sandboxes import SandboxService
from orchard_env.orchestrator.snapshots import SnapshotService
from orchard_env.orchestrator.store import Store


@dataclass
class Orchard:
    settings: ServiceSettings
    store: Store
    backend: Backend
    agents: AgentPool
    gateway: ModelGateway
    sandboxes: SandboxService
    jobs: JobService
    snapshots: SnapshotService
    pools: PoolService
    files: FileService
    health: AgentHealth
    reaper: Reaper
    sessions: KeySessions
    clock: Callable[[], datetime]

    @classmethod
    def build(
        cls,
        settings: ServiceSettings,
        store: Store,
        backend: Backend,
        clock: Callable[[], datetime],
    ) -> Orchard:
        agents = AgentPool()
        gateway = ModelGateway(
            load_endpoints(settings.model_endpoints_file), store, settings.sandboxes_dir
        )
        sandboxes = SandboxService(settings, store, backend, agents, clock, gateway)
        health = AgentHealth(store, sandboxes, agents)
        sessions = KeySessions(store)
        jobs = JobService(settings, store, sandboxes, agents, health, sessions, clock)
        snapshots = SnapshotService(settings, store, backend, sandboxes, clock)
        pools = PoolService(settings, store, sandboxes, clock)
        return cls(
            settings=settings,
            store=store,
            backend=backend,
            agents=agents,
            gateway=gateway,
            sandboxes=sandboxes,
            jobs=jobs,
            snapshots=snapshots,
            pools=pools,
            files=FileService(sandboxes, agents),
            health=health,
            reaper=Reaper(settings, store, sandboxes, snapshots, health, pools, clock),
            sessions=sessions,
            clock=clock,
        )

    async def start(self) -> None:
        """Adopt what runs, fail what is gone, refill the warm pools, then pick up unfinished
        jobs."""
        await self.sandboxes.reconcile()
        await self.pools.start()
        await self.jobs.resume()

    async def stop(self) -> None:
        """Stop following jobs and probes and filling pools; the sandboxes and their commands
        keep running."""
        await self.pools.close()
        await self.sessions.close()
        await self.jobs.close()
        await self.sandboxes.close()
        await self.health.close()
        await self.agents.close()
        await self.gateway.close()
