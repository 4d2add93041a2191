"""The reaper: one loop that reconciles with the backend, expires what should go
(sandboxes, and snapshots with their images) and has the warm pools replace theirs."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from datetime import datetime, timedelta

from orchard_env.config import ServiceSettings
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
        pools: PoolService,
        clock: Callable[[], datetime],
    ) -> None:
        self.settings = settings
        self.store = store
        self.sandboxes = sandboxes
        self.snapshots = snapshots
        self.pools = pools
        self.clock = clock

    async def run_pass(self, now: datetime | None = None) -> None:
        """One pass: reconcile; TTL, idle and readiness expiry; pool refill; snapshot
        collection; purge old jobs and records."""
        now = now or self.clock()
        await self.sandboxes.reconcile()
        await self.sandboxes.expire(now)
        await self.pools.wake_all()
        await self.snapshots.collect(now)
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
