"""Wire models shared by the SDK, the orchestrator and the CLI.

The REST API is upstream Orchard Env's, unchanged in paths and JSON field names, so its
clients keep working; everything Orchard adds is an extra optional field or a new route.
Validation rules live here once (ids, quantities, images) so the SDK, the CLI and the
server reject the same inputs with the same message.
"""

from __future__ import annotations

import re
import shlex
from datetime import datetime
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainSerializer,
    ValidationError,
    ValidationInfo,
    field_validator,
)

# --- validation helpers ------------------------------------------------------------------

SANDBOX_ID_RE = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
LABEL_KEY_RE = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
LABEL_VALUE_RE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")
# A conservative form of the OCI reference grammar: [registry/]path[:tag][@digest].
IMAGE_RE = re.compile(
    r"^(?:[a-zA-Z0-9.-]+(?::[0-9]+)?/)?"
    r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*"
    r"(?::[\w][\w.-]{0,127})?(?:@sha256:[a-f0-9]{64})?$"
)
_CPU_RE = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(m?)$")
_MEM_RE = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(Ki|Mi|Gi|Ti|K|M|G|T|k)?$")
_MEM_UNITS = {
    None: 1,
    "k": 1000,
    "K": 1000,
    "M": 1000**2,
    "G": 1000**3,
    "T": 1000**4,
    "Ki": 1024,
    "Mi": 1024**2,
    "Gi": 1024**3,
    "Ti": 1024**4,
}


def check_sandbox_id(value: str) -> str:
    if not SANDBOX_ID_RE.match(value):
        raise ValueError(
            f"sandbox id {value!r} is not a DNS label: use 1-63 lowercase letters, digits "
            "and '-', starting and ending with a letter or digit"
        )
    return value


def check_image(value: str) -> str:
    if not IMAGE_RE.match(value):
        raise ValueError(
            f"image {value!r} is not a valid image reference "
            "(expected [registry/]name[:tag][@sha256:digest], lowercase name)"
        )
    return value


def validation_text(exc: ValidationError) -> str:
    """A validation error as one line naming each bad field."""
    parts = []
    for item in exc.errors():
        message = str(item["msg"]).removeprefix("Value error, ")
        loc = ".".join(str(p) for p in item["loc"])
        parts.append(f"{loc}: {message}" if loc else message)
    return "; ".join(parts)


def parse_cpu(value: str | float | int) -> float:
    """Kubernetes CPU quantity → cores: ``2``, ``0.5``, ``"500m"``."""
    if isinstance(value, bool):
        raise ValueError(f"cpu {value!r} is not a quantity")
    if isinstance(value, int | float):
        cores = float(value)
    else:
        match = _CPU_RE.match(value.strip())
        if not match:
            raise ValueError(f"cpu {value!r} is not a quantity (examples: 2, 0.5, 500m)")
        cores = float(match.group(1)) / (1000 if match.group(2) else 1)
    if cores <= 0:
        raise ValueError(f"cpu {value!r} must be greater than zero")
    return cores


def parse_memory(value: str | int) -> int:
    """Kubernetes memory quantity → bytes: ``"512Mi"``, ``"8Gi"``, ``"1G"``, ``1073741824``."""
    if isinstance(value, bool):
        raise ValueError(f"memory {value!r} is not a quantity")
    if isinstance(value, int):
        size = value
    else:
        match = _MEM_RE.match(value.strip())
        if not match:
            raise ValueError(f"memory {value!r} is not a quantity (examples: 512Mi, 8Gi, 1G)")
        size = int(float(match.group(1)) * _MEM_UNITS[match.group(2)])
    if size <= 0:
        raise ValueError(f"memory {value!r} must be greater than zero")
    return size


def format_memory(size: int) -> str:
    for unit in ("Ti", "Gi", "Mi", "Ki"):
        factor = _MEM_UNITS[unit]
        if size % factor == 0:
            return f"{size // factor}{unit}"
    return str(size)


