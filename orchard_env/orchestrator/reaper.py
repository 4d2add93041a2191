"""The reaper: one loop that reconciles with the backend, probes the agents of ready
sandboxes, expires what should go (sandboxes, and snapshots with their images) and has the
warm pools replace theirs."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from datetime import datetime, timedelta

from orchard_env.config import ServiceSettings
from orchard_env.orchestrator.health import AgentHealth
from orchard_env.orchestrator.logs import isolated
from orchard_env.orchestrator.pools import PoolService
from orchard_env.orchestrator.sandboxes import SandboxService
from orchard_env.orchestrator.snapshots import SnapshotService
from orchard_env.orchestrator.store import Store

log = logging.getLogger(__name__)


class Reaper:
    def __init__(
        self,
        settings: ServiceSettings,
        store: Store,
        sandboxes: SandboxService,
        snapshots: SnapshotService,
        health: AgentHealth,
        pools: PoolService,
        clock: Callable[[], datetime],
    ) -> None:
        self.settings = settings
        self.store = store
        self.sandboxes = sandboxes
        self.snapshots = snapshots
        self.health = health
        self.pools = pools
        self.clock = clock

    async def run_pass(self, now: datetime | None = None) -> None:
        """One pass: reconcile; agent probes; TTL, idle and readiness expiry; pool refill;
        snapshot collection; purge old jobs and records."""
        now = now or self.clock()
        # Each step on its own: a failing one is logged and the others still run.
        with isolated(log, "reconciliation"):
            await self.sandboxes.reconcile()
        with isolated(log, "agent health probes"):
            await self.health.probe_all()
        with isolated(log, "sandbox expiry"):
            await self.sandboxes.expire(now)
        with isolated(log, "pool refill"):
            await self.pools.wake_all()
        with isolated(log, "snapshot collection"):
            await self.snapshots.collect(now)
        with isolated(log, "purging old records"):
            await self._purge(now)

    async def _purge(self, now: datetime) -> None:
        cutoff = now - timedelta(seconds=self.settings.job_retention_seconds)
        purged_jobs = await self.store.purge_jobs(cutoff)
        purged_sandboxes = await self.store.purge_sandboxes(cutoff)
        if purged_jobs or purged_sandboxes:
            log.info(
                "purged old records",
                extra={"jobs": purged_jobs, "sandboxes": purged_sandboxes},
            )

    async def run_forever(self) -> None:
        while True:
            await asyncio.sleep(self.settings.reap_interval_seconds)
            try:
                await self.run_pass()
            except Exception:
                log.exception("reaper pass failed; retrying at the next interval")
