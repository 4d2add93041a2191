"""The contract every sandbox backend implements (local engine, Kubernetes).

A backend does lifecycle only: create, inspect, list, delete (and snapshot where it can).
Exec and file I/O never go through it: they go straight to the agent at
:attr:`BackendSandbox.agent`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Protocol, runtime_checkable

from orchard_env.errors import SnapshotNotFound
from orchard_env.protocol import NodeResources, SandboxPod

SANDBOX_CAPABILITIES = (
    "CHOWN",
    "DAC_OVERRIDE",
    "FOWNER",
    "FSETID",
    "KILL",
    "SETGID",
    "SETUID",
    "SETFCAP",
    "NET_BIND_SERVICE",
)
"""The only Linux capabilities a sandbox's root has (every backend drops all others): what
package installs and test suites use (file ownership and modes, su/setpriv to another user,
signals, low ports). Not kept: SETPCAP, SYS_CHROOT, MKNOD, NET_RAW, AUDIT_WRITE."""


class Capability(StrEnum):
    NETWORK_ISOLATION = "network_isolation"
    SNAPSHOT = "snapshot"
    PTY = "pty"


class SandboxState(StrEnum):
    CREATING = "creating"  # accepted by the backend, not running yet
    RUNNING = "running"  # the container/pod runs (the agent may still be starting)
    UNSCHEDULABLE = "unschedulable"
    EXITED = "exited"  # the container stopped: the sandbox is dead
    FAILED = "failed"  # could not start (reason says why)


@dataclass(frozen=True)
class AgentEndpoint:
    """How the orchestrator reaches a sandbox's agent: a unix socket path or host:port."""

    token: str
    uds: str | None = None
    host: str | None = None
    port: int | None = None

    def base_url(self) -> str:
        if self.uds is not None:
            return "http://agent"
        return f"http://{self.host}:{self.port}"


@dataclass(frozen=True)
class SandboxSpec:
    """Everything a backend needs to start one sandbox."""

    sandbox_id: str
    image: str
    cpu: float  # cores
    memory_bytes: int
    block_network: bool
    workdir: str
    agent_token: str
    # What the sandbox may write (None: the backend's default). A backend that cannot enforce
    # it raises InvalidRequest saying so, never ignores it.
    disk_bytes: int | None = None
    owner: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)  # the user's labels
    pids_limit: int = 4096
    ttl_seconds: int | None = None  # lifetime cap; the orchestrator's reaper enforces it
    # How long the whole start may take, an image pull included (None: the service's default).
    ready_timeout_seconds: int | None = None
    # Serialised orchestrator record kept on the container/pod so a restart with lost
    # state can adopt it without guessing (see reconciliation).
    record_annotation: str | None = None
    # The snapshot this sandbox restores (the orchestrator checked the caller owns it). A
    # backend refuses an image that is a snapshot image of any other snapshot.
    snapshot_id: str | None = None
    # The harnesses of the tools payload to mount (None: all the service has; (): none).
    tools: tuple[str, ...] | None = None


@dataclass(frozen=True)
class BackendSandbox:
    """What a backend knows about one sandbox it runs."""

    sandbox_id: str
    state: SandboxState
    agent: AgentEndpoint | None
    created_at: datetime
    reason: str | None = None
    exit_code: int | None = None
    record_annotation: str | None = None


@dataclass(frozen=True)
class SnapshotImage:
    """A committed sandbox filesystem: an image a new sandbox can be created from."""

    ref: str  # what SandboxSpec.image names to restore it
    size_bytes: int  # what it adds on top of the image the sandbox ran (its own layer)


@dataclass(frozen=True)
class Capacity:
    """What a backend's substrate offers, for ``GET /resources``."""

    nodes: list[NodeResources]  # the machines sandboxes can run on
    # Every live pod in the sandbox namespace with its requests, where the backend sees them
    # (Kubernetes); None where the orchestrator's records are the only view (local engine).
    pods: list[SandboxPod] | None = None


def not_your_snapshot(image: str) -> SnapshotNotFound:
    """The answer to a sandbox asked for with a snapshot image the caller may not use: the
    same whether the image exists, is another key's, or another deployment's."""
    return SnapshotNotFound(
        f"image {image!r} is not a snapshot of yours",
        hint="start from a snapshot with POST /snapshots/{id}/restore; "
        "`orchard snapshot list` shows yours",
    )


def image_repository(image: str) -> str:
    """The repository part of an image reference: without its digest and tag."""
    name = image.split("@", 1)[0]
    slash = name.rfind("/")
    colon = name.rfind(":")
    return name[:colon] if colon > slash else name


@runtime_checkable
class Backend(Protocol):
    """Lifecycle of sandboxes on one substrate.

    Contracts:

    * ``create`` returns once the substrate accepted and started the sandbox (the agent may
      still be starting: the orchestrator polls the agent's health). It raises
      :class:`~orchard_env.errors.ImageNotFound` within seconds when the image cannot be
      found or pulled, with the engine's reason, and
      :class:`~orchard_env.errors.SandboxExists` if the id is taken.
    * ``delete`` of a sandbox that is already gone returns quietly. It removes everything the
      backend made for the sandbox (container/pod, per-sandbox directory, policies).
    * ``list`` returns every sandbox this orchestrator instance owns (by label), including
      ones it has no record of, so reconciliation can adopt them.
    * ``snapshot`` (backends with :attr:`Capability.SNAPSHOT`; the others raise
      :class:`~orchard_env.errors.NotSupported`) commits a running sandbox's filesystem,
      without the agent's mounts, to an image; running processes are not part of it. A
      restore is a ``create`` whose ``SandboxSpec.image`` is the snapshot's ``ref``.
    * ``capacity`` reports the nodes sandboxes can run on (capacity and allocatable) and,
      where the substrate knows them, the requests of the pods there.
    * ``is_snapshot_image`` says whether an image name is under the repository where this
      backend's snapshots live, this deployment's or another's (a name check only, so it
      says nothing about whether the image exists).
    * ``delete_snapshot`` removes a snapshot's image and returns True once it is gone
      (already gone included), or False while the engine still refuses because something
      uses it (the caller retries later). It never removes anything that uses the image.
    """

    name: str
    capabilities: frozenset[Capability]

    async def create(self, spec: SandboxSpec) -> BackendSandbox: ...

    async def inspect(self, sandbox_id: str) -> BackendSandbox | None: ...

    async def list(self) -> list[BackendSandbox]: ...

    async def delete(self, sandbox_id: str) -> None: ...

    async def snapshot(
        self, sandbox_id: str, snapshot_id: str, *, parent: str | None = None
    ) -> SnapshotImage: ...

    async def delete_snapshot(self, ref: str) -> bool: ...

    async def capacity(self) -> Capacity: ...
    def is_snapshot_image(self, image: str) -> bool: ...

    async def close(self) -> None: ...
