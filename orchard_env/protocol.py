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
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PlainSerializer,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from orchard_env.errors import InvalidRequest
from orchard_env.quantities import parse_memory, sandbox_cpu, sandbox_memory
from orchard_env.tools import check_harnesses

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
# Bounds every request obeys (docs/api.md, "Limits"): each is a 400 naming the field.
MAX_TTL_SECONDS = 30 * 86400
"""``ttl_seconds`` and ``idle_timeout_seconds`` of a sandbox."""
MAX_SNAPSHOT_TTL_SECONDS = 365 * 86400
MAX_READY_TIMEOUT_SECONDS = 86400
MAX_EXEC_TIMEOUT_SECONDS = 7 * 86400
MAX_OUTPUT_CAP_BYTES = 1024**3
MAX_IMAGE_LENGTH = 255  # the OCI/Docker limit on a reference
MAX_PATH_LENGTH = 4096  # PATH_MAX
MAX_ENV_ENTRIES = 256
MAX_LABELS = 64
MAX_ARGV_ITEMS = 4096
MAX_TEXT_LENGTH = 1024**2
"""Characters of a command, an env value, a PTY init field."""


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


def check_labels(labels: dict[str, str]) -> dict[str, str]:
    if len(labels) > MAX_LABELS:
        raise ValueError(f"{len(labels)} labels is more than the {MAX_LABELS} allowed")
    for key, value in labels.items():
        if not LABEL_KEY_RE.match(key):
            raise ValueError(f"label key {key!r} is invalid (letters, digits, '-', '_', '.')")
        if not LABEL_VALUE_RE.match(value):
            raise ValueError(f"label value {value!r} for {key!r} is invalid")
    return labels


def check_no_nul(value: str, what: str) -> str:
    if "\0" in value:
        raise ValueError(f"{what} contains a NUL character, which no path or command can hold")
    return value


def check_path(value: str, what: str = "the path") -> str:
    if len(value) > MAX_PATH_LENGTH:
        raise ValueError(f"{what} is {len(value)} characters, over the {MAX_PATH_LENGTH} allowed")
    return check_no_nul(value, what)


def check_env(env: dict[str, str]) -> dict[str, str]:
    """Environment variables: at most :data:`MAX_ENV_ENTRIES`; a name is not empty and has
    no ``=``; nothing holds a NUL."""
    if len(env) > MAX_ENV_ENTRIES:
        raise ValueError(f"{len(env)} variables is more than the {MAX_ENV_ENTRIES} allowed")
    for key, value in env.items():
        if not key or "=" in key:
            raise ValueError(f"env name {key!r} must be non-empty and must not contain '='")
        check_no_nul(key, f"env name {key!r}")
        check_no_nul(value, f"env {key!r}")
        if len(value) > MAX_TEXT_LENGTH:
            raise ValueError(f"env {key!r} is longer than {MAX_TEXT_LENGTH} characters")
    return env


def _check_unicode(value: Any, where: str) -> None:
    if isinstance(value, str):
        try:
            value.encode()
        except UnicodeEncodeError as exc:
            raise ValueError(
                f"{where} is not valid Unicode text: it holds a lone surrogate "
                f"({value[exc.start : exc.end]!a} at character {exc.start})"
            ) from None
    elif isinstance(value, list | tuple):
        for item in value:
            _check_unicode(item, where)
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_unicode(key, where)
            _check_unicode(item, where)


class RequestModel(BaseModel):
    """A request body (or frame): every string must be encodable as
    UTF-8 (JSON's ``\\ud800`` escapes can name a lone surrogate, which no agent, engine or
    database can take)."""

    @field_validator("*", mode="after")
    @classmethod
    def _unicode(cls, value: Any, info: ValidationInfo) -> Any:
        _check_unicode(value, info.field_name or "a field")
        return value


_LOCATIONS = ("body", "query", "path", "header", "cookie")


