"""Test doubles for the service tier: a backend whose sandboxes are real agent processes.

:class:`AgentProcessBackend` implements the Backend Protocol by starting the real agent
(``orchard_env.agent.daemon``) as a host subprocess on a unix socket, one per sandbox, so
exec, files and PTY traffic is real; only the container around it is missing. It simulates
what an engine does that a host process cannot show by itself:

* image ``missing/image``: ImageNotFound at create, with an engine-like reason;
* image ``hang/image``: a container that runs but whose agent never starts;
* image ``crash/image``: a container that exits at once (exit code 1);
* :meth:`AgentProcessBackend.kill`: a container that dies later (e.g. OOMKilled, 137);
* it outlives apps: a new app on the same backend adopts or re-attaches;
* snapshots: a copy of the sandbox's workspace directory, image ``fake/snapshots:<id>``; a
  sandbox created from that image starts with a copy of it (a fresh agent: no processes
  carried over), and the copy cannot be removed while such a sandbox exists, as an engine
  refuses to remove an image a container uses;
* ``fail_creates``: sandbox ids whose create fails with the engine-like reason given;
* ``nodes``: the machine(s) it reports as its capacity (one 8-core node by default).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

from orchard_env.errors import ImageNotFound, OrchardError, SandboxExists, SandboxNotFound
from orchard_env.orchestrator.backends.base import (
    AgentEndpoint,
    BackendSandbox,
    Capability,
    Capacity,
    SandboxSpec,
    SandboxState,
    SnapshotImage,
    not_your_snapshot,
)
from orchard_env.protocol import NodeResources, ResourceAmounts

HOST_AGENT = (sys.executable, "-I", "-m", "orchard_env.agent.daemon")  # the real agent
MISSING_IMAGE = "missing/image"
HANG_IMAGE = "hang/image"
CRASH_IMAGE = "crash/image"
SNAPSHOT_REPOSITORY = "fake/snapshots"
FAKE_NODE = NodeResources(
    name="fake-node",
    capacity=ResourceAmounts(cpu=8.0, memory_bytes=32 * 1024**3),
    allocatable=ResourceAmounts(cpu=7.5, memory_bytes=30 * 1024**3),
)


@dataclass
class FakeSandbox:
    spec: SandboxSpec
    root: Path
    created_at: datetime
    process: subprocess.Popen[bytes] | None
    endpoint: AgentEndpoint
    exit_code: int | None = None
    reason: str | None = None

    @property
    def workdir(self) -> Path:
        return self.root / "workspace"

    def state(self) -> tuple[SandboxState, int | None, str | None]:
        if self.exit_code is None and self.process is not None:
            code = self.process.poll()
            if code is not None:
                self.exit_code = code if code >= 0 else 128 - code
        if self.exit_code is not None:
            return SandboxState.EXITED, self.exit_code, self.reason
        return SandboxState.RUNNING, None, None


@dataclass
class AgentProcessBackend:
    name: str = "fake"
    capabilities: frozenset[Capability] = frozenset({Capability.PTY, Capability.SNAPSHOT})
    root: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="orch-")))
    sandboxes: dict[str, FakeSandbox] = field(default_factory=dict)
    creates: int = 0
    deletes: list[str] = field(default_factory=list)
    snapshots: dict[str, Path] = field(default_factory=dict)  # image ref -> workspace copy
    fail_creates: dict[str, str] = field(default_factory=dict)  # sandbox id -> reason
    nodes: list[NodeResources] = field(default_factory=lambda: [FAKE_NODE])

    # --- Backend Protocol --------------------------------------------------------------

    async def create(self, spec: SandboxSpec) -> BackendSandbox:
        self.creates += 1
        if spec.image == MISSING_IMAGE:
            raise ImageNotFound(
                f"image {spec.image} is not present locally and could not be pulled: "
                "repository does not exist or may require authorization"
            )
        if spec.image.startswith(f"{SNAPSHOT_REPOSITORY}:") and spec.image not in self.snapshots:
            raise ImageNotFound(f"image {spec.image} is not present locally")
        if spec.image in self.snapshots and spec.image.split(":", 1)[1] != spec.snapshot_id:
            raise not_your_snapshot(spec.image)  # an engine checks the image's snapshot label
        if spec.sandbox_id in self.fail_creates:
            raise OrchardError(
                f"the engine could not create sandbox {spec.sandbox_id!r}: "
                f"{self.fail_creates[spec.sandbox_id]}"
            )
        if spec.sandbox_id in self.sandboxes:
            raise SandboxExists(f"a container for sandbox {spec.sandbox_id} already exists")
        root = self.root / spec.sandbox_id
        if spec.image in self.snapshots:
            root.mkdir(parents=True)
            await asyncio.to_thread(
                shutil.copytree, self.snapshots[spec.image], root / "workspace", symlinks=True
            )
        else:
            (root / "workspace").mkdir(parents=True)
        endpoint = AgentEndpoint(token=spec.agent_token, uds=str(root / "agent.sock"))
        process = await asyncio.to_thread(self._spawn, spec, endpoint, root)
        sandbox = FakeSandbox(
            spec=spec,
            root=root,
            created_at=datetime.now(UTC),
            process=process,
            endpoint=endpoint,
        )
        self.sandboxes[spec.sandbox_id] = sandbox
        return self._describe(sandbox)

    async def inspect(self, sandbox_id: str) -> BackendSandbox | None:
        sandbox = self.sandboxes.get(sandbox_id)
        return None if sandbox is None else self._describe(sandbox)

    async def list(self) -> list[BackendSandbox]:
        return [self._describe(sandbox) for sandbox in self.sandboxes.values()]

    async def delete(self, sandbox_id: str) -> None:
        sandbox = self.sandboxes.pop(sandbox_id, None)
        if sandbox is None:
            return
        self.deletes.append(sandbox_id)
        await asyncio.to_thread(self._stop, sandbox)

    async def snapshot(
        self, sandbox_id: str, snapshot_id: str, *, parent: str | None = None
    ) -> SnapshotImage:
        sandbox = self.sandboxes.get(sandbox_id)
        if sandbox is None or sandbox.state()[0] != SandboxState.RUNNING:
            raise SandboxNotFound(f"sandbox {sandbox_id!r} has no running container")
        ref = f"{SNAPSHOT_REPOSITORY}:{snapshot_id}"
        copy = self.root / "snapshots" / snapshot_id
        await asyncio.to_thread(shutil.copytree, sandbox.workdir, copy, symlinks=True)
        self.snapshots[ref] = copy
        size = sum(path.stat().st_size for path in copy.rglob("*") if path.is_file())
        return SnapshotImage(ref=ref, size_bytes=size)

    async def delete_snapshot(self, ref: str) -> bool:
        if any(sandbox.spec.image == ref for sandbox in self.sandboxes.values()):
            return False  # an engine refuses to remove an image a container uses
        copy = self.snapshots.pop(ref, None)
        if copy is not None:
            await asyncio.to_thread(shutil.rmtree, copy)
        return True

    async def capacity(self) -> Capacity:
        return Capacity(nodes=list(self.nodes))

    def is_snapshot_image(self, image: str) -> bool:
        return image.startswith(f"{SNAPSHOT_REPOSITORY}:")

    async def close(self) -> None:
        """Apps do not own this backend: its sandboxes outlive them (see :meth:`shutdown`)."""

    # --- simulations -------------------------------------------------------------------

    @staticmethod
    def _spawn(
        spec: SandboxSpec, endpoint: AgentEndpoint, root: Path
    ) -> subprocess.Popen[bytes] | None:
        if spec.image == HANG_IMAGE:
            return None
        if spec.image == CRASH_IMAGE:
            return subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(root),
            # The key and spec.env come with the orchestrator's enrollment, as on the engine.
            "ORCHARD_AGENT_WORKDIR": str(root / "workspace"),
        }
        return subprocess.Popen(
            [*HOST_AGENT, "--listen", f"unix:{endpoint.uds}"],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def _describe(self, sandbox: FakeSandbox) -> BackendSandbox:
        state, exit_code, reason = sandbox.state()
        return BackendSandbox(
            sandbox_id=sandbox.spec.sandbox_id,
            state=state,
            agent=sandbox.endpoint if state == SandboxState.RUNNING else None,
            created_at=sandbox.created_at,
            reason=reason,
            exit_code=exit_code,
            record_annotation=sandbox.spec.record_annotation,
        )

    @staticmethod
    def _stop(sandbox: FakeSandbox) -> None:
        process = sandbox.process
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGTERM)  # the agent kills its commands on TERM
            try:
                # Long enough on a loaded machine: an agent killed while it kills its commands
                # leaves them running on this host (a container's stop would take them too).
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        shutil.rmtree(sandbox.root, ignore_errors=True)

    async def kill(
        self, sandbox_id: str, *, exit_code: int = 137, reason: str = "OOMKilled"
    ) -> None:
        """The container dies on its own (its record is not told)."""
        sandbox = self.sandboxes[sandbox_id]
        await asyncio.to_thread(self._stop, sandbox)
        sandbox.exit_code, sandbox.reason = exit_code, reason

    async def forget(self, sandbox_id: str) -> None:
        """The container is removed behind the orchestrator's back."""
        await self.delete(sandbox_id)

    def backdate(self, sandbox_id: str, seconds: float) -> None:
        self.sandboxes[sandbox_id].created_at -= timedelta(seconds=seconds)

    def shutdown(self) -> None:
        for sandbox in list(self.sandboxes.values()):
            self._stop(sandbox)
        self.sandboxes.clear()
        with contextlib.suppress(OSError):
            shutil.rmtree(self.root)
