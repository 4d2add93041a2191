"""Snapshots, restore and fork: branching a sandbox's filesystem at any turn.

A snapshot is the sandbox's filesystem committed by the backend to an image (processes are not
carried over). It records its parent (the snapshot the source sandbox was itself restored from),
so snapshots form a tree. A restore is a new sandbox created from that image with the source's
resources, workdir, network setting, env and labels, returned once it is ready. A fork is one
snapshot and ``count`` concurrent restores.

Deleting is two steps: the record is marked deleted at once (by request or when its TTL runs
out), and the image is removed by :meth:`SnapshotService.collect` (every reaper pass) once no
live sandbox uses it and no restore from it is under way. Records of removed snapshots are
forgotten after the retention period, parents only after their children.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from datetime import datetime, timedelta
from typing import Any

from pydantic import ValidationError

from orchard_env.config import ServiceSettings
from orchard_env.errors import (
    Conflict,
    InvalidRequest,
    NotSupported,
    OrchardError,
    SandboxNotFound,
    SandboxNotReady,
    SnapshotNotFound,
)
from orchard_env.orchestrator.auth import Caller
from orchard_env.orchestrator.backends.base import Backend, Capability
from orchard_env.orchestrator.logs import isolated
from orchard_env.orchestrator.records import SandboxRecord, SnapshotRecord
from orchard_env.orchestrator.sandboxes import SandboxService, new_sandbox_id
from orchard_env.orchestrator.store import Store
from orchard_env.protocol import (
    CreateSandboxRequest,
    ForkFailure,
    ForkRequest,
    ForkResult,
    RestoreRequest,
    SandboxInfo,
    SandboxStatus,
    Snapshot,
    SnapshotDeleteResult,
    SnapshotList,
    SnapshotRequest,
    validation_message,
)

log = logging.getLogger(__name__)


def restore_request(**fields: Any) -> CreateSandboxRequest:
    """The create request of a restore: the snapshot's settings with the caller's additions,
    which together may break a rule each obeys alone (too many labels, say): a 400."""
    try:
        return CreateSandboxRequest(**fields)
    except ValidationError as exc:
        raise InvalidRequest(
            f"the restored sandbox would be invalid: {validation_message(list(exc.errors()))}"
        ) from exc


def new_snapshot_id() -> str:
    return "snap-" + secrets.token_hex(6)


class SnapshotService:
    def __init__(
        self,
        settings: ServiceSettings,
        store: Store,
        backend: Backend,
        sandboxes: SandboxService,
        clock: Callable[[], datetime],
    ) -> None:
        self.settings = settings
        self.store = store
        self.backend = backend
        self.sandboxes = sandboxes
        self.clock = clock
        self._restoring: Counter[str] = Counter()  # snapshot id -> restores under way
        self._lock = asyncio.Lock()  # deletes and collection, one at a time

    def _require_support(self) -> None:
        if Capability.SNAPSHOT not in self.backend.capabilities:
            raise NotSupported(
                f"the {self.backend.name} backend cannot snapshot sandboxes, so snapshot, "
                "restore and fork are not available on this service",
                hint="the local engine backend (ORCHARD_BACKEND=docker) supports them",
            )

    async def get_record(self, snapshot_id: str, caller: Caller) -> SnapshotRecord:
        record = await self.store.get_snapshot(snapshot_id)
        if record is None or not caller.can_see(record.owner):
            raise SnapshotNotFound(
                f"snapshot {snapshot_id} does not exist",
                hint="`orchard snapshot list` shows your snapshots",
            )
        return record

    async def get(self, snapshot_id: str, caller: Caller) -> Snapshot:
        return (await self.get_record(snapshot_id, caller)).to_wire()

    async def list(
        self,
        caller: Caller,
        *,
        labels: Mapping[str, str] | None = None,
        include_deleted: bool = False,
    ) -> SnapshotList:
        records = await self.store.list_snapshots(
            owner=caller.owner_filter, include_deleted=include_deleted
        )
        wanted = labels or {}
        return SnapshotList(
            snapshots=[
                record.to_wire()
                for record in records
                if all(record.labels.get(k) == v for k, v in wanted.items())
            ]
        )

    # --- snapshot ----------------------------------------------------------------------------

    async def snapshot(self, sandbox_id: str, request: SnapshotRequest, caller: Caller) -> Snapshot:
        self._require_support()
        source = await self.sandboxes.require_ready(sandbox_id, caller)
        record = await self._take(
            source, caller, name=request.name, labels=request.labels, ttl=request.ttl_seconds
        )
        return record.to_wire()

    async def _take(
        self,
        source: SandboxRecord,
        caller: Caller,
        *,
        name: str | None,
        labels: dict[str, str],
        ttl: int | None,
    ) -> SnapshotRecord:
        snapshot_id = new_snapshot_id()
        async with self.sandboxes.in_use(source.sandbox_id):  # not idle while it is committed
            image = await self.backend.snapshot(
                source.sandbox_id, snapshot_id, parent=source.source_snapshot
            )
        record = SnapshotRecord(
            snapshot_id=snapshot_id,
            name=name,
            labels=labels,
            owner=caller.owner,
            source_sandbox=source.sandbox_id,
            parent_snapshot=source.source_snapshot,
            image=image.ref,
            size_bytes=image.size_bytes,
            backend=self.backend.name,
            cpu=source.cpu,
            memory_bytes=source.memory_bytes,
            disk_bytes=source.disk_bytes,
            block_network=source.block_network,
            workdir=source.workdir,
            env=source.env,
            sandbox_labels=source.labels,
            tools=source.tools,
            model_gateway=None if source.model_gateway is None else source.model_gateway.to_spec(),
            created_at=self.clock(),
            ttl_seconds=ttl or self.settings.snapshot_ttl_seconds,
        )
        await self.store.insert_snapshot(record)
        log.info(
            "snapshot taken",
            extra={
                "snapshot_id": snapshot_id,
                "sandbox_id": source.sandbox_id,
                "parent": source.source_snapshot,
                "size_bytes": image.size_bytes,
            },
        )
        return record

    # --- restore and fork ----------------------------------------------------------------------

    async def restore(
        self, snapshot_id: str, request: RestoreRequest, caller: Caller
    ) -> SandboxInfo:
        self._require_support()
        return await self._restore(
            snapshot_id,
            caller,
            sandbox_id=request.sandbox_id,
            labels=request.labels,
            env=request.env,
            ready_timeout=request.timeout,
            ttl=request.ttl_seconds,
            idle=request.idle_timeout_seconds,
        )

    async def _restore(
        self,
        snapshot_id: str,
        caller: Caller,
        *,
        sandbox_id: str | None,
        labels: Mapping[str, str],
        env: Mapping[str, str] | None = None,
        ready_timeout: int | None = None,
        ttl: int | None = None,
        idle: int | None = None,
    ) -> SandboxInfo:
        """A ready sandbox from a snapshot. Counted as a user of the snapshot's image from
        before its record is read, so collection never removes the image under it."""
        self._restoring[snapshot_id] += 1
        try:
            snapshot = await self.get_record(snapshot_id, caller)
            if snapshot.deleted:
                raise SnapshotNotFound(
                    f"snapshot {snapshot_id} was deleted ({snapshot.deleted_reason})",
                    hint="`orchard snapshot list` shows the snapshots you can restore",
                )
            request = restore_request(
                image=snapshot.image,
                block_network=snapshot.block_network,
                sandbox_id=sandbox_id,
                cpu=snapshot.cpu,
                memory=snapshot.memory_bytes,
                disk=snapshot.disk_bytes,
                timeout=ready_timeout,
                labels={**snapshot.sandbox_labels, **labels},
                env={**snapshot.env, **(env or {})},
                workdir=snapshot.workdir,
                ttl_seconds=ttl,
                idle_timeout_seconds=idle,
                tools=snapshot.tools,
                model_gateway=snapshot.model_gateway,
            )
            created = await self.sandboxes.create(request, caller, source_snapshot=snapshot_id)
            seconds = ready_timeout or self.settings.ready_timeout_seconds
            info = await self.sandboxes.wait(created.sandbox_id, caller, seconds)
        finally:
            self._restoring[snapshot_id] -= 1
            if self._restoring[snapshot_id] <= 0:
                del self._restoring[snapshot_id]
        if info.status == SandboxStatus.FAILED:
            raise SandboxNotReady(
                f"sandbox {info.sandbox_id}, restored from snapshot {snapshot_id}, failed to "
                f"start: {info.status_message or 'no reason given'}",
                hint="the service log has more; the snapshot itself is unchanged",
            )
        if info.status != SandboxStatus.READY:
            raise SandboxNotFound(
                f"sandbox {info.sandbox_id}, restored from snapshot {snapshot_id}, was deleted "
                "while it started"
            )
        return info

    async def fork(self, sandbox_id: str, request: ForkRequest, caller: Caller) -> ForkResult:
        """Snapshot a sandbox, then restore it ``count`` times concurrently. Forks that fail
        are reported one by one in ``failures``; the others are ready."""
        self._require_support()
        source = await self.sandboxes.require_ready(sandbox_id, caller)
        ids = request.sandbox_ids or [new_sandbox_id() for _ in range(request.count)]
        # All the forks must fit the quotas, not the first few of them.
        await self.sandboxes.check_quota(caller, len(ids), source.cpu, source.memory_bytes)
        snapshot = await self._take(source, caller, name=None, labels={}, ttl=None)
        outcomes = await asyncio.gather(
            *(
                self._restore(
                    snapshot.snapshot_id, caller, sandbox_id=new_id, labels=request.labels
                )
                for new_id in ids
            ),
            return_exceptions=True,
        )
        result = ForkResult(snapshot=snapshot.to_wire(), sandboxes=[])
        for new_id, outcome in zip(ids, outcomes, strict=True):
            if isinstance(outcome, SandboxInfo):
                result.sandboxes.append(outcome)
            elif isinstance(outcome, OrchardError):
                result.failures.append(
                    ForkFailure(sandbox_id=new_id, code=outcome.code, message=outcome.message)
                )
            elif isinstance(outcome, Exception):
                log.error("fork failed", extra={"sandbox_id": new_id}, exc_info=outcome)
                result.failures.append(
                    ForkFailure(sandbox_id=new_id, code=OrchardError.code, message=str(outcome))
                )
            else:  # cancelled: the request itself is going away
                raise outcome
        log.info(
            "sandbox forked",
            extra={
                "sandbox_id": sandbox_id,
                "snapshot_id": snapshot.snapshot_id,
                "ready": len(result.sandboxes),
                "failed": len(result.failures),
            },
        )
        return result

    # --- delete and collection -----------------------------------------------------------------

    async def delete(
        self, snapshot_id: str, caller: Caller, *, recursive: bool = False
    ) -> SnapshotDeleteResult:
        """Delete a snapshot (with ``recursive``, its descendants too). One with children is
        refused otherwise, naming them. Images go now if unused, else at a later pass."""
        record = await self.get_record(snapshot_id, caller)
        if record.deleted:
            raise SnapshotNotFound(f"snapshot {snapshot_id} was already deleted")
        async with self._lock:
            children: dict[str, list[SnapshotRecord]] = {}
            for other in await self.store.list_snapshots():
                if other.parent_snapshot is not None:
                    children.setdefault(other.parent_snapshot, []).append(other)
            direct = children.get(snapshot_id, [])
            if direct and not recursive:
                names = ", ".join(child.snapshot_id for child in direct)
                raise Conflict(
                    f"snapshot {snapshot_id} has {len(direct)} child snapshot(s): {names}; "
                    "delete them first, or delete the whole subtree with recursive=true",
                    hint=f"`orchard snapshot tree {snapshot_id}` shows the subtree; "
                    f"`orchard snapshot rm --recursive {snapshot_id}` deletes it",
                )
            subtree = [record]
            for node in subtree:  # breadth first: parents before their children
                subtree.extend(children.get(node.snapshot_id, []))
            others = [node.snapshot_id for node in subtree if not caller.can_see(node.owner)]
            if others:
                raise Conflict(
                    f"snapshot {snapshot_id} has {len(others)} descendant snapshot(s) made with "
                    "other API keys; only an admin key can delete that subtree"
                )
            doomed = subtree[::-1]  # children before their parents
            await self._mark_deleted(doomed, "deleted by request")
            await self._remove_images(doomed)
        log.info("snapshots deleted", extra={"snapshot_ids": [n.snapshot_id for n in doomed]})
        return SnapshotDeleteResult(deleted=[node.snapshot_id for node in doomed])

    async def _mark_deleted(self, records: Iterable[SnapshotRecord], reason: str) -> None:
        now = self.clock()
        for record in records:
            record.deleted_at = now
            record.deleted_reason = reason
            await self.store.put_snapshot(record)

    async def _remove_images(self, records: Iterable[SnapshotRecord]) -> None:
        """Remove the images of deleted snapshots that nothing uses any more."""
        in_use = {
            sandbox.image
            for sandbox in await self.store.list_sandboxes(pooled=True)
            if sandbox.live
        }
        for record in records:
            if (
                record.image_removed_at is not None
                or record.image in in_use
                or self._restoring[record.snapshot_id]
            ):
                continue
            try:
                gone = await self.backend.delete_snapshot(record.image)
            except Exception as exc:
                log.warning(
                    "could not remove a snapshot's image; the next pass retries",
                    extra={"snapshot_id": record.snapshot_id, "error": str(exc)},
                )
                continue
            if gone:
                record.image_removed_at = self.clock()
                await self.store.put_snapshot(record)

    async def collect(self, now: datetime) -> None:
        """One garbage-collection pass: expire snapshots past their TTL, remove the images of
        deleted ones nothing uses any more, forget long-removed records."""
        async with self._lock:
            expired = []
            for record in await self.store.list_snapshots():
                expires_at = record.expires_at()
                if expires_at is not None and now >= expires_at:
                    expired.append(record)
            for record in expired:
                with isolated(log, "expiring a snapshot", snapshot_id=record.snapshot_id):
                    await self._mark_deleted(
                        [record],
                        f"expired: its lifetime of {record.ttl_seconds} s (ttl_seconds) ran out",
                    )
            pending = [
                record
                for record in await self.store.list_snapshots(include_deleted=True)
                if record.deleted and record.image_removed_at is None
            ]
            await self._remove_images(pending)
            cutoff = now - timedelta(seconds=self.settings.job_retention_seconds)
            purged = await self.store.purge_snapshots(cutoff)
        if expired or purged:
            log.info(
                "snapshots collected",
                extra={"expired": [r.snapshot_id for r in expired], "purged": purged},
            )