def check_labels(labels: dict[str, str]) -> dict[str, str]:
    for key, value in labels.items():
        if not LABEL_KEY_RE.match(key):
            raise ValueError(f"label key {key!r} is invalid (letters, digits, '-', '_', '.')")
        if not LABEL_VALUE_RE.match(value):
            raise ValueError(f"label value {value!r} for {key!r} is invalid")
    return labels


def null_is_default(cls: type[BaseModel], value: Any, info: ValidationInfo) -> Any:
    """A ``before`` field validator: an explicit JSON ``null`` takes the field's default.

    Upstream's SDK sends ``"timeout_seconds": null`` and ``"env": null`` when the caller gave
    none; upstream's server took those as "the default", and so do we.
    """
    if value is None and info.field_name is not None:
        return cls.model_fields[info.field_name].get_default(call_default_factory=True)
    return value


def command_text(command: str | list[str]) -> str:
    """How a command is shown and stored: lists are shell-quoted, never joined lossily."""
    return command if isinstance(command, str) else shlex.join(command)


def epoch_seconds(value: datetime) -> float:
    return value.timestamp()


Timestamp = Annotated[
    datetime,
    PlainSerializer(epoch_seconds, return_type=float, when_used="json"),
    Field(description="Unix epoch seconds (a float), as upstream's timestamps"),
]
"""An instant that travels as Unix epoch seconds (a float), as upstream's ``created_at``,
``started_at`` and ``completed_at`` do; Python code sees a timezone-aware datetime (pydantic
reads the number back into one). Sandbox, job and heartbeat objects use it for every
timestamp; Orchard-only objects (keys, usage) keep ISO 8601."""


# --- sandboxes -----------------------------------------------------------------------------


class SandboxStatus(StrEnum):
    PENDING = "pending"
    READY = "ready"
    UNSCHEDULABLE = "unschedulable"
    FAILED = "failed"
    DELETED = "deleted"
    NOT_FOUND = "not_found"


