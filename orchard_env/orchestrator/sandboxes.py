"""Sandbox lifecycle: create, readiness, activity, delete, reconciliation and expiry.

Rules that keep state and containers consistent:

* The record is written (status ``pending``) before the backend creates the container, and the
  container carries the record as an annotation: a crash at any point leaves either a record
  that reconciliation fails ("its container no longer exists") or a container it adopts.
* A container without a record is adopted, never deleted: losing state never kills a live
  sandbox. Only containers whose record says deleted or failed are removed.
* Every status change goes through :meth:`SandboxService._transition` (one lock, re-read,
  check, write), so a readiness probe, a delete and the reaper cannot overwrite each other.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import secrets
from collections import Counter
from collections.abc import AsyncIterator, Callable, Collection, Hashable
from datetime import datetime, timedelta
from typing import Any

from pydantic import ValidationError

from orchard_env.config import ServiceSettings
from orchard_env.errors import (
    InvalidRequest,
    LimitExceeded,
    QuotaExceeded,
    SandboxExists,
    SandboxNotFound,
    SandboxNotReady,
    Timeout,
)
from orchard_env.orchestrator.agents import AgentPool
from orchard_env.orchestrator.auth import Caller
from orchard_env.orchestrator.backends.base import (
    Backend,
    BackendSandbox,
    SandboxSpec,
    SandboxState,
    not_your_snapshot,
)
from orchard_env.orchestrator.gateway.proxy import ModelGateway
from orchard_env.orchestrator.logs import isolated
from orchard_env.orchestrator.records import (
    LIVE_STATUSES,
    GatewayRecord,
    PoolRecord,
    SandboxRecord,
    pool_key,
)
from orchard_env.orchestrator.store import Store
from orchard_env.protocol import (
    CreateSandboxRequest,
    DeleteResponse,
    HeartbeatResponse,
    ModelGatewaySpec,
    SandboxInfo,
    SandboxList,
    SandboxStatus,
    check_sandbox_id,
)
from orchard_env.quantities import format_memory, parse_memory, sandbox_cpu, sandbox_memory

log = logging.getLogger(__name__)

Clock = Callable[[], datetime]

READY_GATE_SECONDS = 15.0
"""How long exec, files and PTY wait for a pending sandbox before answering 409."""
TOUCH_PERSIST_SECONDS = 5.0
"""Activity is written at most this often per sandbox (heartbeats always write)."""
CONTAINER_CHECK_MAX_SECONDS = 5.0
"""While a sandbox starts, the longest its container goes uninspected."""
_DEAD_STATES = (SandboxState.EXITED, SandboxState.FAILED)
MEMORY_PER_PID = 1024 * 1024
"""A sandbox may run one process per MiB of its memory limit (at least MIN_PIDS, at most the
``pids_limit`` setting), so a fork bomb runs out of process slots before it runs the sandbox
out of memory and starves the agent."""
MIN_PIDS = 128


def pids_for(memory_bytes: int, ceiling: int) -> int:
    """The process limit that fits a sandbox's memory limit (see :data:`MEMORY_PER_PID`)."""
    return min(ceiling, max(MIN_PIDS, memory_bytes // MEMORY_PER_PID))


SETTLED_STATUSES = frozenset({SandboxStatus.READY, SandboxStatus.FAILED, SandboxStatus.DELETED})


def new_sandbox_id() -> str:
    return "sb-" + secrets.token_hex(6)


def command_oom_reason(memory_bytes: int) -> str:
    """A job's error when the OOM killer ended its command (the sandbox lives on)."""
    return (
        "OOMKilled: the command was killed for using more than the sandbox's memory limit of "
        f"{format_memory(memory_bytes)}; give it more with `memory` at create"
    )


def dead_reason(found: BackendSandbox, memory_bytes: int) -> str:
    """Why a sandbox's container stopped; an out-of-memory kill says so, with the limit."""
    if found.reason is not None and found.reason.startswith("OOMKilled"):
        code = f", exit code {found.exit_code}" if found.exit_code is not None else ""
        return (
            "OOMKilled: its container was killed for using more than its memory limit of "
            f"{format_memory(memory_bytes)}{code}; give it more with `memory` at create"
        )
    details = []
    if found.exit_code is not None:
        details.append(f"exit code {found.exit_code}")
    if found.reason:
        details.append(found.reason)
    suffix = f" ({', '.join(details)})" if details else ""
    return f"its container stopped{suffix}"


def continue_token_of(record: SandboxRecord) -> str:
    """The opaque position after ``record`` in the newest-first sandbox list."""
    position = f"{record.created_at.isoformat()}|{record.sandbox_id}"
    return base64.urlsafe_b64encode(position.encode()).decode().rstrip("=")


def parse_continue_token(token: str) -> tuple[datetime, str]:
    try:
        padded = token + "=" * (-len(token) % 4)
        created_at, sandbox_id = base64.urlsafe_b64decode(padded).decode().split("|")
        return datetime.fromisoformat(created_at), check_sandbox_id(sandbox_id)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidRequest(
            f"continue token {token[:80]!r} is not one this service gave",
            hint="pass back the `continue` value of the previous page, or list from the start",
        ) from exc


class SandboxService:
    def __init__(
        self,
        settings: ServiceSettings,
        store: Store,
        backend: Backend,
        agents: AgentPool,
        clock: Clock,
        gateway: ModelGateway,
    ) -> None:
        self.gateway = gateway
        self.settings = settings
        self.store = store
        self.backend = backend
        self.agents = agents
        self.clock = clock
        self._lock = asyncio.Lock()
        self._changed: dict[str, asyncio.Event] = {}
        self._creating: set[str] = set()
        self._readiness: dict[str, asyncio.Task[None]] = {}
        self._in_use: Counter[str] = Counter()
        self._touched: dict[str, datetime] = {}
        self._quota_lock = asyncio.Lock()  # a quota check and the insert it allows, together
        self.ready_gate_seconds = READY_GATE_SECONDS
        # Warm pools (kept by PoolService): which pool serves a spec, and who to tell when
        # one of its sandboxes is claimed.
        self.pools_by_spec: dict[Hashable, str] = {}
        self.on_claimed: Callable[[str], None] = lambda _pool: None

    # --- records and events ----------------------------------------------------------------

    def _event(self, sandbox_id: str) -> asyncio.Event:
        return self._changed.setdefault(sandbox_id, asyncio.Event())

    def _notify(self, sandbox_id: str) -> None:
        event = self._changed.pop(sandbox_id, None)
        if event is not None:
            event.set()

    async def _transition(
        self,
        sandbox_id: str,
        from_statuses: Collection[SandboxStatus],
        *,
        when: Callable[[SandboxRecord], bool] | None = None,
        **changes: Any,
    ) -> SandboxRecord | None:
        """Apply ``changes`` if the record's status is still one of ``from_statuses`` (and
        ``when`` holds for it)."""
        async with self._lock:
            record = await self.store.get_sandbox(sandbox_id)
            if record is None or record.status not in from_statuses:
                return None
            if when is not None and not when(record):
                return None
            record = record.model_copy(update=changes)
            await self.store.put_sandbox(record)
        if "status" in changes:
            log.info(
                "sandbox status",
                extra={
                    "sandbox_id": sandbox_id,
                    "status": record.status.value,
                    "reason": record.status_message,
                },
            )
        self._notify(sandbox_id)
        return record

    async def get_record(self, sandbox_id: str, caller: Caller) -> SandboxRecord:
        record = await self.store.get_sandbox(sandbox_id)
        # A sandbox waiting in a warm pool is nobody's yet, not even an admin's to touch.
        if record is None or record.pool is not None or not caller.can_see(record.owner):
            raise SandboxNotFound(
                f"sandbox {sandbox_id} does not exist",
                hint="`orchard sandbox list` shows your sandboxes",
            )
        return record

    @staticmethod
    def _require_live(record: SandboxRecord) -> None:
        why = f": {record.status_message}" if record.status_message else ""
        if record.status == SandboxStatus.DELETED:
            raise SandboxNotFound(f"sandbox {record.sandbox_id} was deleted{why}")
        if record.status == SandboxStatus.FAILED:
            raise SandboxNotReady(
                f"sandbox {record.sandbox_id} failed{why}",
                hint="delete it and create a new one",
            )

    async def get(
        self, sandbox_id: str, caller: Caller, *, include_deleted: bool = False
    ) -> SandboxInfo:
        record = await self.get_record(sandbox_id, caller)
        if record.status == SandboxStatus.DELETED and not include_deleted:
            self._require_live(record)
        return record.to_info(self.settings)

    async def list(
        self,
        caller: Caller,
        *,
        labels: dict[str, str] | None = None,
        status: SandboxStatus | None = None,
        include_deleted: bool = False,
        limit: int | None = None,
        continue_token: str | None = None,
    ) -> SandboxList:
        records = await self.store.list_sandboxes(
            owner=caller.owner_filter,
            include_deleted=include_deleted,
            status=status,
            after=None if continue_token is None else parse_continue_token(continue_token),
            limit=limit,
        )
        wanted = labels or {}
        infos = []
        for record in records:
            if all(record.labels.get(k) == v for k, v in wanted.items()):
                with isolated(log, "showing a sandbox", sandbox_id=record.sandbox_id):
                    infos.append(record.to_info(self.settings))
        more = limit is not None and len(records) == limit
        last = records[-1] if more else None
        token = None if last is None else continue_token_of(last)
        return SandboxList.model_validate({"sandboxes": infos, "continue": token})

    # --- create ------------------------------------------------------------------------------

    def resolve_size(
        self, cpu_asked: str | float | None, memory_asked: str | int | None
    ) -> tuple[float, int]:
        """Cores and bytes of a request (the service's defaults where it names none), within
        the service's caps."""
        cpu = self.settings.default_cpu if cpu_asked is None else sandbox_cpu(cpu_asked)
        memory = (
            self.settings.default_memory if memory_asked is None else sandbox_memory(memory_asked)
        )
        if cpu > self.settings.max_cpu:
            raise LimitExceeded(
                f"cpu {cpu:g} is above this service's cap of {self.settings.max_cpu:g} cores",
                hint="ask for less, or raise the cap with ORCHARD_MAX_CPU",
            )
        if memory > self.settings.max_memory:
            raise LimitExceeded(
                f"memory {memory_asked} is above this service's cap of "
                f"{format_memory(self.settings.max_memory)}",
                hint="ask for less, or raise the cap with ORCHARD_MAX_MEMORY",
            )
        return cpu, memory

    def _size(self, request: CreateSandboxRequest) -> tuple[float, int, int | None]:
        cpu, memory = self.resolve_size(request.cpu, request.memory)
        disk = None if request.disk is None else sandbox_memory(request.disk, "disk")
        if disk is not None and disk > self.settings.ephemeral_storage:
            raise LimitExceeded(
                f"disk {request.disk} is above this service's cap of "
                f"{format_memory(self.settings.ephemeral_storage)}",
                hint="ask for less, or raise the cap with ORCHARD_EPHEMERAL_STORAGE",
            )
        return cpu, memory, disk

    def _ready_timeout(self, requested: int | None) -> int:
        limit = self.settings.max_ready_timeout_seconds
        if requested is not None and requested > limit:
            raise InvalidRequest(
                f"timeout: {requested} s is above this service's limit of {limit} s for a "
                "sandbox to become ready",
                hint="ask for less, or raise the limit with ORCHARD_MAX_READY_TIMEOUT_SECONDS",
            )
        return requested or min(self.settings.ready_timeout_seconds, limit)

    async def check_quota(
        self, caller: Caller | None, count: int, cpu: float, memory: int, *, claim: bool = False
    ) -> None:
        """Refuse (429 ``quota_exceeded``, naming the limit) ``count`` more sandboxes of ``cpu``
        and ``memory`` each beyond the service's cap or, for a non-admin key, its limits (the
        key's own, else the service's per-key defaults). Sandboxes waiting in warm pools count
        toward the service's cap (they run) but toward no key's; ``caller`` None is a pool
        filling itself; a ``claim`` from a pool adds nothing to the service, only to the key."""
        owner = None if caller is None or caller.admin else caller.owner  # None: no key limits
        usage = await self.store.live_usage(owner)
        cap = self.settings.max_sandboxes
        if not claim and usage.live + count > cap:
            raise QuotaExceeded(
                f"this service runs at most {cap} live sandboxes (max_sandboxes) and "
                f"{usage.live} are live; {count} more do not fit",
                hint="delete sandboxes no longer needed, or raise ORCHARD_MAX_SANDBOXES",
            )
        if caller is None or owner is None:
            return
        quota = caller.quota
        hint = (
            "delete sandboxes no longer needed, or ask an admin for a key with a larger quota "
            "(`orchard keys create --max-sandboxes/--max-cpu/--max-memory`)"
        )
        most = quota.max_sandboxes or self.settings.key_max_sandboxes
        if usage.owned + count > most:
            raise QuotaExceeded(
                f"key {caller.key_id} may have at most {most} live sandboxes (max_sandboxes) "
                f"and has {usage.owned}; {count} more do not fit",
                hint=hint,
            )
        most_cpu = quota.max_cpu or self.settings.key_max_cpu
        used_cpu = usage.cpu
        if used_cpu + count * cpu > most_cpu + 1e-9:
            raise QuotaExceeded(
                f"key {caller.key_id} may use at most {most_cpu:g} CPU cores (max_cpu); its "
                f"sandboxes use {used_cpu:g} and {count * cpu:g} more were asked for",
                hint=hint,
            )
        most_memory = (
            parse_memory(quota.max_memory) if quota.max_memory else self.settings.key_max_memory
        )
        used_memory = usage.memory_bytes
        if used_memory + count * memory > most_memory:
            raise QuotaExceeded(
                f"key {caller.key_id} may use at most {format_memory(most_memory)} of memory "
                f"(max_memory); its sandboxes use {format_memory(used_memory)} and "
                f"{format_memory(count * memory)} more were asked for",
                hint=hint,
            )

    async def create(
        self,
        request: CreateSandboxRequest,
        caller: Caller,
        *,
        source_snapshot: str | None = None,
    ) -> SandboxInfo:
        """Start a sandbox (``source_snapshot``: restored from that snapshot, whose image
        ``request.image`` names); readiness follows in the background. A request a warm
        pool serves (same spec, no ``sandbox_id``, ``disk``, model gateway or tools choice)
        takes one of its ready sandboxes."""
        cpu, memory, disk = self._size(request)
        lifetimes = self._lifetimes(request)
        if source_snapshot is None and self.backend.is_snapshot_image(request.image):
            source_snapshot = await self._own_snapshot(request.image, caller)
        workdir = request.workdir or self.settings.default_workdir
        # A pooled sandbox has every harness and no model gateway (its agent enrolled without).
        pooled = request.model_gateway is None and request.tool_selection() is None
        if pooled and request.sandbox_id is None and source_snapshot is None and disk is None:
            key = pool_key(request.image, cpu, memory, request.block_network, workdir, request.env)
            pool = self.pools_by_spec.get(key)
            if pool is not None:
                claimed = await self._claim(pool, request, lifetimes, caller)
                if claimed is not None:
                    return claimed.to_info(self.settings)
        now = self.clock()
        record = SandboxRecord(
            sandbox_id=request.sandbox_id or new_sandbox_id(),
            image=request.image,
            cpu=cpu,
            memory_bytes=memory,
            disk_bytes=disk,
            block_network=request.block_network,
            workdir=workdir,
            env=request.env,
            labels=request.labels,
            owner=caller.owner,
            created_at=now,
            last_activity_at=now,
            backend=self.backend.name,
            source_snapshot=source_snapshot,
            **lifetimes,
            model_gateway=self._gateway_record(request.model_gateway),
            tools=None if (asked := request.tool_selection()) is None else list(asked),
        )
        return (await self._launch(record, caller)).to_info(self.settings)

    def _lifetimes(self, request: CreateSandboxRequest) -> dict[str, Any]:
        """The record fields a create request sets about time: readiness, TTL, idle."""
        return {
            "ready_timeout_seconds": self._ready_timeout(request.timeout),
            "ttl_seconds": request.ttl_seconds or self.settings.sandbox_ttl_seconds,
            # Upstream's clients never heartbeat and upstream never idle-expired them: idle
            # expiry starts with the first heartbeat unless the request asked for it.
            "idle_timeout_seconds": request.idle_timeout_seconds or 0,
        }

    async def _launch(self, record: SandboxRecord, caller: Caller | None) -> SandboxRecord:
        """Record, then start, a sandbox: the ``caller``'s, within its quota, its usage open from
        now; or (None) one that waits in a pool, nobody's."""
        sandbox_id = record.sandbox_id
        if sandbox_id in self._creating:
            raise self._exists(sandbox_id)
        self._creating.add(sandbox_id)
        try:
            async with self._quota_lock:
                await self.check_quota(caller, 1, record.cpu, record.memory_bytes)
                inserted = await self.store.insert_sandbox(record)
            if not inserted:
                raise self._exists(sandbox_id)
            if caller is not None:
                await self.store.open_usage(record.usage_row(record.created_at))
            found = await self._create_container(record)
            await self._serve_gateway(record.model_copy(update={"agent": found.agent}))
            record = await self._started(record, found)
        finally:
            self._creating.discard(sandbox_id)
        log.info(
            "sandbox created",
            extra={
                "sandbox_id": sandbox_id,
                "image": record.image,
                "owner": record.owner,
                "pool": record.pool,
            },
        )
        return record

    # --- warm pools ------------------------------------------------------------------------

    async def create_pooled(self, pool: PoolRecord) -> SandboxRecord:
        """Start one sandbox for ``pool``: nobody's, unbilled, until a create claims it."""
        now = self.clock()
        record = SandboxRecord(
            sandbox_id=new_sandbox_id(),
            image=pool.image,
            cpu=pool.cpu,
            memory_bytes=pool.memory_bytes,
            block_network=pool.block_network,
            workdir=pool.workdir,
            env=pool.env,
            created_at=now,
            ready_timeout_seconds=self._ready_timeout(None),
            ttl_seconds=pool.ttl_seconds,
            idle_timeout_seconds=0,
            last_activity_at=now,
            backend=self.backend.name,
            pool=pool.name,
        )
        return await self._launch(record, None)

    async def _claim(
        self, pool: str, request: CreateSandboxRequest, lifetimes: dict[str, Any], caller: Caller
    ) -> SandboxRecord | None:
        """Hand one ready sandbox of ``pool`` to ``caller``, as if just created for it; None
        when none is ready. Under the lock: a pooled sandbox is handed out once."""
        now = self.clock()
        async with self._quota_lock, self._lock:
            waiting = await self.store.first_pooled(pool)
            if waiting is None:
                return None
            await self.check_quota(caller, 1, waiting.cpu, waiting.memory_bytes, claim=True)
            record = waiting.model_copy(
                update={
                    "pool": None,
                    "owner": caller.owner,
                    "labels": request.labels,
                    "created_at": now,
                    "last_activity_at": now,
                    **lifetimes,
                }
            )
            await self.store.put_sandbox(record)
        await self.store.open_usage(record.usage_row(now))
        self._notify(record.sandbox_id)
        self.on_claimed(pool)
        log.info(
            "sandbox created",
            extra={
                "sandbox_id": record.sandbox_id,
                "image": record.image,
                "owner": record.owner,
                "claimed_from": pool,
            },
        )
        return record

    def _gateway_record(self, spec: ModelGatewaySpec | None) -> GatewayRecord | None:
        if spec is None:
            return None
        endpoints = self.gateway.endpoints
        openai = endpoints.pick("openai", spec.openai)
        anthropic = endpoints.pick("anthropic", spec.anthropic)
        if openai is None and anthropic is None:
            raise InvalidRequest(
                "model_gateway: the service has no model endpoint to forward to",
                hint="configure endpoints in the file of the model_endpoints_file setting "
                "(see docs/harnesses.md)",
            )
        return GatewayRecord(
            openai=None if openai is None else openai.name,
            anthropic=None if anthropic is None else anthropic.name,
            model=spec.model or (openai.model if openai else None),
            anthropic_model=spec.model or (anthropic.model if anthropic else None),
            trajectory_id=spec.trajectory_id or "default",
            max_calls=spec.max_calls,
            max_tokens=spec.max_tokens,
            dummy_key="orchard-" + secrets.token_hex(16),
        )

    async def _serve_gateway(self, record: SandboxRecord) -> None:
        """Serve a sandbox's model gateway: on its socket from the start where its agent is
        on a unix socket (the local engine); where its agent is on TCP and cannot dial out
        (Kubernetes), over connections parked at the agent, once it is enrolled (ready)."""
        config, agent = record.model_gateway, record.agent
        if config is None or agent is None:
            return
        sandbox_id = record.sandbox_id
        if agent.uds is not None:
            await self.gateway.attach(sandbox_id, config)
        elif record.status == SandboxStatus.READY:
            await self.gateway.attach_parked(
                sandbox_id, config, agent, lambda error: self.agents.tampered(sandbox_id, error)
            )

    async def set_trajectory(
        self, sandbox_id: str, caller: Caller, trajectory_id: str
    ) -> SandboxInfo:
        """Send the sandbox's next model calls (those without a /t/<traj> prefix) to
        ``trajectory_id``."""
        record = await self.get_record(sandbox_id, caller)
        self._require_live(record)
        if record.model_gateway is None:
            raise InvalidRequest(
                f"sandbox {sandbox_id} has no model gateway",
                hint="create it with model_gateway set (see docs/harnesses.md)",
            )
        config = record.model_gateway.model_copy(update={"trajectory_id": trajectory_id})
        updated = await self._transition(sandbox_id, LIVE_STATUSES, model_gateway=config)
        if updated is None:
            raise InvalidRequest(f"sandbox {sandbox_id} ended meanwhile")
        self.gateway.set_trajectory(sandbox_id, config)
        return updated.to_info(self.settings)

    async def _own_snapshot(self, image: str, caller: Caller) -> str:
        """The id of the caller's live snapshot whose image is ``image``; else 404, the same
        answer whether the image exists, is another key's, or another deployment's."""
        for snapshot in await self.store.list_snapshots(owner=caller.owner_filter):
            if snapshot.image == image:
                return snapshot.snapshot_id
        raise not_your_snapshot(image)

    @staticmethod
    def _exists(sandbox_id: str) -> SandboxExists:
        return SandboxExists(
            f"sandbox {sandbox_id} already exists",
            hint="pick another sandbox_id, or delete the existing sandbox first",
        )

    async def _create_container(self, record: SandboxRecord) -> BackendSandbox:
        spec = SandboxSpec(
            sandbox_id=record.sandbox_id,
            image=record.image,
            cpu=record.cpu,
            memory_bytes=record.memory_bytes,
            disk_bytes=record.disk_bytes,
            block_network=record.block_network,
            workdir=record.workdir,
            agent_token=secrets.token_urlsafe(32),
            owner=record.owner,
            env=record.env,
            labels=record.labels,
            pids_limit=pids_for(record.memory_bytes, self.settings.pids_limit),
            # A pooled sandbox's lifetime starts again when it is claimed, so its container
            # gets no lifetime cap of its own: the reaper ends it (waiting or claimed).
            ttl_seconds=None if record.pool is not None else record.ttl_seconds or None,
            ready_timeout_seconds=record.ready_timeout_seconds,
            record_annotation=record.annotation(),
            snapshot_id=record.source_snapshot,
            tools=None if record.tools is None else tuple(record.tools),
        )
        try:
            return await self.backend.create(spec)
        except Exception as exc:
            # The sandbox never came to be: forget its record and usage; the id is free again.
            await self.store.remove_sandbox(record.sandbox_id)
            self._notify(record.sandbox_id)
            if not isinstance(exc, SandboxExists):  # an existing container is not ours to remove
                with contextlib.suppress(Exception):
                    await self.backend.delete(record.sandbox_id)
            raise

    async def _started(self, record: SandboxRecord, found: BackendSandbox) -> SandboxRecord:
        updated = await self._transition(record.sandbox_id, LIVE_STATUSES, agent=found.agent)
        if updated is None:
            # Deleted while the engine was creating it: that delete may have come too early.
            with contextlib.suppress(Exception):
                await self.backend.delete(record.sandbox_id)
            return await self.store.get_sandbox(record.sandbox_id) or record
        if found.state in _DEAD_STATES:
            ended = await self.end(
                record.sandbox_id, SandboxStatus.FAILED, dead_reason(found, record.memory_bytes)
            )
            return ended or updated
        # One deadline for the whole start (an image pull included): the request's timeout.
        remaining = (record.ready_deadline() - self.clock()).total_seconds()
        self._start_readiness(record.sandbox_id, max(remaining, 1.0))
        return updated

    # --- readiness -----------------------------------------------------------------------------

    def _start_readiness(self, sandbox_id: str, timeout_seconds: float) -> None:
        if sandbox_id not in self._readiness:
            self._readiness[sandbox_id] = asyncio.create_task(
                self._await_ready(sandbox_id, timeout_seconds), name=f"ready-{sandbox_id}"
            )

    async def _await_ready(self, sandbox_id: str, timeout_seconds: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_seconds
        last_error = "it has not answered yet"
        # The container is inspected between slices of polling the agent: 1 s, then longer
        # ones (up to CONTAINER_CHECK_MAX_SECONDS), so hundreds of sandboxes starting at once
        # do not flood the engine that is busy creating them.
        slice_limit = 1.0
        try:
            while True:
                record = await self.store.get_sandbox(sandbox_id)
                if record is None or not record.live:
                    return
                if record.agent is not None:
                    try:
                        slice_ = min(slice_limit, max(deadline - loop.time(), 0.05))
                        slice_limit = min(slice_limit * 2, CONTAINER_CHECK_MAX_SECONDS)
                        await self.agents.client(record).wait_ready(slice_)
                    except Exception as exc:
                        last_error = str(exc) or type(exc).__name__
                    else:
                        # An unschedulable reason is over; a note from adoption stays.
                        ready = await self._transition(
                            sandbox_id,
                            (SandboxStatus.PENDING, SandboxStatus.UNSCHEDULABLE),
                            status=SandboxStatus.READY,
                            status_message=record.status_message
                            if record.status == SandboxStatus.PENDING
                            else None,
                        )
                        if ready is not None:
                            await self._serve_gateway(ready)
                        return
                if await self._check_container(record):
                    return
                if loop.time() >= deadline:
                    await self.end(
                        sandbox_id,
                        SandboxStatus.FAILED,
                        f"it did not become ready within {timeout_seconds:g} s "
                        f"(agent: {last_error})",
                    )
                    return
                if record.agent is None:
                    await asyncio.sleep(0.2)
        finally:
            if self._readiness.get(sandbox_id) is asyncio.current_task():
                del self._readiness[sandbox_id]

    async def _check_container(self, record: SandboxRecord) -> bool:
        """While starting: True if the container is gone or dead (the sandbox is failed)."""
        try:
            found = await self.backend.inspect(record.sandbox_id)
        except Exception as exc:
            log.warning(
                "inspect failed", extra={"sandbox_id": record.sandbox_id, "error": str(exc)}
            )
            await asyncio.sleep(0.5)
            return False
        if found is None:
            await self.end(
                record.sandbox_id, SandboxStatus.FAILED, "its container disappeared while starting"
            )
            return True
        if found.state in _DEAD_STATES:
            reason = dead_reason(found, record.memory_bytes)
            await self.end(record.sandbox_id, SandboxStatus.FAILED, reason)
            return True
        changes: dict[str, Any] = {}
        if found.agent is not None and found.agent != record.agent:
            changes["agent"] = found.agent
        if found.state == SandboxState.UNSCHEDULABLE and record.status == SandboxStatus.PENDING:
            changes["status"] = SandboxStatus.UNSCHEDULABLE
            changes["status_message"] = found.reason
        if changes:
            await self._transition(record.sandbox_id, LIVE_STATUSES, **changes)
        return False

    async def _wait_settled(
        self, sandbox_id: str, caller: Caller, seconds: float, settled: Collection[SandboxStatus]
    ) -> SandboxRecord:
        """The record once its status is in ``settled``, or as it is after ``seconds``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        while True:
            event = self._event(sandbox_id)
            record = await self.get_record(sandbox_id, caller)
            remaining = deadline - loop.time()
            if record.status in settled or remaining <= 0:
                return record
            # Event-driven in this process; the periodic re-read covers changes made elsewhere.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), min(remaining, 1.0))

    async def wait(self, sandbox_id: str, caller: Caller, seconds: float) -> SandboxInfo:
        """Upstream's ``/wait``: the sandbox once ready, failed or deleted; 408 otherwise."""
        record = await self._wait_settled(sandbox_id, caller, seconds, SETTLED_STATUSES)
        if record.status not in SETTLED_STATUSES:
            raise Timeout(
                f"sandbox {sandbox_id} is still {record.status.value} after {seconds:g} s",
                hint=f"wait again, or check `orchard sandbox get {sandbox_id}`",
            )
        return record.to_info(self.settings)

    async def require_ready(
        self, sandbox_id: str, caller: Caller, wait: float | None = None
    ) -> SandboxRecord:
        """The record of a ready sandbox, else 404/409. A pending one is waited for a little
        (``wait`` seconds, default :data:`READY_GATE_SECONDS`)."""
        seconds = self.ready_gate_seconds if wait is None else wait
        record = await self._wait_settled(sandbox_id, caller, seconds, SETTLED_STATUSES)
        self._require_live(record)
        if record.status != SandboxStatus.READY:
            raise SandboxNotReady(
                f"sandbox {sandbox_id} is not ready yet (status {record.status.value})",
                hint=f"wait for it: GET /sandboxes/{sandbox_id}/wait",
            )
        return record

    # --- activity ----------------------------------------------------------------------------

    async def touch(self, sandbox_id: str, *, force: bool = False) -> datetime | None:
        """Record activity now (written at most every few seconds unless ``force``): the time
        written, None if nothing was (too soon, or the sandbox is no longer live)."""
        now = self.clock()
        last = self._touched.get(sandbox_id)
        if not force and last is not None and now - last < timedelta(seconds=TOUCH_PERSIST_SECONDS):
            return None
        self._touched[sandbox_id] = now
        async with self._lock:  # never between a transition's read and its write
            written = await self.store.touch_sandbox(sandbox_id, now)
        return now if written else None

    async def heartbeat(self, sandbox_id: str, caller: Caller) -> HeartbeatResponse:
        record = await self.get_record(sandbox_id, caller)
        self._require_live(record)
        if record.idle_timeout_seconds == 0 and self.settings.idle_timeout_seconds:
            # The first heartbeat: this client keeps its sandbox alive, so idle expiry applies.
            opted = await self._transition(
                sandbox_id, LIVE_STATUSES, idle_timeout_seconds=self.settings.idle_timeout_seconds
            )
            record = opted or record
        touched = await self.touch(sandbox_id, force=True)
        if touched is not None:
            record = record.model_copy(update={"last_activity_at": touched})
        return HeartbeatResponse(sandbox_id=sandbox_id, expires_at=record.expires_at())

    def hold(self, sandbox_id: str) -> None:
        """Mark a sandbox busy (a command or a terminal runs, or is about to): idle expiry
        skips it until :meth:`release`."""
        self._in_use[sandbox_id] += 1

    async def release(self, sandbox_id: str) -> None:
        """End one :meth:`hold`; the idle clock restarts now."""
        self._in_use[sandbox_id] -= 1
        if self._in_use[sandbox_id] <= 0:
            del self._in_use[sandbox_id]
        await self.touch(sandbox_id, force=True)

    @contextlib.asynccontextmanager
    async def in_use(self, sandbox_id: str) -> AsyncIterator[None]:
        """:meth:`hold` for the duration of a block."""
        self.hold(sandbox_id)
        try:
            yield
        finally:
            await self.release(sandbox_id)

    def busy(self, sandbox_id: str) -> bool:
        """A command or terminal runs in it right now."""
        return sandbox_id in self._in_use

    # --- ending --------------------------------------------------------------------------------

    async def delete(self, sandbox_id: str, caller: Caller) -> DeleteResponse:
        record = await self.get_record(sandbox_id, caller)
        if record.status == SandboxStatus.DELETED:
            return DeleteResponse(sandbox_id=sandbox_id, already_deleted=True)
        ended = await self.end(sandbox_id, SandboxStatus.DELETED, "deleted by request")
        return DeleteResponse(sandbox_id=sandbox_id, already_deleted=ended is None)

    async def end(
        self,
        sandbox_id: str,
        status: SandboxStatus,
        message: str,
        *,
        when: Callable[[SandboxRecord], bool] | None = None,
    ) -> SandboxRecord | None:
        """Make a sandbox failed or deleted (if ``when`` holds for its record), then remove its
        container and close its usage."""
        now = self.clock()
        changes: dict[str, Any] = {"status": status, "status_message": message, "ended_at": now}
        allowed = set(LIVE_STATUSES)
        if status == SandboxStatus.DELETED:
            changes["deleted_at"] = now
            allowed.add(SandboxStatus.FAILED)
        record = await self._transition(sandbox_id, allowed, when=when, **changes)
        if record is None:
            return None
        task = self._readiness.pop(sandbox_id, None)
        if task is not None and task is not asyncio.current_task():
            task.cancel()
        try:
            await self.backend.delete(sandbox_id)
        except Exception as exc:
            log.warning(
                "could not remove the container; the next reconciliation retries",
                extra={"sandbox_id": sandbox_id, "error": str(exc)},
            )
        await self.agents.drop(sandbox_id)
        await self.gateway.detach(sandbox_id)
        await self.store.close_usage(sandbox_id, now)
        self._touched.pop(sandbox_id, None)
        return record

    # --- reconciliation and expiry ---------------------------------------------------------

    async def reconcile(self) -> None:
        """Make records and the backend's containers agree (startup and every reaper pass)."""
        records = await self.store.list_sandboxes(include_deleted=True, pooled=True)
        creating = set(self._creating)
        try:
            found = await self.backend.list()
        except Exception as exc:
            log.warning(
                "listing the backend failed; reconciliation skipped", extra={"error": str(exc)}
            )
            return
        seen = {item.sandbox_id for item in found}
        for item in found:
            if item.sandbox_id not in self._creating:
                with isolated(log, "reconciling a container", sandbox_id=item.sandbox_id):
                    await self._reconcile_container(item)
        for record in records:
            sandbox_id = record.sandbox_id
            if (
                record.live
                and sandbox_id not in seen
                and sandbox_id not in creating
                and sandbox_id not in self._creating
            ):
                with isolated(log, "failing a sandbox without container", sandbox_id=sandbox_id):
                    await self.end(
                        sandbox_id,
                        SandboxStatus.FAILED,
                        "its container no longer exists (removed outside Orchard, or never "
                        "created)",
                    )

    async def _reconcile_container(self, item: BackendSandbox) -> None:
        record = await self.store.get_sandbox(item.sandbox_id)
        if record is None:
            await self._adopt(item)
        elif record.live:
            await self._sync(record, item)
        else:
            log.info(
                "removing the container of an ended sandbox",
                extra={"sandbox_id": item.sandbox_id, "status": record.status.value},
            )
            with contextlib.suppress(Exception):
                await self.backend.delete(item.sandbox_id)

    async def check_alive(self, sandbox_id: str) -> SandboxRecord | None:
        """After a broken link to its agent: fail a live sandbox whose container stopped (with
        the reason), at once rather than at the next reconciliation. Its record after that."""
        record = await self.store.get_sandbox(sandbox_id)
        if record is None or not record.live:
            return record
        try:
            found = await self.backend.inspect(sandbox_id)
        except Exception:
            return record  # the engine not answering is no verdict
        if found is None:
            await self.end(sandbox_id, SandboxStatus.FAILED, "its container disappeared")
        elif found.state in _DEAD_STATES:
            reason = dead_reason(found, record.memory_bytes)
            await self.end(sandbox_id, SandboxStatus.FAILED, reason)
        else:
            return record
        return await self.store.get_sandbox(sandbox_id)

    async def _sync(self, record: SandboxRecord, found: BackendSandbox) -> None:
        if found.state in _DEAD_STATES:
            reason = dead_reason(found, record.memory_bytes)
            await self.end(record.sandbox_id, SandboxStatus.FAILED, reason)
            return
        if found.agent is not None and found.agent != record.agent:
            changed = await self._transition(record.sandbox_id, LIVE_STATUSES, agent=found.agent)
            record = changed or record
        await self._serve_gateway(record)
        if record.status != SandboxStatus.READY:
            self._start_readiness(record.sandbox_id, self.settings.ready_timeout_seconds)

    async def _adopt(self, found: BackendSandbox) -> None:
        now = self.clock()
        record: SandboxRecord | None = None
        if found.record_annotation:
            try:
                record = SandboxRecord.from_annotation(found.record_annotation)
            except ValidationError as exc:
                log.warning(
                    "unreadable record annotation",
                    extra={"sandbox_id": found.sandbox_id, "error": str(exc)},
                )
        if record is not None and record.pool is not None:
            # Its container cannot say whether a create claimed it: never hand it out again.
            record = record.model_copy(
                update={
                    "pool": None,
                    "status_message": f"adopted from warm pool {record.pool} without its "
                    "record: it may have been claimed, so it is not handed out again",
                }
            )
        if record is None or record.sandbox_id != found.sandbox_id:
            record = SandboxRecord(
                sandbox_id=found.sandbox_id,
                image="unknown",
                cpu=self.settings.default_cpu,
                memory_bytes=self.settings.default_memory,
                workdir=self.settings.default_workdir,
                created_at=found.created_at,
                ready_timeout_seconds=self.settings.ready_timeout_seconds,
                ttl_seconds=self.settings.sandbox_ttl_seconds,
                idle_timeout_seconds=self.settings.idle_timeout_seconds,
                last_activity_at=now,
                status_message="adopted without its record: image, size and owner are unknown",
                backend=self.backend.name,
            )
        record = record.model_copy(
            update={"agent": found.agent, "status": SandboxStatus.PENDING, "last_activity_at": now}
        )
        if not await self.store.insert_sandbox(record):
            return
        log.info("adopted an unrecorded sandbox", extra={"sandbox_id": record.sandbox_id})
        await self.store.open_usage(record.usage_row(found.created_at))
        await self._sync(record, found)

    async def expire(self, now: datetime) -> None:
        """End sandboxes past their TTL, idle too long, or stuck starting (each on its own: one
        that fails is logged and the others still expire)."""
        for record in await self.store.list_sandboxes(pooled=True):
            if record.live and record.sandbox_id not in self._creating:
                with isolated(log, "expiring a sandbox", sandbox_id=record.sandbox_id):
                    await self._expire_one(record, now)

    async def _expire_one(self, record: SandboxRecord, now: datetime) -> None:
        sandbox_id = record.sandbox_id
        ttl, idle = record.ttl_seconds, record.idle_timeout_seconds
        if ttl and now >= record.ttl_deadline():
            # Unless a create claimed it from its pool meanwhile (its lifetime starts again).
            created = record.created_at
            await self.end(
                sandbox_id,
                SandboxStatus.DELETED,
                f"expired: its lifetime of {ttl} s (ttl_seconds) ran out",
                when=lambda current: current.created_at == created,
            )
        elif (
            idle
            and record.status == SandboxStatus.READY
            and not self.busy(sandbox_id)
            and now >= record.idle_deadline()
        ):
            await self.end(
                sandbox_id,
                SandboxStatus.DELETED,
                f"expired: idle for {idle} s (idle_timeout_seconds); heartbeats keep it alive",
            )
        elif (
            record.status != SandboxStatus.READY
            and sandbox_id not in self._readiness
            and now >= record.ready_deadline()
        ):
            await self.end(
                sandbox_id,
                SandboxStatus.FAILED,
                f"it did not become ready within {record.ready_timeout_seconds} s",
            )

    async def close(self) -> None:
        tasks = list(self._readiness.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._readiness.clear()
