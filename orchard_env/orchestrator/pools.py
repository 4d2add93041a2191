"""Warm pools: ready sandboxes of one spec, kept by the operator's size, claimed by creates.

* A pool's definition lives in the store; its sandboxes are ordinary sandbox records that
  name the pool (``SandboxRecord.pool``) until a create claims one. So the reaper, the
  reconciliation and a restart treat them like any sandbox: they expire at the pool's TTL,
  a dead one fails, a restart finds (or adopts) them; the filler makes their replacements.
* A waiting sandbox belongs to nobody: no usage row (nothing billed), invisible to every
  key, not even an admin may exec in it. A claim (:meth:`SandboxService.create`) makes it
  the caller's under the service's one lock, so it is handed out once; it is never put back.
* The filler: one task per pool that tops it up to its size (a few creations at a time) and
  trims it when it shrinks; woken after claims (once they pause for a second), a resize, and
  every reaper interval.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from datetime import datetime

from orchard_env.config import ServiceSettings
from orchard_env.errors import Conflict, PoolNotFound
from orchard_env.orchestrator.records import PoolRecord, SandboxRecord
from orchard_env.orchestrator.sandboxes import SandboxService
from orchard_env.orchestrator.store import Store
from orchard_env.protocol import (
    PoolCreateRequest,
    PoolInfo,
    PoolList,
    SandboxStatus,
)

log = logging.getLogger(__name__)

FILL_CONCURRENCY = 4
"""Pooled sandboxes one pool starts at once while it refills."""
DEFAULT_POOL_TTL_SECONDS = 3600
CLOSE_WAIT_SECONDS = 30.0
REFILL_AFTER_CLAIM_SECONDS = 1.0
"""Claims are refilled once a pool has had no claim for this long (at most
REFILL_AT_MOST_SECONDS after the first): the claimed sandboxes' first commands do not compete
with container starts, and a burst of claims is refilled in one pass."""
REFILL_AT_MOST_SECONDS = 10.0


class PoolService:
    def __init__(
        self,
        settings: ServiceSettings,
        store: Store,
        sandboxes: SandboxService,
        clock: Callable[[], datetime],
    ) -> None:
        self.settings = settings
        self.store = store
        self.sandboxes = sandboxes
        self.clock = clock
        self._fillers: dict[str, asyncio.Task[None]] = {}
        self._again: set[str] = set()
        self._errors: dict[str, str] = {}
        self._closing = False
        self._claims: dict[str, tuple[float, float]] = {}  # pool -> (first, last) unrefilled
        sandboxes.on_claimed = self._claimed

    # --- definitions -------------------------------------------------------------------------

    async def create(self, request: PoolCreateRequest) -> PoolInfo:
        cpu, memory = self.sandboxes.resolve_size(request.cpu, request.memory)
        record = PoolRecord(
            name=request.name,
            image=request.image,
            cpu=cpu,
            memory_bytes=memory,
            block_network=request.block_network,
            workdir=request.workdir or self.settings.default_workdir,
            env=request.env,
            size=request.size,
            ttl_seconds=request.ttl_seconds
            or self.settings.sandbox_ttl_seconds
            or DEFAULT_POOL_TTL_SECONDS,
            created_at=self.clock(),
        )
        exists = Conflict(
            f"pool {request.name} already exists",
            hint="pick another name, or resize it with `orchard pool resize`",
        )
        if await self.store.get_pool(request.name) is not None:
            raise exists
        clash = self.sandboxes.pools_by_spec.get(record.spec_key())
        if clash is not None:
            raise Conflict(
                f"pool {clash} already serves this spec",
                hint=f"resize it: `orchard pool resize {clash} <size>`",
            )
        if not await self.store.insert_pool(record):
            raise exists
        self.sandboxes.pools_by_spec[record.spec_key()] = record.name
        log.info("pool created", extra={"pool": record.name, "size": record.size})
        self.wake(record.name)
        return await self._info(record)

    async def _get(self, name: str) -> PoolRecord:
        record = await self.store.get_pool(name)
        if record is None:
            raise PoolNotFound(
                f"pool {name} does not exist", hint="`orchard pool list` shows the pools"
            )
        return record

    async def get(self, name: str) -> PoolInfo:
        return await self._info(await self._get(name))

    async def list_pools(self) -> PoolList:
        return PoolList(
            pools=[await self._info(record) for record in await self.store.list_pools()]
        )

    async def resize(self, name: str, size: int) -> PoolInfo:
        record = (await self._get(name)).model_copy(update={"size": size})
        await self.store.put_pool(record)
        log.info("pool resized", extra={"pool": name, "size": size})
        self.wake(name)
        return await self._info(record)

    async def delete(self, name: str) -> PoolInfo:
        """Remove the pool and the sandboxes waiting in it (claimed ones are not its any more)."""
        record = await self._get(name)
        await self.store.delete_pool(name)
        self.sandboxes.pools_by_spec.pop(record.spec_key(), None)
        filler = self._fillers.get(name)
        if filler is not None:  # it stops once the creations under way are done
            await self._stop([filler])
        info = await self._info(record)
        await self._drop_members(name, "its warm pool was removed")
        self._errors.pop(name, None)
        log.info("pool deleted", extra={"pool": name})
        return info

    async def _members(self, name: str) -> list[SandboxRecord]:
        return [m for m in await self.store.list_sandboxes(pooled=name) if m.live]

    async def _info(self, record: PoolRecord) -> PoolInfo:
        members = await self._members(record.name)
        ready = sum(1 for m in members if m.status == SandboxStatus.READY)
        return record.to_info(
            ready=ready, starting=len(members) - ready, error=self._errors.get(record.name)
        )

    async def _drop_members(self, name: str, message: str) -> None:
        for member in await self._members(name):
            await self._end_member(member, message)

    async def _end_member(self, member: SandboxRecord, message: str) -> None:
        pool = member.pool
        await self.sandboxes.end(
            member.sandbox_id,
            SandboxStatus.DELETED,
            message,
            when=lambda current: current.pool == pool,
        )

    # --- filling -----------------------------------------------------------------------------

    async def start(self) -> None:
        """Load the pools (after reconciliation found their sandboxes) and start filling;
        sandboxes of pools that no longer exist go."""
        pools = {record.name: record for record in await self.store.list_pools()}
        self.sandboxes.pools_by_spec = {record.spec_key(): name for name, record in pools.items()}
        for member in await self.store.list_sandboxes(pooled=True):
            if member.live and member.pool is not None and member.pool not in pools:
                await self._end_member(member, "its warm pool was removed")
        for name in pools:
            self.wake(name)

    def _claimed(self, name: str) -> None:
        loop = asyncio.get_running_loop()
        now = loop.time()
        first, _ = self._claims.get(name, (now, now))
        self._claims[name] = (first, now)
        if first == now:
            loop.call_later(REFILL_AFTER_CLAIM_SECONDS, self._refill_after_claims, name)

    def _refill_after_claims(self, name: str) -> None:
        loop = asyncio.get_running_loop()
        first, last = self._claims[name]
        quiet_at = min(last + REFILL_AFTER_CLAIM_SECONDS, first + REFILL_AT_MOST_SECONDS)
        if loop.time() < quiet_at:
            loop.call_later(quiet_at - loop.time(), self._refill_after_claims, name)
            return
        del self._claims[name]
        self.wake(name)

    def wake(self, name: str) -> None:
        """Top ``name`` up (now, or once its running pass ends)."""
        if self._closing:
            return
        filler = self._fillers.get(name)
        if filler is not None and not filler.done():
            self._again.add(name)
            return
        self._fillers[name] = asyncio.create_task(self._fill(name), name=f"pool-{name}")

    async def wake_all(self) -> None:
        for record in await self.store.list_pools():
            self.wake(record.name)

    async def _fill(self, name: str) -> None:
        try:
            while True:
                self._again.discard(name)
                record = await self.store.get_pool(name)
                if record is None or self._closing:
                    return
                members = await self._members(name)
                missing = record.size - len(members)
                if missing < 0:
                    await self._trim(members, -missing)
                elif missing > 0:
                    if await self._top_up(record, min(missing, FILL_CONCURRENCY)):
                        continue  # until it is full
                    return  # a creation failed: the next wake (reaper interval) retries
                if name not in self._again:
                    return
        except Exception:
            log.exception("filling a pool failed; the next pass retries", extra={"pool": name})
        finally:
            if self._fillers.get(name) is asyncio.current_task():
                del self._fillers[name]

    async def _top_up(self, record: PoolRecord, count: int) -> bool:
        """Start ``count`` sandboxes for the pool; False if one could not be started."""
        results = await asyncio.gather(
            *(self.sandboxes.create_pooled(record) for _ in range(count)), return_exceptions=True
        )
        failures = [r for r in results if isinstance(r, BaseException)]
        for failure in failures:
            if not isinstance(failure, Exception):  # cancellation and the like
                raise failure
        if failures:
            self._errors[record.name] = f"could not start a sandbox: {failures[0]}"
            log.warning(
                "a pool could not start a sandbox",
                extra={"pool": record.name, "error": str(failures[0])},
            )
            return False
        self._errors.pop(record.name, None)
        return True

    async def _trim(self, members: list[SandboxRecord], count: int) -> None:
        """End ``count`` members: those still starting first, then the oldest."""
        members.sort(key=lambda m: (m.status == SandboxStatus.READY, m.created_at))
        for member in members[:count]:
            await self._end_member(member, "its warm pool shrank")

    async def close(self) -> None:
        """Stop filling: creations under way finish (a container started for a cancelled one
        would wait for the next start's reconciliation), for at most ``CLOSE_WAIT_SECONDS``."""
        self._closing = True
        await self._stop(list(self._fillers.values()))
        self._fillers.clear()

    @staticmethod
    async def _stop(tasks: list[asyncio.Task[None]]) -> None:
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=CLOSE_WAIT_SECONDS)
            for task in pending:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