class CreateSandboxRequest(BaseModel):
    """``POST /sandboxes``. Upstream fields first; ``timeout`` is upstream's readiness timeout."""

    model_config = ConfigDict(extra="forbid")

    image: str
    block_network: bool = True
    sandbox_id: str | None = None
    cpu: str | float | None = None
    memory: str | int | None = None
    timeout: int | None = Field(default=None, ge=1, le=86400)
    # Orchard extensions
    labels: dict[str, str] = Field(default_factory=dict)
    env: dict[str, str] = Field(default_factory=dict)
    workdir: str | None = None
    ttl_seconds: int | None = Field(default=None, ge=1)
    idle_timeout_seconds: int | None = Field(default=None, ge=1)

    @field_validator("image")
    @classmethod
    def _image(cls, v: str) -> str:
        return check_image(v)

    @field_validator("sandbox_id")
    @classmethod
    def _sandbox_id(cls, v: str | None) -> str | None:
        return None if v is None else check_sandbox_id(v)

    @field_validator("cpu")
    @classmethod
    def _cpu(cls, v: str | float | None) -> str | float | None:
        if v is not None:
            parse_cpu(v)
        return v

    @field_validator("memory")
    @classmethod
    def _memory(cls, v: str | int | None) -> str | int | None:
        if v is not None:
            parse_memory(v)
        return v

    @field_validator("labels")
    @classmethod
    def _labels(cls, v: dict[str, str]) -> dict[str, str]:
        return check_labels(v)

    @field_validator("workdir")
    @classmethod
    def _workdir(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith("/"):
            raise ValueError(f"workdir {v!r} must be an absolute path")
        return v


class SandboxInfo(BaseModel):
    """A sandbox as ``GET /sandboxes/{id}`` returns it (upstream fields + extensions).

    ``timeout`` (the readiness timeout, in seconds) is in upstream's create answer, which
    upstream's SDK reads to size its ``/wait``; here every answer carries it.
    """

    sandbox_id: str
    namespace: str
    image: str
    pod_name: str
    block_network: bool
    cpu: str
    memory: str
    created_at: Timestamp
    ready: bool
    status: SandboxStatus
    status_message: str = ""
    timeout: int
    # Orchard extensions
    labels: dict[str, str] = Field(default_factory=dict)
    owner: str | None = None
    workdir: str = "/workspace"
    env: dict[str, str] = Field(default_factory=dict)
    backend: str = ""
    expires_at: Timestamp | None = None
    idle_timeout_seconds: int | None = None
    last_activity_at: Timestamp | None = None
    deleted_at: Timestamp | None = None
    source_snapshot: str | None = None


class SandboxList(BaseModel):
    sandboxes: list[SandboxInfo]


class DeleteResponse(BaseModel):
    """``DELETE /sandboxes/{id}``. Deleting an already deleted sandbox answers the same, with
    ``already_deleted`` (upstream's clients delete on exit, maybe after the reaper did)."""

    status: Literal["deleted"] = "deleted"
    sandbox_id: str
    already_deleted: bool = False


class HeartbeatResponse(BaseModel):
    status: Literal["ok"] = "ok"
    sandbox_id: str
    expires_at: Timestamp | None = None


# --- exec and jobs -------------------------------------------------------------------------


class JobStatus(StrEnum):
    """Upstream's four: a finished job is ``succeeded`` or ``failed``, and upstream's clients
    poll until they see one of those. Why a job failed is in ``Job.timed_out``,
    ``Job.cancelled`` and ``Job.error``, never in a status of its own."""

    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"

    @property
    def done(self) -> bool:
        return self not in (JobStatus.QUEUED, JobStatus.RUNNING)


class ExecRequest(BaseModel):
    """``POST /sandboxes/{id}/exec`` (and ``/exec/stream``).

    ``command`` as a string runs through ``/bin/sh -c`` (bash for ``login_shell``); a list is
    an argv run directly. ``job_id`` makes the submission idempotent: the same id submitted
    again returns the existing job and never runs the command twice.
    """

    model_config = ConfigDict(extra="forbid")

    command: str | list[str]
    timeout_seconds: int = Field(
        default=300, ge=1, le=7 * 86400, description="seconds; null means the default"
    )
    cwd: str | None = None
    env: dict[str, str] = Field(
        default_factory=dict, description="added to the sandbox's; null means none"
    )
    login_shell: bool = False
    wait: bool = False
    # Orchard extensions
    job_id: str | None = Field(default=None, min_length=1, max_length=128, pattern=r"^[\w.-]+$")
    stdin: str | None = None
    max_output_bytes: int | None = Field(default=None, ge=0)

    @field_validator("command")
    @classmethod
    def _command(cls, v: str | list[str]) -> str | list[str]:
        if (isinstance(v, str) and not v.strip()) or (isinstance(v, list) and not v):
            raise ValueError("command is empty")
        return v

    _nulls = field_validator("timeout_seconds", "env", mode="before")(null_is_default)


class Job(BaseModel):
    """A command's run, as ``GET /jobs/{id}`` returns it."""

    job_id: str
    sandbox_id: str
    command: str
    status: JobStatus
    stdout: str = ""
    stderr: str = ""
    exit_code: int | None = None
    created_at: Timestamp
    started_at: Timestamp | None = None
    completed_at: Timestamp | None = None
    error: str | None = None
    # Orchard extensions (a timed-out or cancelled job is ``failed``)
    timed_out: bool = False
    cancelled: bool = False
    truncated: bool = False

    @property
    def succeeded(self) -> bool:
        return self.status == JobStatus.SUCCEEDED


class ExecEvent(BaseModel):
    """One NDJSON line of ``POST /sandboxes/{id}/exec/stream``.

    ``started`` (carries job_id), then any number of ``stdout``/``stderr`` (text in ``data``),
    then exactly one ``exit`` carrying the final ``job``; or, instead of ``exit``, an ``error``
    (``code`` and ``message``, as in an error answer) when the stream is ended by the service,
    e.g. because its API key was revoked. The command itself is not stopped by that.
    """

    event: Literal["started", "stdout", "stderr", "exit", "error"]
    job_id: str
    data: str | None = None
    job: Job | None = None
    code: str | None = None
    message: str | None = None


# --- files and patches ---------------------------------------------------------------------


class FileUpload(BaseModel):
    """``POST /sandboxes/{id}/files``: upstream's base64 upload."""

    path: str
    content: str
    mode: int | None = Field(default=None, ge=0, le=0o7777)


class FileUploadResult(BaseModel):
    success: bool = True
    path: str
    size: int


class FileContent(BaseModel):
    """``GET /sandboxes/{id}/files?path=``: upstream's base64 download."""

    path: str
    content: str
    size: int


class FileEntry(BaseModel):
    name: str
    type: Literal["file", "directory", "symlink", "other"]
    size: int
    modified: datetime


class FileList(BaseModel):
    """``GET /sandboxes/{id}/files/list?path=``: upstream's shape. ``path`` is the one asked
    for (the sandbox's workdir when none was); entries are sorted by name."""

    path: str
    files: list[FileEntry]


class MkdirRequest(BaseModel):
    path: str
    parents: bool = True


class MkdirResult(BaseModel):
    """``POST /sandboxes/{id}/files/mkdir``."""

    path: str


class FileDeleteResult(BaseModel):
    """``DELETE /sandboxes/{id}/files?path=``."""

    deleted: str


class PatchRequest(BaseModel):
    """``POST /sandboxes/{id}/apply_patch``. Upstream: ``patch``, ``timeout_seconds``."""

    model_config = ConfigDict(extra="forbid")

    patch: str
    timeout_seconds: int = Field(default=30, ge=1, le=3600)
    cwd: str | None = None
    check: bool = False
    three_way: bool = False
    reverse: bool = False


class PatchResult(BaseModel):
    success: bool
    stdout: str
    stderr: str
    exit_code: int | None
    error: str | None = None


# --- keys, usage, health -------------------------------------------------------------------


class KeyQuota(BaseModel):
    """A key's own limits on what its live sandboxes may hold at once (None: the service's
    per-key default)."""

    max_sandboxes: int | None = Field(default=None, ge=1, le=100_000)
    max_cpu: float | None = Field(default=None, gt=0, le=100_000)
    max_memory: str | None = Field(default=None, max_length=32)

    @field_validator("max_memory")
    @classmethod
    def _memory(cls, v: str | None) -> str | None:
        if v is not None:
            parse_memory(v)
        return v


class KeyCreateRequest(KeyQuota):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[\w.@-]+$")
    admin: bool = False


class KeyInfo(KeyQuota):
    key_id: str
    name: str
    admin: bool
    created_at: datetime
    revoked_at: datetime | None = None


class KeyCreated(KeyInfo):
    """Returned once, at creation: the only time the secret is shown."""

    api_key: str


class UsageRecord(BaseModel):
    """Sandbox-seconds of one sandbox within the asked period, with its size and labels."""

    sandbox_id: str
    owner: str | None
    image: str
    cpu: float
    memory_bytes: int
    labels: dict[str, str]
    started_at: datetime
    ended_at: datetime | None
    seconds: float


class UsageReport(BaseModel):
    since: datetime
    until: datetime
    records: list[UsageRecord]


class ServiceBanner(BaseModel):
    """``GET /``."""

    service: Literal["orchard"] = "orchard"
    version: str
    status: Literal["running"] = "running"


class ResourceAmounts(BaseModel):
    cpu: float  # cores
    memory_bytes: int


class NodeResources(BaseModel):
    name: str
    capacity: ResourceAmounts
    allocatable: ResourceAmounts


class ResourcesReport(BaseModel):
    """``GET /resources``: capacity, what live sandboxes asked for, and what is left."""

    backend: str
    nodes: list[NodeResources]
    totals: ResourceAmounts  # allocatable, summed over nodes
    requests: ResourceAmounts  # summed over live sandboxes
    available: ResourceAmounts  # totals - requests, never below zero
    sandboxes: int


class Health(BaseModel):
    status: Literal["healthy", "degraded"] = "healthy"
    version: str
    backend: str


# --- PTY (websocket JSON frames, upstream-compatible) ------------------------------------


class PtyInit(BaseModel):
    type: Literal["init"] = "init"
    cmd: list[str] = Field(default_factory=lambda: ["/bin/sh"])
    env: dict[str, str] = Field(default_factory=dict)
    cwd: str | None = None
    rows: int = Field(default=24, ge=1, le=1000)
    cols: int = Field(default=80, ge=1, le=1000)
    login_shell: bool = False

    _nulls = field_validator("env", "rows", "cols", mode="before")(null_is_default)


PTY_CLIENT_TYPES = ("init", "stdin", "signal", "resize", "close")
PTY_SERVER_TYPES = ("ready", "stdout", "exit", "error")
PTY_SIGNALS = ("TERM", "KILL", "INT", "HUP", "QUIT")


# --- snapshots, restore and fork (Orchard extension) ---------------------------------------

MAX_FORK_COUNT = 64


class SnapshotRequest(BaseModel):
    """``POST /sandboxes/{id}/snapshot``: commit the sandbox's filesystem (not its processes)."""

    model_config = ConfigDict(extra="forbid")

    name: str | None = Field(default=None, min_length=1, max_length=128)
    labels: dict[str, str] = Field(default_factory=dict)
    ttl_seconds: int | None = Field(
        default=None, ge=1, description="delete it this long after it was taken; none: keep"
    )

    @field_validator("labels")
    @classmethod
    def _labels(cls, v: dict[str, str]) -> dict[str, str]:
        return check_labels(v)


class Snapshot(BaseModel):
    """A sandbox's filesystem at one moment, and what a sandbox restored from it gets.

    ``parent_snapshot`` is the snapshot the source sandbox was itself restored from, so
    snapshots form a tree. ``size_bytes`` is what the snapshot adds on top of the image the
    source sandbox ran (its own layer). ``cpu``, ``memory``, ``block_network``, ``workdir``,
    ``env`` and ``sandbox_labels`` are the source sandbox's, kept by every restore.
    """

    snapshot_id: str
    name: str | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    owner: str | None = None
    source_sandbox: str
    parent_snapshot: str | None = None
    image: str
    size_bytes: int
    backend: str = ""
    cpu: str
    memory: str
    block_network: bool
    workdir: str
    env: dict[str, str] = Field(default_factory=dict)
    sandbox_labels: dict[str, str] = Field(default_factory=dict)
    created_at: datetime
    expires_at: datetime | None = None
    deleted_at: datetime | None = None


class SnapshotList(BaseModel):
    snapshots: list[Snapshot]


class SnapshotDeleteResult(BaseModel):
    """``DELETE /snapshots/{id}``: the snapshots deleted, children before their parents."""

    deleted: list[str]


class RestoreRequest(BaseModel):
    """``POST /snapshots/{id}/restore``: a new sandbox from a snapshot, ready on return.

    It keeps the source sandbox's resources, workdir, network setting, env and labels;
    ``env`` and ``labels`` given here are added over the kept ones.
    """

    model_config = ConfigDict(extra="forbid")

    sandbox_id: str | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    env: dict[str, str] = Field(default_factory=dict)
    timeout: int | None = Field(default=None, ge=1, le=86400)
    ttl_seconds: int | None = Field(default=None, ge=1)
    idle_timeout_seconds: int | None = Field(default=None, ge=1)

    @field_validator("sandbox_id")
    @classmethod
    def _sandbox_id(cls, v: str | None) -> str | None:
        return None if v is None else check_sandbox_id(v)

    @field_validator("labels")
    @classmethod
    def _labels(cls, v: dict[str, str]) -> dict[str, str]:
        return check_labels(v)


class ForkRequest(BaseModel):
    """``POST /sandboxes/{id}/fork``: snapshot a sandbox and restore it ``count`` times,
    concurrently. ``labels`` are added to every new sandbox's; ``sandbox_ids`` (optional)
    names them, one per fork."""

    model_config = ConfigDict(extra="forbid")

    count: int = Field(ge=1, le=MAX_FORK_COUNT)
    labels: dict[str, str] = Field(default_factory=dict)
    sandbox_ids: list[str] | None = None

    @field_validator("labels")
    @classmethod
    def _labels(cls, v: dict[str, str]) -> dict[str, str]:
        return check_labels(v)

    @field_validator("sandbox_ids")
    @classmethod
    def _sandbox_ids(cls, v: list[str] | None, info: ValidationInfo) -> list[str] | None:
        if v is None:
            return None
        for sandbox_id in v:
            check_sandbox_id(sandbox_id)
        if len(set(v)) != len(v):
            raise ValueError("sandbox_ids must not repeat an id")
        count = info.data.get("count")
        if count is not None and len(v) != count:
            raise ValueError(f"sandbox_ids names {len(v)} sandboxes but count is {count}")
        return v


class ForkFailure(BaseModel):
    """One fork that did not come up: the error it raised, as on the wire."""

    sandbox_id: str
    code: str
    message: str


class ForkResult(BaseModel):
    """The snapshot taken, the sandboxes that are ready, and every fork that failed."""

    snapshot: Snapshot
    sandboxes: list[SandboxInfo]
    failures: list[ForkFailure] = Field(default_factory=list)


# --- warm pools ------------------------------------------------------------------------------

MAX_POOL_SIZE = 500


class PoolSpec(BaseModel):
    """What a pool's sandboxes are made with: a create request with the same image, cpu,
    memory, network, env and workdir (after defaults) and no ``sandbox_id`` takes one."""

    model_config = ConfigDict(extra="forbid")

    image: str
    block_network: bool = True
    cpu: str | float | None = None
    memory: str | int | None = None
    env: dict[str, str] = Field(default_factory=dict)
    workdir: str | None = None

    @field_validator("image")
    @classmethod
    def _image(cls, v: str) -> str:
        return check_image(v)

    @field_validator("cpu")
    @classmethod
    def _cpu(cls, v: str | float | None) -> str | float | None:
        return CreateSandboxRequest._cpu(v)

    @field_validator("memory")
    @classmethod
    def _memory(cls, v: str | int | None) -> str | int | None:
        return CreateSandboxRequest._memory(v)

    @field_validator("workdir")
    @classmethod
    def _workdir(cls, v: str | None) -> str | None:
        return CreateSandboxRequest._workdir(v)


class PoolCreateRequest(PoolSpec):
    """``POST /pools`` (admin)."""

    name: str = Field(description="The pool's id: a DNS label, e.g. debian-small.")
    size: int = Field(ge=0, le=MAX_POOL_SIZE, description="Ready sandboxes to keep.")
    ttl_seconds: int | None = Field(
        default=None,
        ge=60,
        description="How long a pooled sandbox waits unclaimed before it is replaced "
        "(default: the service's sandbox TTL, else one hour).",
    )

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not SANDBOX_ID_RE.match(v):
            raise ValueError(
                f"pool name {v!r} is not a DNS label: use 1-63 lowercase letters, digits "
                "and '-', starting and ending with a letter or digit"
            )
        return v


class PoolResizeRequest(BaseModel):
    """``PATCH /pools/{name}`` (admin)."""

    model_config = ConfigDict(extra="forbid")

    size: int = Field(ge=0, le=MAX_POOL_SIZE)


class PoolInfo(BaseModel):
    name: str
    image: str
    block_network: bool
    cpu: str
    memory: str
    env: dict[str, str]
    workdir: str
    size: int
    ttl_seconds: int
    ready: int = Field(description="Sandboxes ready to be claimed now.")
    starting: int = Field(description="Sandboxes being made to refill the pool.")
    error: str | None = Field(
        default=None, description="Why the last refill could not start a sandbox, if it failed."
    )
    created_at: Timestamp


class PoolList(BaseModel):
    pools: list[PoolInfo]


# --- errors ----------------------------------------------------------------------------------


class ErrorDetail(BaseModel):
    code: str
    message: str
    hint: str | None = None


class ErrorBody(BaseModel):
    """Every error answer: the ``code`` names the :mod:`orchard_env.errors` class."""

    detail: ErrorDetail