def validation_message(errors: list[Any]) -> str:
    """Pydantic's errors as one line naming each field (request validation's 400)."""
    parts = []
    for error in errors:
        loc = [str(p) for p in error.get("loc", ())]
        if loc and loc[0] in _LOCATIONS:  # where the field was, not a field (one may be "path")
            loc = loc[1:]
        message = str(error.get("msg", "invalid")).removeprefix("Value error, ")
        if error.get("type") == "string_unicode":
            message = "not valid Unicode text (a lone surrogate such as \\ud800)"
        if error.get("type") == "json_invalid":
            parts.append(f"the request body is not valid JSON: {message}")
        else:
            parts.append(f"{'.'.join(loc)}: {message}" if loc else message)
    return "; ".join(parts) or "invalid request"


def null_is_default(cls: type[BaseModel], value: Any, info: ValidationInfo) -> Any:
    """A ``before`` field validator: an explicit JSON ``null`` takes the field's default.

    Upstream's SDK sends ``"timeout_seconds": null`` and ``"env": null`` when the caller gave
    none; upstream's server took those as "the default", and so do we.
    """
    if value is None and info.field_name is not None:
        return cls.model_fields[info.field_name].get_default(call_default_factory=True)
    return value


def shell_command(command: str | list[str]) -> str:
    """The shell text a ``command`` runs as: a list is joined with spaces, as upstream's agent
    joined it, so ``["ls", "*.py"]`` globs and ``["echo hi && echo there"]`` is one line."""
    return command if isinstance(command, str) else " ".join(command)


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


Cpu = Annotated[
    str | float,
    Field(description='cores: 2, 0.5 or "500m"; at least 0.01 (10m)'),
]
Memory = Annotated[
    str | int,
    Field(description='bytes, or a quantity: "512Mi", "8Gi", "8G" (8e9 bytes); at least 32Mi'),
]
# Constraints the validators enforce (with their own messages), stated in the JSON schema too
# so generated clients and fuzzers see them.
_NO_NUL = r"^[^\x00]*$"
Text = Annotated[str, Field(max_length=MAX_TEXT_LENGTH, json_schema_extra={"pattern": _NO_NUL})]
Command = Annotated[
    str,
    Field(
        max_length=MAX_TEXT_LENGTH,
        json_schema_extra={"pattern": r"^[^\x00]*[^\s\x00][^\x00]*$"},  # not blank, no NUL
    ),
]
Env = Annotated[
    dict[str, str],
    Field(
        max_length=MAX_ENV_ENTRIES,
        description="names non-empty, without '='; no NUL anywhere",
        json_schema_extra={
            "propertyNames": {"pattern": r"^[^=\x00]+$"},
            "additionalProperties": {
                "type": "string",
                "maxLength": MAX_TEXT_LENGTH,
                "pattern": _NO_NUL,
            },
        },
    ),
    AfterValidator(check_env),
]
Labels = Annotated[
    dict[str, str],
    Field(
        max_length=MAX_LABELS,
        json_schema_extra={
            "propertyNames": {"pattern": LABEL_KEY_RE.pattern},
            "additionalProperties": {"type": "string", "pattern": LABEL_VALUE_RE.pattern},
        },
    ),
    AfterValidator(check_labels),
]
AbsolutePath = Annotated[
    str,
    Field(min_length=1, max_length=MAX_PATH_LENGTH, json_schema_extra={"pattern": r"^/[^\x00]*$"}),
    AfterValidator(check_path),
]
SandboxPath = Annotated[
    str,
    Field(
        min_length=1,
        max_length=MAX_PATH_LENGTH,
        description="absolute, or relative",
        json_schema_extra={"pattern": _NO_NUL},
    ),
    AfterValidator(check_path),
]
SandboxId = Annotated[str, Field(json_schema_extra={"pattern": SANDBOX_ID_RE.pattern})]


