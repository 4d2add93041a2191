"""The local container-engine backend: each sandbox is a container on Docker or Podman.

Talks to the engine through the ``docker`` SDK (sync, on the backend's own threads: many
creations at once, and inspections never queued behind them), so it works with Docker and
with Podman's Docker-compatible API socket. A create is two round trips (create, start) once
the image has been seen here (its config is remembered: the tools payload's PATH and, on
btrfs, the disk limit come from it). Per sandbox it makes:

* a container ``orchard-<instance>-<sandbox_id>`` labelled with the instance, the state
  dir's id (:func:`~orchard_env.config.state_id`: only containers carrying this service's
  own are listed, so adopted or removed), sandbox id, owner, the orchestrator's record and
  the user's labels (``orchard.label.<key>``), whose entrypoint is the agent from the
  relocatable bundle (mounted read-only), so any image works, even one without a shell or
  Python;
* a host directory ``<sandboxes_dir>/<sandbox_id>/`` mounted at ``/run/orchard``, where the
  agent listens on a unix socket: reachable from the host even with no network at all. It is
  a small tmpfs of its own (:mod:`.run_dir`), so what the sandbox writes there is bounded.

The sandbox's agent key is a label of the container (the engine's metadata, which nothing in
the container can read), never its environment: the orchestrator hands it to the agent,
with the sandbox's environment, when it enrolls the agent (see :mod:`orchard_env.agent`).
So the container's environment is the image's plus the agent's launcher variables only:
nothing the sandbox sets (``LD_PRELOAD``...) applies to the agent itself.

A snapshot is the container committed (paused while it is taken) to an image
``localhost/orchard/snapshots/<instance>:<snapshot id>`` labelled with its snapshot id and
instance: its writable layer over the image it runs, so the image's layers are shared, not
copied; a later snapshot of the same sandbox is only what changed since, over the previous
one (:mod:`.docker_layers`). Bind mounts (the agent bundle, ``/run/orchard``)
are not part of a commit; the agent's secret and the source's record are blanked in the
image's config. Containers restored from it share its layers too. A create whose image is
a snapshot image (by name, or by any alias: its labels are checked) runs only if it is the
snapshot the orchestrator authorised (``SandboxSpec.snapshot_id``) and of this instance, so
neither another key nor another deployment on the same engine can start from it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import re
import shutil
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

import docker
import docker.auth
import docker.constants
import docker.errors
import docker.types
import docker.utils
import requests
import urllib3.exceptions

from orchard_env import errors
from orchard_env.agent.bundle import (
    BUNDLE_MOUNT,
    RUN_DIR_MOUNT,
    SOCKET_NAME,
    launch_argv,
    launch_env,
)
from orchard_env.config import ServiceSettings, state_id
from orchard_env.orchestrator.backends import docker_layers
from orchard_env.orchestrator.backends import run_dir as run_dir_mount
from orchard_env.orchestrator.backends.base import (
    SANDBOX_CAPABILITIES,
    AgentEndpoint,
    BackendSandbox,
    Capability,
    Capacity,
    SandboxSpec,
    SandboxState,
    SnapshotImage,
    image_repository,
    not_your_snapshot,
)
from orchard_env.protocol import NodeResources, ResourceAmounts, check_sandbox_id
from orchard_env.tools import TOOLS_BIN, TOOLS_ENV
from orchard_env.tools.views import payload_harnesses, tool_mounts

LABEL_CREATED_BY = "orchard.created-by"
LABEL_INSTANCE = "orchard.instance"
LABEL_STATE_ID = "orchard.state-id"
log = logging.getLogger(__name__)
LABEL_SANDBOX_ID = "orchard.sandbox-id"
LABEL_OWNER = "orchard.owner"
LABEL_RECORD = "orchard.record"
LABEL_AGENT_KEY = "orchard.agent-key"
USER_LABEL_PREFIX = "orchard.label."
LABEL_SNAPSHOT_ID = "orchard.snapshot-id"
LABEL_SNAPSHOT_PARENT = "orchard.snapshot-parent"
LABEL_SOURCE_SANDBOX = "orchard.source-sandbox"
SNAPSHOT_REPOSITORY = "localhost/orchard/snapshots"
"""Where every deployment's snapshot images live, one repository per instance below it."""
WORKDIR_ENV = "ORCHARD_AGENT_WORKDIR"
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

# Spoken by Docker 20.10+ and Podman 4+; pinned because negotiating it (GET /version) costs
# Podman a third of a second per client.
API_VERSION = "1.41"
# Where engines usually listen, in the order they are tried when nothing is configured.
WELL_KNOWN_SOCKETS = ("/run/podman/podman.sock", "/var/run/docker.sock")

# Engine calls that create, start, remove and commit at once. Podman serialises most of
# creation (about 9 creates/s here whether 6 or 32 are in flight): more only makes each slower.
LIFECYCLE_THREADS = 8
QUERY_THREADS = 8  # inspect and list, apart from those
ID_LOCK_STRIPES = 64  # creates and deletes of ids in one stripe wait for each other

