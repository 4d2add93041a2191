"""The orchestrator's own records: what the store keeps, and how they become wire models.

Wire models (``orchard_env.protocol``) are what clients see; records carry the extra state the
orchestrator needs to survive a restart (the agent endpoint and token, the full exec request of
a job so a queued one can be sent after a restart, the owner of every row).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from pydantic import BaseModel, Field

from orchard_env.config import ServiceSettings
from orchard_env.orchestrator.backends.base import AgentEndpoint
from orchard_env.protocol import (
    ExecRequest,
    Job,
    JobStatus,
    KeyInfo,
    KeyQuota,
    ModelGatewayInfo,
    ModelGatewaySpec,
    PoolInfo,
    SandboxInfo,
    SandboxStatus,
    Snapshot,
)
from orchard_env.quantities import format_memory

LIVE_STATUSES = frozenset({SandboxStatus.PENDING, SandboxStatus.READY, SandboxStatus.UNSCHEDULABLE})
"""Statuses of a sandbox whose container should exist."""

# Fields that describe the sandbox itself, as opposed to its current state: they travel with the
# container (the backend's record annotation) so a restart with lost state can adopt it.
_ANNOTATION_EXCLUDE = {"agent", "status", "status_message", "deleted_at", "ended_at"}


def utcnow() -> datetime:
    return datetime.now(UTC)


LATEST = datetime.max.replace(tzinfo=UTC)


def later(start: datetime, seconds: float) -> datetime:
    """``start + seconds``, saturating at the end of time: a stored record with an absurd
    duration (written before the API bounded them) reads as "never" instead of raising."""
    try:
        return start + timedelta(seconds=seconds)
    except OverflowError:
        return LATEST


class GatewayRecord(BaseModel):
    """A sandbox's model gateway: endpoint names (their keys live in the service's endpoints
    file), the model, the current trajectory, the budget, and the dummy key it hands out."""

    openai: str | None = None
    anthropic: str | None = None
    model: str | None = None
    anthropic_model: str | None = None
    trajectory_id: str = "default"
    max_calls: int | None = None
    max_tokens: int | None = None
    dummy_key: str

    def to_info(self) -> ModelGatewayInfo:
        return ModelGatewayInfo(
            openai=self.openai,
            anthropic=self.anthropic,
            model=self.model,
            trajectory_id=self.trajectory_id,
            max_calls=self.max_calls,
            max_tokens=self.max_tokens,
        )

    def to_spec(self) -> ModelGatewaySpec:
        """The ``model_gateway`` of a create that makes the same gateway (a restore's): the
        same endpoints, models, current trajectory and budget (counted afresh); its own key."""
        # One model names both endpoints' only when the create named it (else each is its
        # endpoint's default, which None gives again).
        both = self.openai is not None and self.anthropic is not None
        model = (
            None
            if both and self.model != self.anthropic_model
            else self.model or self.anthropic_model
        )
        return ModelGatewaySpec(
            openai=self.openai,
            anthropic=self.anthropic,
            model=model,
            trajectory_id=self.trajectory_id,
            max_calls=self.max_calls,
            max_tokens=self.max_tokens,
        )


class SandboxRecord(BaseModel):
    sandbox_id: str
    image: str
    cpu: float
    memory_bytes: int
    disk_bytes: int | None = None  # None: the backend's default
    block_network: bool = True
    workdir: str = "/workspace"
    env: dict[str, str] = Field(default_factory=dict)
    labels: dict[str, str] = Field(default_factory=dict)
    owner: str | None = None
    status: SandboxStatus = SandboxStatus.PENDING
    status_message: str | None = None
    created_at: datetime
    ready_timeout_seconds: int
    ttl_seconds: int = 0  # 0 = no lifetime cap
    idle_timeout_seconds: int = 0  # 0 = no idle expiry
    last_activity_at: datetime
    deleted_at: datetime | None = None
    ended_at: datetime | None = None  # when it became failed or deleted
    backend: str = ""
    agent: AgentEndpoint | None = None
    source_snapshot: str | None = None
    # The warm pool it waits in, until a create claims it (then None: an ordinary sandbox).
    pool: str | None = None
    model_gateway: GatewayRecord | None = None
    tools: list[str] | None = None  # the harnesses asked for (None: all the service has)

    @property
    def live(self) -> bool:
        return self.status in LIVE_STATUSES

    def annotation(self) -> str:
        """The record as kept on the container: everything but state and the agent secret."""
        return self.model_dump_json(exclude=_ANNOTATION_EXCLUDE)

    @classmethod
    def from_annotation(cls, text: str) -> SandboxRecord:
        return cls.model_validate_json(text)

    def expires_at(self) -> datetime | None:
        """When the reaper will remove it: the earlier of its TTL and its idle expiry."""
        candidates = []
        if self.ttl_seconds:
            candidates.append(self.ttl_deadline())
        if self.idle_timeout_seconds:
            candidates.append(self.idle_deadline())
        return min(candidates) if candidates else None

    def ttl_deadline(self) -> datetime:
        return later(self.created_at, self.ttl_seconds)

    def idle_deadline(self) -> datetime:
        return later(self.last_activity_at, self.idle_timeout_seconds)

    def ready_deadline(self) -> datetime:
        return later(self.created_at, self.ready_timeout_seconds)

    def usage_row(self, started_at: datetime) -> UsageRow:
        return UsageRow(
            sandbox_id=self.sandbox_id,
            owner=self.owner,
            image=self.image,
            cpu=self.cpu,
            memory_bytes=self.memory_bytes,
            labels=self.labels,
            started_at=started_at,
        )

    def to_info(self, settings: ServiceSettings) -> SandboxInfo:
        return SandboxInfo(
            sandbox_id=self.sandbox_id,
            namespace=settings.instance,
            image=self.image,
            pod_name=self.sandbox_id,
            block_network=self.block_network,
            cpu=f"{self.cpu:g}",
            memory=format_memory(self.memory_bytes),
            disk=None if self.disk_bytes is None else format_memory(self.disk_bytes),
            created_at=self.created_at,
            ready=self.status == SandboxStatus.READY,
            status=self.status,
            status_message=self.status_message or "",
            timeout=self.ready_timeout_seconds,
            labels=self.labels,
            owner=self.owner,
            workdir=self.workdir,
            env=self.env,
            backend=self.backend,
            expires_at=self.expires_at() if self.live else None,
            idle_timeout_seconds=self.idle_timeout_seconds or None,
            last_activity_at=self.last_activity_at,
            deleted_at=self.deleted_at,
            source_snapshot=self.source_snapshot,
            model_gateway=None if self.model_gateway is None else self.model_gateway.to_info(),
            tools=self.tools,
        )


class JobRecord(BaseModel):
    job_id: str
    sandbox_id: str
    owner: str | None = None
    # Job ids are unique per scope: the key that owns the job's sandbox ("" without keys), so
    # one tenant's ids neither collide with nor reveal another's.
    scope: str = ""
    command: str
    request: ExecRequest
    status: JobStatus = JobStatus.QUEUED
    stdout: str = ""
    stderr: str = ""
    exit_code: int | None = None
    created_at: datetime
    started_at: datetime | None = None
    completed_at: datetime | None = None
    error: str | None = None
    timed_out: bool = False
    cancelled: bool = False
    oom_killed: bool = False
    truncated: bool = False

    def to_job(self) -> Job:
        return Job(
            job_id=self.job_id,
            sandbox_id=self.sandbox_id,
            command=self.command,
            status=self.status,
            stdout=self.stdout,
            stderr=self.stderr,
            exit_code=self.exit_code,
            created_at=self.created_at,
            started_at=self.started_at,
            completed_at=self.completed_at,
            error=self.error,
            timed_out=self.timed_out,
            cancelled=self.cancelled,
            oom_killed=self.oom_killed,
            truncated=self.truncated,
        )


class KeyRecord(BaseModel):
    key_id: str
    name: str
    sha256: str
    admin: bool
    created_at: datetime
    revoked_at: datetime | None = None
    quota: KeyQuota = Field(default_factory=KeyQuota)

    def to_info(self) -> KeyInfo:
        return KeyInfo(
            key_id=self.key_id,
            name=self.name,
            admin=self.admin,
            created_at=self.created_at,
            revoked_at=self.revoked_at,
            **self.quota.model_dump(),
        )


class UsageRow(BaseModel):
    """One sandbox's lifetime, open (``ended_at`` None) while it runs."""

    sandbox_id: str
    owner: str | None
    image: str
    cpu: float
    memory_bytes: int
    labels: dict[str, str] = Field(default_factory=dict)
    started_at: datetime
    ended_at: datetime | None = None


class SnapshotRecord(BaseModel):
    """A snapshot, and what became of it: deleted (by request or TTL) first, its image
    removed later, once no sandbox uses it any more."""

    snapshot_id: str
    name: str | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    owner: str | None = None
    source_sandbox: str
    parent_snapshot: str | None = None
    image: str
    size_bytes: int
    backend: str = ""
    # what a sandbox restored from it gets: the source sandbox's
    cpu: float
    memory_bytes: int
    disk_bytes: int | None = None
    block_network: bool
    workdir: str
    env: dict[str, str] = Field(default_factory=dict)
    sandbox_labels: dict[str, str] = Field(default_factory=dict)
    tools: list[str] | None = None
    model_gateway: ModelGatewaySpec | None = None
    created_at: datetime
    ttl_seconds: int = 0  # 0 = kept until deleted
    deleted_at: datetime | None = None
    deleted_reason: str | None = None
    image_removed_at: datetime | None = None

    @property
    def deleted(self) -> bool:
        return self.deleted_at is not None

    def expires_at(self) -> datetime | None:
        return later(self.created_at, self.ttl_seconds) if self.ttl_seconds else None

    def to_wire(self) -> Snapshot:
        return Snapshot(
            snapshot_id=self.snapshot_id,
            name=self.name,
            labels=self.labels,
            owner=self.owner,
            source_sandbox=self.source_sandbox,
            parent_snapshot=self.parent_snapshot,
            image=self.image,
            size_bytes=self.size_bytes,
            backend=self.backend,
            cpu=f"{self.cpu:g}",
            memory=format_memory(self.memory_bytes),
            block_network=self.block_network,
            workdir=self.workdir,
            env=self.env,
            sandbox_labels=self.sandbox_labels,
            created_at=self.created_at,
            expires_at=None if self.deleted else self.expires_at(),
            deleted_at=self.deleted_at,
        )


class PoolRecord(BaseModel):
    """A warm pool: the spec its sandboxes are made with and how many to keep ready."""

    name: str
    image: str
    cpu: float
    memory_bytes: int
    block_network: bool
    workdir: str
    env: dict[str, str] = Field(default_factory=dict)
    size: int
    ttl_seconds: int
    created_at: datetime

    def spec_key(self) -> tuple[object, ...]:
        return pool_key(
            self.image, self.cpu, self.memory_bytes, self.block_network, self.workdir, self.env
        )

    def to_info(self, *, ready: int, starting: int, error: str | None) -> PoolInfo:
        return PoolInfo(
            name=self.name,
            image=self.image,
            block_network=self.block_network,
            cpu=f"{self.cpu:g}",
            memory=format_memory(self.memory_bytes),
            env=self.env,
            workdir=self.workdir,
            size=self.size,
            ttl_seconds=self.ttl_seconds,
            ready=ready,
            starting=starting,
            error=error,
            created_at=self.created_at,
        )


def pool_key(
    image: str,
    cpu: float,
    memory_bytes: int,
    block_network: bool,
    workdir: str,
    env: dict[str, str],
) -> tuple[object, ...]:
    """What a create request and a pool must agree on for the pool to serve it."""
    return (image, cpu, memory_bytes, block_network, workdir, tuple(sorted(env.items())))