TRAJECTORY_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
TrajectoryId = Annotated[
    str,
    Field(
        min_length=1,
        max_length=128,
        json_schema_extra={"pattern": TRAJECTORY_ID_RE.pattern},
        description="1-128 of A-Z a-z 0-9 . _ : -, starting with a letter or digit",
    ),
    AfterValidator(lambda v: _check_trajectory(v)),
]


def _check_trajectory(value: str) -> str:
    if not TRAJECTORY_ID_RE.fullmatch(value):
        raise ValueError(
            f"trajectory_id {value[:60]!r}: use 1-128 of A-Z a-z 0-9 . _ : -, "
            "starting with a letter or digit"
        )
    return value


class ModelGatewaySpec(RequestModel):
    """``model_gateway`` of a create: a model gateway at ``127.0.0.1:4000`` in the sandbox,
    forwarding to endpoints the service configured (by name; default: the service's)."""

    model_config = ConfigDict(extra="forbid")

    openai: str | None = Field(
        default=None, max_length=128, description="an OpenAI-compatible endpoint of the service"
    )
    anthropic: str | None = Field(
        default=None, max_length=128, description="an Anthropic Messages endpoint of the service"
    )
    model: str | None = Field(
        default=None, max_length=256, description="the model the harnesses are configured for"
    )
    trajectory_id: TrajectoryId | None = None
    max_calls: int | None = Field(
        default=None, ge=1, description="model calls the sandbox may make"
    )
    max_tokens: int | None = Field(
        default=None, ge=1, description="input + output tokens the sandbox may use"
    )


class ModelGatewayInfo(BaseModel):
    """A sandbox's gateway: its endpoints (by name), model, current trajectory and budget."""

    openai: str | None = None
    anthropic: str | None = None
    model: str | None = None
    trajectory_id: str = "default"
    max_calls: int | None = None
    max_tokens: int | None = None
    base_url: str = "http://127.0.0.1:4000"


class TrajectoryRequest(RequestModel):
    """``PUT /sandboxes/{id}/trajectory``: where the sandbox's next model calls go."""

    model_config = ConfigDict(extra="forbid")

    trajectory_id: TrajectoryId


class TrajectorySummary(BaseModel):
    trajectory_id: str
    calls: int
    first_at: str
    last_at: str
    input_tokens: int
    output_tokens: int
    errors: int


class TrajectoryList(BaseModel):
    trajectories: list[TrajectorySummary]


class ModelCallList(BaseModel):
    """Recorded model calls (``orchard.model_call/v1`` records), oldest first."""

    calls: list[dict[str, Any]]