MAX_SOCKET_PATH = 107  # sockaddr_un.sun_path is 108 bytes with the terminating NUL
_INSTANCE_RE = re.compile(r"^[a-zA-Z0-9][a-zA-Z0-9_.-]*$")
_STATES = {
    "created": SandboxState.CREATING,
    "configured": SandboxState.CREATING,
    "initialized": SandboxState.CREATING,
    "running": SandboxState.RUNNING,
    "paused": SandboxState.RUNNING,
    "restarting": SandboxState.RUNNING,
    "exited": SandboxState.EXITED,
    "stopped": SandboxState.EXITED,
    "dead": SandboxState.EXITED,
    "removing": SandboxState.EXITED,
}

_P = ParamSpec("_P")
_T = TypeVar("_T")


# --- engine discovery ------------------------------------------------------------------------


def _engine_candidates(docker_host: str | None) -> list[tuple[str, str]]:
    """(url, where it came from). A configured engine is the only candidate: falling back to
    another one would hide the misconfiguration."""
    if docker_host:
        return [(docker_host, "the docker_host setting")]
    if os.environ.get("DOCKER_HOST"):
        return [(os.environ["DOCKER_HOST"], "DOCKER_HOST")]
    paths = list(WELL_KNOWN_SOCKETS)
    if os.environ.get("XDG_RUNTIME_DIR"):
        paths.append(str(Path(os.environ["XDG_RUNTIME_DIR"]) / "podman" / "podman.sock"))
    return [(f"unix://{path}", "default") for path in paths]


def _why_not_answering(url: str, timeout: float) -> str | None:
    """None when an engine answers a ping at ``url``, else the reason it does not."""
    if url.startswith("unix://"):
        path = url.removeprefix("unix://")
        if not Path(path).exists():
            return "no such socket"
        # Connect here first: the SDK leaks its socket when a unix connect fails.
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.settimeout(timeout)
            try:
                probe.connect(path)
            except OSError as exc:
                return exc.strerror or str(exc)
    try:
        # A pinned (oldest) API version: negotiating it would ask for /version, which takes
        # Podman a third of a second.
        version = docker.constants.MINIMUM_DOCKER_API_VERSION
        with docker.APIClient(base_url=url, version=version, timeout=timeout) as api:
            api.ping()
    except (docker.errors.DockerException, requests.exceptions.RequestException) as exc:
        return str(exc) or type(exc).__name__
    return None


def find_engine(docker_host: str | None = None, *, timeout: float = 2.0) -> str:
    """The base URL of a container engine that answers.

    Order: ``docker_host`` (the setting), else ``DOCKER_HOST``, else the Podman system socket,
    the Docker socket and the user's Podman socket (``$XDG_RUNTIME_DIR/podman/podman.sock``).
    A configured URL is used alone. Raises :class:`~orchard_env.errors.EngineNotFound`
    naming every place tried and why each failed.
    """
    failures: list[str] = []
    for url, source in _engine_candidates(docker_host):
        reason = _why_not_answering(url, timeout)
        if reason is None:
            return url
        origin = "" if source == "default" else f", from {source}"
        failures.append(f"{url} ({reason}{origin})")
    raise errors.EngineNotFound("no container engine answers at " + "; ".join(failures))


# --- backend -------------------------------------------------------------------------------


def _remove_run_dir(run_dir: Path) -> None:
    """Unmount a sandbox's directory and remove it; quiet when it is gone."""
    run_dir_mount.unmount(run_dir)
    with contextlib.suppress(FileNotFoundError):
        shutil.rmtree(run_dir)


def _name_in_use(exc: docker.errors.APIError) -> bool:
    # Docker answers 409; Podman 4 answers 500 "... is already in use ...".
    return exc.status_code == 409 or "already in use" in str(exc.explanation or "")


def _explanation(exc: docker.errors.APIError) -> str:
    return str(exc.explanation or exc)


def _removed(exc: docker.errors.APIError) -> bool:
    # Docker answers 404; Podman 4 answers 404 too, or 500 "... no such container" when the
    # container goes while the lookup runs (seen in a reconciliation during a mass delete).
    return exc.status_code == 404 or "no such container" in _explanation(exc)


def _image_path(image: dict[str, Any]) -> str:
    """The PATH an image (its attributes) sets; the usual default when it sets none."""
    for item in (image.get("Config") or {}).get("Env") or []:
        if item.startswith("PATH="):
            return str(item[5:])
    return DEFAULT_PATH


def _inspect_form(listed: dict[str, Any], state: str) -> dict[str, Any]:
    """The fields :meth:`DockerEngineBackend._describe` reads, from a container as the engine
    lists it (``Created`` in seconds since the epoch, ``State`` a word)."""
    created = datetime.fromtimestamp(int(listed.get("Created") or 0), tz=UTC)
    return {
        "Id": listed.get("Id"),
        "Config": {"Labels": listed.get("Labels") or {}},
        "State": {"Status": state, "Running": state == "running", "Paused": state == "paused"},
        "Created": created.isoformat(),
    }


def _exit_reason(state: dict[str, Any], code: int | None) -> str:
    if state.get("OOMKilled"):
        return "OOMKilled"
    if state.get("Error"):
        return str(state["Error"])
    if code == 137:
        return "exited with code 137: killed by SIGKILL (e.g. the out-of-memory killer)"
    return f"exited with code {code}"