class CreateSandboxRequest(RequestModel):
    """``POST /sandboxes``. Upstream fields first; ``timeout`` is upstream's readiness timeout."""

    model_config = ConfigDict(extra="forbid")

    image: str = Field(max_length=MAX_IMAGE_LENGTH, json_schema_extra={"pattern": IMAGE_RE.pattern})
    block_network: bool = True
    sandbox_id: SandboxId | None = None
    cpu: Cpu | None = None
    memory: Memory | None = None
    timeout: int | None = Field(default=None, ge=1, le=MAX_READY_TIMEOUT_SECONDS)
    # Orchard extensions
    labels: Labels = Field(default_factory=dict)
    env: Env = Field(default_factory=dict)
    workdir: AbsolutePath | None = None
    ttl_seconds: int | None = Field(default=None, ge=1, le=MAX_TTL_SECONDS)
    idle_timeout_seconds: int | None = Field(default=None, ge=1, le=MAX_TTL_SECONDS)
    disk: Memory | None = Field(
        default=None,
        description="disk the sandbox may write, as a quantity (at least 32Mi); refused "
        "(400) where the backend cannot enforce it",
    )
    model_gateway: ModelGatewaySpec | None = Field(
        default=None,
        description="a model gateway in the sandbox (127.0.0.1:4000), its calls recorded; "
        "{} for the service's default endpoints",
    )
    tools: bool | list[str] | None = Field(
        default=None,
        description="agent harnesses at /opt/sandbox-tools: true or absent for all the "
        "service has, false for none, or a list of codex, claude, opencode, pi, hermes",
    )

    @field_validator("tools")
    @classmethod
    def _tools(cls, v: bool | list[str] | None) -> bool | list[str] | None:
        if isinstance(v, list):
            try:
                return list(check_harnesses(v))
            except InvalidRequest as exc:
                raise ValueError(exc.message) from None
        return v

    def tool_selection(self) -> tuple[str, ...] | None:
        """None: all the service has; otherwise exactly these (``()``: none)."""
        if self.tools is None or self.tools is True:
            return None
        return () if self.tools is False else tuple(self.tools)

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
            sandbox_cpu(v)
        return v

    @field_validator("memory", "disk")
    @classmethod
    def _memory(cls, v: str | int | None, info: ValidationInfo) -> str | int | None:
        if v is not None:
            sandbox_memory(v, info.field_name or "memory")
        return v

    @field_validator("workdir", mode="before")
    @classmethod
    def _workdir(cls, v: Any) -> Any:
        if isinstance(v, str) and not v.startswith("/"):
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
    disk: str | None = None
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
    model_gateway: ModelGatewayInfo | None = None
    tools: list[str] | None = Field(
        default=None, description="the harnesses it asked for (null: all the service has)"
    )


class SandboxList(BaseModel):
    """``GET /sandboxes``. With ``limit``, one page: ``continue`` (as in Kubernetes lists) is
    set while more may follow; pass it back as the ``continue`` query parameter. A page may
    hold fewer than ``limit`` sandboxes (label filters apply after paging)."""

    sandboxes: list[SandboxInfo]
    continue_token: str | None = Field(default=None, alias="continue")


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


class ExecRequest(RequestModel):
    """``POST /sandboxes/{id}/exec`` (and ``/exec/stream``).

    ``command`` runs through bash (``/bin/sh`` in images without bash), as upstream's agent
    ran it; a list is joined with spaces first, as upstream joined it. ``argv`` (an Orchard
    extension, instead of ``command``) runs an exact argv with no shell in between.
    ``job_id`` makes the submission idempotent: the same id submitted again returns the
    existing job and never runs the command twice.
    """

    model_config = ConfigDict(extra="forbid")

    command: (
        Command
        | Annotated[list[Text], Field(max_length=MAX_ARGV_ITEMS, json_schema_extra={"minItems": 1})]
        | None
    ) = Field(default=None, description="shell text; a list is joined with spaces (as upstream)")
    timeout_seconds: int = Field(
        default=300,
        ge=1,
        le=MAX_EXEC_TIMEOUT_SECONDS,
        description="seconds; null means the default",
    )
    cwd: SandboxPath | None = None
    env: Env = Field(default_factory=dict, description="added to the sandbox's; null means none")
    login_shell: bool = False
    wait: bool = False
    # Orchard extensions
    argv: Annotated[list[Text], Field(min_length=1, max_length=MAX_ARGV_ITEMS)] | None = Field(
        default=None, description="an exact argv run with no shell, instead of command"
    )
    job_id: str | None = Field(default=None, min_length=1, max_length=128, pattern=r"^[\w.-]+$")
    stdin: str | None = None
    max_output_bytes: int | None = Field(default=None, ge=0, le=MAX_OUTPUT_CAP_BYTES)

    @field_validator("command")
    @classmethod
    def _command(cls, v: str | list[str] | None) -> str | list[str] | None:
        if v is None:
            return v
        if not shell_command(v).strip():
            raise ValueError("command is empty")
        for part in [v] if isinstance(v, str) else v:
            check_no_nul(part, "command")
        return v

    @model_validator(mode="after")
    def _one_command(self) -> ExecRequest:
        if (self.command is None) == (self.argv is None):
            raise ValueError(
                "give exactly one of command (shell text, or a list joined with spaces) "
                "and argv (an exact argv run without a shell)"
            )
        return self

    @property
    def agent_command(self) -> str | list[str]:
        """What the agent runs: shell text (a string) or an exact argv (a list)."""
        return self.argv if self.argv is not None else shell_command(self.command or "")

    @property
    def text(self) -> str:
        """How the command is shown and stored (``Job.command``): the shell text as it runs,
        an exact argv shell-quoted."""
        return shlex.join(self.argv) if self.argv is not None else shell_command(self.command or "")

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
    # Orchard extensions (a timed-out, cancelled or OOM-killed job is ``failed``)
    timed_out: bool = False
    cancelled: bool = False
    oom_killed: bool = Field(
        default=False,
        description="the kernel's OOM killer ended the command: it went over the sandbox's "
        "memory limit (error says the limit)",
    )
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


class FileUpload(RequestModel):
    """``POST /sandboxes/{id}/files``: upstream's base64 upload."""

    path: SandboxPath
    content: str = Field(
        description="base64; the whole body is capped (413 past the cap)",
        json_schema_extra={"format": "byte"},
    )
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


class MkdirRequest(RequestModel):
    path: SandboxPath
    parents: bool = True


class MkdirResult(BaseModel):
    """``POST /sandboxes/{id}/files/mkdir``."""

    path: str


class FileDeleteResult(BaseModel):
    """``DELETE /sandboxes/{id}/files?path=``."""

    deleted: str


class PatchRequest(RequestModel):
    """``POST /sandboxes/{id}/apply_patch``. Upstream: ``patch``, ``timeout_seconds``."""

    model_config = ConfigDict(extra="forbid")

    patch: str
    timeout_seconds: int = Field(default=30, ge=1, le=3600)
    cwd: SandboxPath | None = None
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


class KeyCreateRequest(RequestModel, KeyQuota):
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


class SandboxPod(BaseModel):
    """One live sandbox's requests: an entry of upstream's ``sandbox_pods``."""

    name: str  # the pod (Kubernetes) or the sandbox id (local engine)
    namespace: str
    phase: str  # Kubernetes' pod phase: Pending or Running
    cpu_request: float  # cores
    memory_request_bytes: int
    # Orchard extension: the sandbox it is (None for a pod of another service in the namespace)
    sandbox_id: str | None = None


class ResourcesReport(BaseModel):
    """``GET /resources``: capacity, what live sandboxes asked for, and what is left.

    Upstream's fields come first (``status`` … ``sandbox_pods``); ``totals`` and ``requests``
    are Orchard's older names for ``total_allocatable`` and ``total_requested``. With
    ``scope`` ``key`` (a non-admin key) every figure that comes from sandboxes counts only
    that key's own: ``total_requested``, ``available``, ``sandbox_pods``, ``sandboxes``.
    """

    status: Literal["ok"] = "ok"
    nodes: list[NodeResources]
    total_capacity: ResourceAmounts
    total_allocatable: ResourceAmounts
    total_requested: ResourceAmounts
    available: ResourceAmounts  # total_allocatable - total_requested, never below zero
    sandbox_pods: list[SandboxPod]
    # Orchard extensions
    scope: Literal["service", "key"]
    backend: str
    totals: ResourceAmounts  # = total_allocatable
    requests: ResourceAmounts  # = total_requested
    sandboxes: int  # live sandboxes counted in total_requested


class Health(BaseModel):
    status: Literal["healthy", "degraded"] = "healthy"
    version: str
    backend: str


# --- PTY (websocket JSON frames, upstream-compatible) ------------------------------------