class DockerEngineBackend:
    """Sandboxes as containers on the local Docker or Podman engine."""

    name = "docker"
    capabilities = frozenset({Capability.NETWORK_ISOLATION, Capability.PTY, Capability.SNAPSHOT})

    def __init__(
        self,
        settings: ServiceSettings,
        *,
        bundle_dir: Path,
        tools_dir: Path | None = None,
        client: docker.DockerClient | None = None,
        pull_stall_timeout: float = 10.0,
    ) -> None:
        """``tools_dir``: the tools payload sandboxes mount (None: sandboxes get none).
        ``pull_stall_timeout``: a pull that reports no progress for this long fails
        (a whole pull is capped by the sandbox's ready timeout)."""
        if not _INSTANCE_RE.match(settings.instance):
            raise errors.ConfigError(
                f"instance {settings.instance!r} cannot be part of a container name",
                hint="instance: letters, digits, '_', '.', '-', starting with a letter or digit",
            )
        self._settings = settings
        self._state_id = state_id(settings.state_dir)
        self._snapshotting: set[str] = set()  # sandboxes this process has paused to snapshot
        self._bundle_dir = bundle_dir.resolve()
        self._tools_dir = tools_dir.resolve() if tools_dir is not None else None
        self._tools = payload_harnesses(self._tools_dir) if self._tools_dir else ()
        self._pull_stall_timeout = pull_stall_timeout
        if client is None:
            self._engine = find_engine(settings.docker_host)
            client = docker.DockerClient(
                base_url=self._engine,
                version=API_VERSION,
                timeout=60,
                max_pool_size=LIFECYCLE_THREADS + QUERY_THREADS,
            )
        else:
            self._engine = str(client.api.base_url)
        self._client = client
        # Engine calls block: they run on threads of their own, not asyncio's small default
        # pool (min(32, cores + 4) threads, shared with everything else). Inspect and list
        # have their own few, so readiness checks and reconciliation never wait behind a
        # burst of creations.
        self._lifecycle = ThreadPoolExecutor(LIFECYCLE_THREADS, thread_name_prefix="engine")
        self._queries = ThreadPoolExecutor(QUERY_THREADS, thread_name_prefix="engine-query")
        # Plain images (not snapshots) present and checked when last used, with what the
        # engine said of them: a create of one skips the lookup. Snapshot images are checked
        # against their snapshot every time.
        self._images_seen: dict[str, dict[str, Any]] = {}
        self._info: dict[str, Any] | None = None  # the engine's, asked once
        # A create and a delete of one id never interleave: a delete of a sandbox that
        # expired must not remove the directory a new create of the same id has just made.
        self._id_locks = tuple(threading.Lock() for _ in range(ID_LOCK_STRIPES))
        self._unbounded_said = False  # the warning that agent directories are not bounded

    # -- helpers --------------------------------------------------------------------------

    async def _call(
        self,
        pool: ThreadPoolExecutor,
        fn: Callable[_P, _T],
        *args: _P.args,
        **kwargs: _P.kwargs,
    ) -> _T:
        """Run a blocking engine call on ``pool``; an engine that does not answer is
        :class:`~orchard_env.errors.BackendUnavailable` (transient)."""
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(pool, functools.partial(fn, *args, **kwargs))
        except (requests.exceptions.ConnectionError, requests.exceptions.Timeout) as exc:
            raise errors.BackendUnavailable(
                f"the container engine at {self._engine} did not answer: {exc}",
                hint="is it running? `podman system service --time=0 "
                "unix:///run/podman/podman.sock &` starts Podman's socket",
            ) from exc

    @property
    def snapshot_repository(self) -> str:
        """This instance's snapshot images: ``<SNAPSHOT_REPOSITORY>/<instance>``."""
        return f"{SNAPSHOT_REPOSITORY}/{self._settings.instance.lower()}"

    def is_snapshot_image(self, image: str) -> bool:
        repository = image_repository(image).lower()
        first = repository.split("/", 1)[0]
        if "/" not in repository or not ("." in first or ":" in first or first == "localhost"):
            repository = f"localhost/{repository}"  # Podman finds short names locally
        return repository == SNAPSHOT_REPOSITORY or repository.startswith(f"{SNAPSHOT_REPOSITORY}/")

    def _container_name(self, sandbox_id: str) -> str:
        return f"orchard-{self._settings.instance}-{sandbox_id}"

    def _run_dir(self, sandbox_id: str) -> Path:
        try:
            check_sandbox_id(sandbox_id)
        except ValueError as exc:
            raise errors.InvalidRequest(str(exc)) from exc
        return self._settings.sandboxes_dir / sandbox_id

    def _get(self, name: str) -> Any | None:
        try:
            return self._client.containers.get(name)
        except docker.errors.NotFound:
            return None

    def _describe(self, attrs: dict[str, Any]) -> BackendSandbox | None:
        config = attrs.get("Config") or {}
        labels: dict[str, str] = config.get("Labels") or {}
        sandbox_id = labels.get(LABEL_SANDBOX_ID)
        if sandbox_id is None or labels.get(LABEL_INSTANCE) != self._settings.instance:
            return None
        if labels.get(LABEL_STATE_ID, self._state_id) != self._state_id:
            return None  # the same instance name, another service's state dir: not ours
        engine_state: dict[str, Any] = attrs.get("State") or {}
        status = str(engine_state.get("Status", "")).lower()
        state = _STATES.get(status, SandboxState.FAILED)
        exit_code: int | None = None
        reason: str | None = None
        if state is SandboxState.EXITED:
            exit_code = int(engine_state.get("ExitCode", 0))
            reason = _exit_reason(engine_state, exit_code)
        elif state is SandboxState.FAILED:
            reason = f"the engine reports the container as {status or 'unknown'}"
        agent = None
        key = labels.get(LABEL_AGENT_KEY)
        if state in (SandboxState.CREATING, SandboxState.RUNNING) and key:
            agent = AgentEndpoint(token=key, uds=str(self._run_dir(sandbox_id) / SOCKET_NAME))
        return BackendSandbox(
            sandbox_id=sandbox_id,
            state=state,
            agent=agent,
            created_at=datetime.fromisoformat(str(attrs["Created"])),
            reason=reason,
            exit_code=exit_code,
            record_annotation=labels.get(LABEL_RECORD),
        )

    # -- images ---------------------------------------------------------------------------

    def _ensure_image(
        self, image: str, snapshot_id: str | None, timeout: int | None = None
    ) -> dict[str, Any]:
        """The image's attributes (the engine's inspect), pulled first if it is missing;
        refused if it is a snapshot image that is not ``snapshot_id`` of this instance."""
        try:
            found = self._client.images.get(image)
        except docker.errors.ImageNotFound:
            if snapshot_id is not None or self.is_snapshot_image(image):  # made here, not pulled
                raise errors.ImageNotFound(
                    f"snapshot image {image!r} is no longer on this machine's engine",
                    hint="it was removed outside Orchard; take a new snapshot",
                ) from None
            reason = self._pull(image, timeout or self._settings.ready_timeout_seconds)
            if reason is not None:
                raise errors.ImageNotFound(
                    f"image {image!r} is not on this machine's engine and could not be "
                    f"pulled: {reason}",
                    hint="check the name and tag; log in to a private registry with "
                    "`podman login` / `docker login`; `orchard images build-local` builds "
                    "the default images here",
                ) from None
            found = self._client.images.get(image)
        labels: dict[str, str] = found.labels or {}
        if LABEL_SNAPSHOT_ID in labels and (
            labels[LABEL_SNAPSHOT_ID] != snapshot_id
            or labels.get(LABEL_INSTANCE) != self._settings.instance
        ):
            raise not_your_snapshot(image)
        return dict(found.attrs)

    def _pull(self, image: str, timeout: int) -> str | None:
        """Pull ``image``; None on success, else the engine's reason. Fails fast: no progress
        for ``pull_stall_timeout`` seconds, or a pull longer than ``timeout`` seconds."""
        # The SDK's own pull waits forever (timeout=None); this is the same request, bounded.
        api = self._client.api
        repository, tag = docker.utils.parse_repository_tag(image)
        registry, _ = docker.auth.resolve_repository_name(repository)
        headers = {}
        auth_header = docker.auth.get_config_header(api, registry)
        if auth_header:
            headers["X-Registry-Auth"] = auth_header
        url = f"{api.base_url}/v{api.api_version}/images/create"
        params = {"fromImage": repository, "tag": tag or "latest"}
        deadline = time.monotonic() + timeout
        try:
            with api.post(
                url, params=params, headers=headers, stream=True, timeout=self._pull_stall_timeout
            ) as response:
                if response.status_code >= 400:
                    return f"HTTP {response.status_code}: {response.text.strip()}"
                for line in response.iter_lines():
                    with contextlib.suppress(ValueError):
                        message = json.loads(line)
                        if isinstance(message, dict) and message.get("error"):
                            return str(message["error"])
                    if time.monotonic() > deadline:
                        return (
                            f"the pull took longer than the sandbox's ready timeout ({timeout} s)"
                        )
        except requests.exceptions.RequestException as exc:
            cause = exc.args[0] if exc.args else None
            if isinstance(exc, requests.exceptions.Timeout) or isinstance(
                cause, urllib3.exceptions.ReadTimeoutError
            ):
                return (
                    f"the pull made no progress for {self._pull_stall_timeout:g}s "
                    "(is the registry reachable from the engine?)"
                )
            return f"the engine dropped the pull: {exc}"
        try:
            self._client.images.get(image)
        except docker.errors.ImageNotFound:
            return "the pull finished but the engine does not list the image"
        return None

    # -- disk -------------------------------------------------------------------------------

    def _engine_info(self) -> dict[str, Any]:
        """What the engine says of itself (its machine's memory, its storage), asked once:
        it costs Podman about a third of a second of CPU."""
        if self._info is None:
            self._info = dict(self._client.info())
        return self._info

    def _storage_driver(self) -> tuple[str, str]:
        """The engine's storage driver and what it runs on."""
        info = self._engine_info()
        driver = str(info.get("Driver") or "unknown")
        status = {str(item[0]): str(item[1]) for item in info.get("DriverStatus") or []}
        return driver, status.get("Backing Filesystem", "an unknown file system")

    def _disk_limit_refusal(self) -> str | None:
        """None if the engine's storage can cap a container's disk (``--storage-opt size``:
        btrfs, zfs, overlay on xfs mounted with pquota), else what it runs on."""
        driver, backing = self._storage_driver()
        if driver in ("btrfs", "zfs") or (driver.startswith("overlay") and backing == "xfs"):
            return None
        return f"storage driver {driver} on {backing}"

    def _check_disk(self, spec: SandboxSpec) -> None:
        """Refuse a ``disk`` this engine cannot enforce, before anything is made."""
        refusal = self._disk_limit_refusal() if spec.disk_bytes is not None else None
        if refusal is not None:
            raise errors.InvalidRequest(
                f"disk cannot be limited on this engine: its {refusal} cannot cap a "
                "container's disk, and Orchard refuses a limit it cannot enforce",
                hint="leave disk out (sandboxes here are not disk-limited), or give the engine "
                "storage that can (btrfs, which `ORCHARD_QUOTA_STORAGE=yes "
                "scripts/setup-host.sh` sets up, or overlay on xfs mounted with pquota): see "
                "docs/deployment.md",
            )

    def _storage_options(self, spec: SandboxSpec, image: dict[str, Any]) -> dict[str, str] | None:
        """The ``size`` storage option: ``disk``, else ``ephemeral_storage`` where the storage
        can enforce a limit (none where it cannot). On btrfs the limit is a qgroup's, which
        counts the image's files too: the ``image``'s size and an eighth more for its
        metadata are added, so that the sandbox can write about ``disk`` of its own."""
        if self._disk_limit_refusal() is not None:
            return None
        size = self._settings.ephemeral_storage if spec.disk_bytes is None else spec.disk_bytes
        if self._storage_driver()[0] == "btrfs":
            image_size = int(image.get("Size") or 0)
            size += image_size + image_size // 8
        return {"size": str(size)}

    # -- lifecycle ------------------------------------------------------------------------

    def _create(self, spec: SandboxSpec) -> BackendSandbox:
        """Two engine round trips when the image is known here and the id is new: create and
        start."""
        name = self._container_name(spec.sandbox_id)
        run_dir = self._run_dir(spec.sandbox_id)
        if not self._bundle_dir.is_dir():
            raise errors.ConfigError(
                f"the agent bundle directory {self._bundle_dir} does not exist",
                hint="build it with orchard_env.agent.bundle.ensure_bundle(), or fix "
                "agent_bundle_dir",
            )
        socket_path = os.fsencode(run_dir / SOCKET_NAME)
        if len(socket_path) > MAX_SOCKET_PATH:
            raise errors.InvalidRequest(
                f"the agent socket path for sandbox {spec.sandbox_id!r} would be "
                f"{len(socket_path)} bytes, over the {MAX_SOCKET_PATH} a unix socket allows",
                hint=f"use a shorter sandbox id, or a shorter state_dir than "
                f"{self._settings.state_dir}",
            )
        host_memory = int(self._engine_info().get("MemTotal") or 0)
        if host_memory and spec.memory_bytes > host_memory:
            raise errors.InvalidRequest(
                f"memory: {spec.memory_bytes / 2**30:.1f}Gi is more than this machine has "
                f"({host_memory / 2**30:.1f}Gi)",
                hint="ask for less memory",
            )
        self._check_disk(spec)
        plain = spec.snapshot_id is None and not self.is_snapshot_image(spec.image)
        image = self._images_seen.get(spec.image) if plain else None
        if image is None:
            image = self._ensure_image(spec.image, spec.snapshot_id, spec.ready_timeout_seconds)
        # A directory already there may be a live sandbox's (its socket must stay): only then
        # is it worth asking the engine first; otherwise the create itself refuses a taken name.
        if run_dir.exists() and self._get(name) is not None:
            raise self._exists(spec.sandbox_id)
        self._settings.sandboxes_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        made_dir = not run_dir.exists()
        run_dir.mkdir(exist_ok=True)
        self._bound(run_dir, made_dir)
        # The agent runs as the image's user, which may not be root: it must be able to make
        # its socket here. The parent (0700) keeps other host users out.
        run_dir.chmod(0o777)
        (run_dir / SOCKET_NAME).unlink(missing_ok=True)
        try:
            try:
                container_id = self._create_container(spec, name, run_dir, image)
            except docker.errors.NotFound:  # its image went away since it was last seen here
                self._images_seen.pop(spec.image, None)
                image = self._ensure_image(spec.image, spec.snapshot_id, spec.ready_timeout_seconds)
                container_id = self._create_container(spec, name, run_dir, image)
        except docker.errors.APIError as exc:
            if _name_in_use(exc):  # a concurrent create of the same id won
                raise self._exists(spec.sandbox_id) from exc
            if made_dir:
                with contextlib.suppress(OSError):
                    _remove_run_dir(run_dir)
            raise errors.OrchardError(
                f"the engine could not create sandbox {spec.sandbox_id!r}: {_explanation(exc)}"
            ) from exc
        except errors.ImageNotFound:
            if made_dir:
                with contextlib.suppress(OSError):
                    _remove_run_dir(run_dir)
            raise
        if plain:
            self._images_seen[spec.image] = image
        try:
            self._client.api.start(container_id)
        except docker.errors.APIError as exc:
            self._delete(spec.sandbox_id)
            if "is not a directory" in _explanation(exc):
                raise errors.InvalidRequest(
                    f"workdir {spec.workdir!r} is not a directory in image {spec.image!r}, so "
                    f"no sandbox can start there: {_explanation(exc)}",
                    hint="pick another workdir; a snapshot whose workdir was replaced by a file "
                    "cannot be restored: make it a directory again and snapshot anew",
                ) from exc
            raise errors.OrchardError(
                f"the engine could not start sandbox {spec.sandbox_id!r}: {_explanation(exc)}"
            ) from exc
        # Started: no inspect to say so (a round trip per create). One that stops at once is
        # seen by the readiness checks, which inspect it when its agent does not answer.
        return BackendSandbox(
            sandbox_id=spec.sandbox_id,
            state=SandboxState.RUNNING,
            agent=AgentEndpoint(token=spec.agent_token, uds=str(run_dir / SOCKET_NAME)),
            created_at=datetime.now(UTC),
            record_annotation=spec.record_annotation,
        )

    def _bound(self, run_dir: Path, made_dir: bool) -> None:
        """Mount the sandbox's bounded tmpfs at ``run_dir`` (:mod:`.run_dir`); where this
        process may not mount, say once that the directory is not bounded."""
        try:
            bounded = run_dir_mount.mount(run_dir)
        except OSError as exc:
            if made_dir:
                shutil.rmtree(run_dir, ignore_errors=True)
            raise errors.OrchardError(
                f"could not bound the agent directory of sandbox {run_dir.name!r}: {exc}"
            ) from exc
        if not bounded and not self._unbounded_said:
            self._unbounded_said = True
            log.warning(
                "sandboxes' agent directories (/run/orchard inside) are not size-bounded: "
                "mounting their tmpfs needs root; code in a sandbox can fill the host's disk "
                "through them",
                extra={"sandboxes_dir": str(self._settings.sandboxes_dir)},
            )

    @staticmethod
    def _exists(sandbox_id: str) -> errors.SandboxExists:
        return errors.SandboxExists(
            f"sandbox {sandbox_id!r} already exists",
            hint="delete it first, or create the new one with another sandbox_id",
        )

    def _create_container(
        self, spec: SandboxSpec, name: str, run_dir: Path, image: dict[str, Any]
    ) -> str:
        """The container (not started) of ``image`` (its attributes), in one round trip; its
        id."""
        labels = {
            LABEL_CREATED_BY: "orchard",
            LABEL_INSTANCE: self._settings.instance,
            LABEL_STATE_ID: self._state_id,
            LABEL_SANDBOX_ID: spec.sandbox_id,
            LABEL_AGENT_KEY: spec.agent_token,
            **{USER_LABEL_PREFIX + key: value for key, value in spec.labels.items()},
        }
        if spec.owner is not None:
            labels[LABEL_OWNER] = spec.owner
        if spec.record_annotation is not None:
            labels[LABEL_RECORD] = spec.record_annotation
        # spec.env reaches the commands through the agent's enrollment, not the agent.
        env = {**launch_env(BUNDLE_MOUNT), WORKDIR_ENV: spec.workdir}
        mounts = [
            docker.types.Mount(RUN_DIR_MOUNT, str(run_dir), type="bind"),
            docker.types.Mount(BUNDLE_MOUNT, str(self._bundle_dir), type="bind", read_only=True),
        ]
        tools = self._tools_for(spec.tools)
        if tools and self._tools_dir is not None:
            env[TOOLS_ENV] = TOOLS_BIN
            # In the container's own environment too, so a process the agent did not start
            # (the engine's exec) finds them, as upstream's /usr/local/bin links did.
            env["PATH"] = f"{_image_path(image)}:{TOOLS_BIN}"
            mounts += [
                docker.types.Mount(target, str(source), type="bind", read_only=True)
                for target, source in tool_mounts(self._tools_dir, tools)
            ]
        api = self._client.api
        host_config = api.create_host_config(
            nano_cpus=round(spec.cpu * 1e9),
            mem_limit=spec.memory_bytes,
            memswap_limit=spec.memory_bytes,  # equal: no swap
            pids_limit=spec.pids_limit,
            storage_opt=self._storage_options(spec, image),
            network_mode="none" if spec.block_network else None,
            mounts=mounts,
            # No privilege gained through setuid binaries or file capabilities, and only the
            # capabilities images need.
            security_opt=["no-new-privileges"],
            cap_drop=["ALL"],
            cap_add=list(SANDBOX_CAPABILITIES),
            # The engine's tiny init (catatonit, tini) is PID 1 and reaps orphans, so the
            # agent does not have to stay behind as a second Python process.
            init=True,
        )
        created = api.create_container(
            spec.image,
            name=name,
            hostname=spec.sandbox_id,
            labels=labels,
            environment=env,
            entrypoint=launch_argv(BUNDLE_MOUNT, f"unix:{RUN_DIR_MOUNT}/{SOCKET_NAME}"),
            command=[],
            working_dir=spec.workdir,
            host_config=host_config,
            detach=True,
        )
        return str(created["Id"])

    def _tools_for(self, asked: tuple[str, ...] | None) -> tuple[str, ...]:
        """The harnesses a sandbox gets: all the payload has unless it asked for fewer."""
        if asked is None:
            return self._tools
        missing = [name for name in asked if name not in self._tools]
        if missing:
            raise errors.InvalidRequest(
                f"tools: this service's tools payload has no {', '.join(missing)} "
                f"(it has: {', '.join(self._tools) or 'no payload at all'})",
                hint="ask for those it has, or build a payload with them (the tools setting, "
                "`orchard images build-local --tools`)",
            )
        return asked

    def _list(self) -> list[BackendSandbox]:
        """One round trip for them all (the engine's list carries labels and state), and an
        inspect of each one that is neither running nor paused: only an inspect says why a
        container stopped. (The SDK's own list inspects every container: hundreds of round
        trips at every reconciliation.)"""
        filters = {
            "label": [f"{LABEL_CREATED_BY}=orchard", f"{LABEL_INSTANCE}={self._settings.instance}"]
        }
        containers = self._client.containers.list(all=True, filters=filters, sparse=True)
        found = []
        for container in containers:
            state = str(container.attrs.get("State") or "").lower()
            if state in ("running", "paused"):
                container.attrs = _inspect_form(container.attrs, state)
            else:
                try:
                    container.reload()
                except docker.errors.APIError as exc:
                    if _removed(exc):  # since it was listed
                        continue
                    raise
            if (described := self._found(container)) is not None:
                found.append(described)
        return found

    def _inspect(self, sandbox_id: str) -> BackendSandbox | None:
        container = self._get(self._container_name(sandbox_id))
        return None if container is None else self._found(container)

    def _found(self, container: Any) -> BackendSandbox | None:
        """A container described; one left paused by a snapshot this process is not taking
        (a service that stopped mid-snapshot) is resumed first."""
        found = self._describe(container.attrs)
        paused = (container.attrs.get("State") or {}).get("Status") == "paused"
        if found is not None and paused and found.sandbox_id not in self._snapshotting:
            log.warning(
                "resuming a sandbox left paused by an interrupted snapshot",
                extra={"sandbox_id": found.sandbox_id},
            )
            with contextlib.suppress(docker.errors.APIError):
                container.unpause()
        return found

    def _delete(self, sandbox_id: str) -> None:
        run_dir = self._run_dir(sandbox_id)
        name = self._container_name(sandbox_id)
        try:
            found = self._get(name)
            # A container of another service's state dir (the same instance name) is never
            # removed. force: the engine kills (SIGKILL) the container before removing it.
            if found is not None and self._describe(found.attrs) is not None:
                self._client.api.remove_container(name, force=True, v=True)
        except docker.errors.NotFound:
            pass
        except docker.errors.APIError as exc:
            raise errors.OrchardError(
                f"the engine could not remove sandbox {sandbox_id!r}: {_explanation(exc)}"
            ) from exc
        self._layers_file(sandbox_id).unlink(missing_ok=True)
        with contextlib.suppress(docker.errors.NotFound):  # an interrupted snapshot's helper
            self._client.api.remove_container(f"{name}-snapshot", force=True)
        try:
            _remove_run_dir(run_dir)
        except OSError as exc:
            raise errors.OrchardError(
                f"could not remove the sandbox directory {run_dir}: {exc}",
                hint=f"remove it by hand: umount {run_dir}; rm -rf {run_dir}",
            ) from exc

    # -- snapshots --------------------------------------------------------------------------

    def _snapshot(self, sandbox_id: str, snapshot_id: str, parent: str | None) -> SnapshotImage:
        container = self._get(self._container_name(sandbox_id))
        if container is None:
            raise errors.SandboxNotFound(f"sandbox {sandbox_id!r} has no container to snapshot")
        base = self._client.images.get(container.attrs["Image"])
        base_config: dict[str, Any] = base.attrs.get("Config") or {}
        changes = [
            f"LABEL {LABEL_SNAPSHOT_ID}={snapshot_id}",
            f"LABEL {LABEL_SOURCE_SANDBOX}={sandbox_id}",
            f"LABEL {LABEL_INSTANCE}={self._settings.instance}",
            f"LABEL {LABEL_RECORD}=",  # the source's record (its env) stays with the source
            f"LABEL {LABEL_AGENT_KEY}=",  # so does its agent's key
            # The image's own entrypoint and command, not the agent launcher's.
            f"ENTRYPOINT {json.dumps(base_config.get('Entrypoint') or [])}",
            f"CMD {json.dumps(base_config.get('Cmd') or [])}",
            # Blank when none: an incremental snapshot's image inherits the previous one's.
            f"LABEL {LABEL_SNAPSHOT_PARENT}={parent or ''}",
        ]
        ref = f"{self.snapshot_repository}:{snapshot_id}"
        upper = docker_layers.upper_dir(container.attrs)
        record = self._layers_file(sandbox_id)
        state = container.attrs.get("State") or {}
        pause = bool(state.get("Running")) and not state.get("Paused")
        self._snapshotting.add(sandbox_id)
        try:
            if pause:  # the layer, its record and the commit: one instant
                container.pause()
        except docker.errors.APIError as exc:
            self._snapshotting.discard(sandbox_id)
            raise errors.OrchardError(
                f"the engine could not pause sandbox {sandbox_id!r} to snapshot it: "
                f"{_explanation(exc)}"
            ) from exc
        try:
            manifest = None
            with contextlib.suppress(OSError, docker_layers.Unsupported):
                manifest = docker_layers.scan(upper) if upper is not None else None
            previous = docker_layers.load(record, container.id) if manifest is not None else None
            image, below = None, base
            if previous is not None and manifest is not None and upper is not None:
                done = docker_layers.commit_difference(
                    self._client, container, upper, previous, manifest, ref, changes
                )
                if done is not None:  # the helper is gone, and its links with it
                    image, below, linked = done
                    with contextlib.suppress(OSError):
                        docker_layers.relinked(upper, manifest, linked)
            if image is None:
                image, below = self._commit(container, sandbox_id, ref, changes), base
        finally:
            if pause:
                with contextlib.suppress(docker.errors.APIError):
                    container.unpause()
            self._snapshotting.discard(sandbox_id)
        if manifest is not None:
            try:
                docker_layers.save(record, container.id, ref, manifest)
            except OSError as exc:  # the last record stays: still a correct base, if older
                log.warning(
                    "could not record a snapshot's layer for the next one",
                    extra={"sandbox_id": sandbox_id, "error": str(exc)},
                )
        added = int(image.attrs.get("Size") or 0) - int(below.attrs.get("Size") or 0)
        return SnapshotImage(ref=ref, size_bytes=max(added, 0))

    def _commit(self, container: Any, sandbox_id: str, ref: str, changes: list[str]) -> Any:
        repository, _, tag = ref.rpartition(":")
        try:
            return container.commit(repository=repository, tag=tag, pause=False, changes=changes)
        except docker.errors.NotFound as exc:
            raise errors.SandboxNotFound(
                f"sandbox {sandbox_id!r} disappeared while it was being snapshotted"
            ) from exc
        except docker.errors.APIError as exc:
            raise errors.OrchardError(
                f"the engine could not snapshot sandbox {sandbox_id!r}: {_explanation(exc)}"
            ) from exc

    def _layers_file(self, sandbox_id: str) -> Path:
        return self._settings.state_dir / "snapshot-layers" / f"{sandbox_id}.json"

    def _delete_snapshot(self, ref: str) -> bool:
        # Snapshots taken before repositories were per instance live in SNAPSHOT_REPOSITORY.
        if image_repository(ref) not in (self.snapshot_repository, SNAPSHOT_REPOSITORY):
            raise errors.InvalidRequest(
                f"{ref!r} is not a snapshot image of this instance (they are "
                f"{self.snapshot_repository}:<id>)"
            )
        try:
            # Never force: Podman would remove the containers that use the image with it.
            self._client.images.remove(ref, force=False, noprune=False)
        except docker.errors.NotFound:
            return True
        except docker.errors.APIError as exc:
            if exc.status_code == 409:  # a container (or a child image on Docker) uses it
                return False
            raise errors.OrchardError(
                f"the engine could not remove snapshot image {ref!r}: {_explanation(exc)}"
            ) from exc
        return True

    # -- the Backend protocol ---------------------------------------------------------------

    def _one_at_a_time(self, sandbox_id: str, call: Callable[[], _T]) -> _T:
        with self._id_locks[hash(sandbox_id) % ID_LOCK_STRIPES]:
            return call()

    async def create(self, spec: SandboxSpec) -> BackendSandbox:
        create = functools.partial(self._create, spec)
        return await self._call(self._lifecycle, self._one_at_a_time, spec.sandbox_id, create)

    async def inspect(self, sandbox_id: str) -> BackendSandbox | None:
        return await self._call(self._queries, self._inspect, sandbox_id)

    async def list(self) -> list[BackendSandbox]:
        return await self._call(self._queries, self._list)

    async def delete(self, sandbox_id: str) -> None:
        delete = functools.partial(self._delete, sandbox_id)
        await self._call(self._lifecycle, self._one_at_a_time, sandbox_id, delete)

    async def snapshot(
        self, sandbox_id: str, snapshot_id: str, *, parent: str | None = None
    ) -> SnapshotImage:
        return await self._call(self._lifecycle, self._snapshot, sandbox_id, snapshot_id, parent)

    async def delete_snapshot(self, ref: str) -> bool:
        return await self._call(self._lifecycle, self._delete_snapshot, ref)

    def _capacity(self) -> Capacity:
        """The engine's machine, as the engine reports it (it may be remote: DOCKER_HOST)."""
        info: dict[str, Any] = self._client.info()
        amounts = ResourceAmounts(
            cpu=float(info.get("NCPU") or 1), memory_bytes=int(info.get("MemTotal") or 0)
        )
        name = str(info.get("Name") or "engine")
        return Capacity(nodes=[NodeResources(name=name, capacity=amounts, allocatable=amounts)])

    async def capacity(self) -> Capacity:
        return await self._call(self._queries, self._capacity)

    async def close(self) -> None:
        await asyncio.to_thread(self._lifecycle.shutdown, True)
        await asyncio.to_thread(self._queries.shutdown, True)
        await asyncio.to_thread(self._client.close)