class PtyInit(RequestModel):
    type: Literal["init"] = "init"
    cmd: list[Text] = Field(
        default_factory=lambda: ["/bin/sh"], min_length=1, max_length=MAX_ARGV_ITEMS
    )
    env: Env = Field(default_factory=dict)
    cwd: SandboxPath | None = None
    rows: int = Field(default=24, ge=1, le=1000)
    cols: int = Field(default=80, ge=1, le=1000)
    login_shell: bool = False

    _nulls = field_validator("env", "rows", "cols", mode="before")(null_is_default)

    @field_validator("cmd")
    @classmethod
    def _cmd(cls, v: list[str]) -> list[str]:
        for part in v:
            check_no_nul(part, "cmd")
        return v


PTY_CLIENT_TYPES = ("init", "stdin", "signal", "resize", "close")
PTY_SERVER_TYPES = ("ready", "stdout", "exit", "error")
PTY_SIGNALS = ("TERM", "KILL", "INT", "HUP", "QUIT")


# --- snapshots, restore and fork (Orchard extension) ---------------------------------------

MAX_FORK_COUNT = 64


class SnapshotRequest(RequestModel):
    """``POST /sandboxes/{id}/snapshot``: commit the sandbox's filesystem (not its processes)."""

    model_config = ConfigDict(extra="forbid")

    name: str | None = Field(default=None, min_length=1, max_length=128)
    labels: Labels = Field(default_factory=dict)
    ttl_seconds: int | None = Field(
        default=None,
        ge=1,
        le=MAX_SNAPSHOT_TTL_SECONDS,
        description="delete it this long after it was taken; none: keep",
    )


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


class RestoreRequest(RequestModel):
    """``POST /snapshots/{id}/restore``: a new sandbox from a snapshot, ready on return.

    It keeps the source sandbox's resources, workdir, network setting, env and labels;
    ``env`` and ``labels`` given here are added over the kept ones.
    """

    model_config = ConfigDict(extra="forbid")

    sandbox_id: SandboxId | None = None
    labels: Labels = Field(default_factory=dict)
    env: Env = Field(default_factory=dict)
    timeout: int | None = Field(default=None, ge=1, le=MAX_READY_TIMEOUT_SECONDS)
    ttl_seconds: int | None = Field(default=None, ge=1, le=MAX_TTL_SECONDS)
    idle_timeout_seconds: int | None = Field(default=None, ge=1, le=MAX_TTL_SECONDS)

    @field_validator("sandbox_id")
    @classmethod
    def _sandbox_id(cls, v: str | None) -> str | None:
        return None if v is None else check_sandbox_id(v)


class ForkRequest(RequestModel):
    """``POST /sandboxes/{id}/fork``: snapshot a sandbox and restore it ``count`` times,
    concurrently. ``labels`` are added to every new sandbox's; ``sandbox_ids`` (optional)
    names them, one per fork."""

    model_config = ConfigDict(extra="forbid")

    count: int = Field(ge=1, le=MAX_FORK_COUNT)
    labels: Labels = Field(default_factory=dict)
    sandbox_ids: list[SandboxId] | None = Field(default=None, max_length=MAX_FORK_COUNT)

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


class PoolSpec(RequestModel):
    """What a pool's sandboxes are made with: a create request with the same image, cpu,
    memory, network, env and workdir (after defaults) and no ``sandbox_id`` or ``disk``
    takes one."""

    model_config = ConfigDict(extra="forbid")

    image: str = Field(max_length=MAX_IMAGE_LENGTH, json_schema_extra={"pattern": IMAGE_RE.pattern})
    block_network: bool = True
    cpu: Cpu | None = None
    memory: Memory | None = None
    env: Env = Field(default_factory=dict)
    workdir: AbsolutePath | None = None

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
    def _memory(cls, v: str | int | None, info: ValidationInfo) -> str | int | None:
        return CreateSandboxRequest._memory(v, info)

    @field_validator("workdir", mode="before")
    @classmethod
    def _workdir(cls, v: Any) -> Any:
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
