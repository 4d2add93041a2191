"""The embedded default: Orchard on this machine's container engine.

The four stages of `orchard up` map onto one machine as: provision = find and check the
engine; images = the agent bundle and the default sandbox image (built locally from Debian
packages, so no registry is needed); deploy = the orchestrator as a background service
(pid file, log file, state under the state dir) plus an admin key and a CLI context;
smoke = `orchard smoke` against it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import socket
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from orchard_env import config, contexts
from orchard_env.config import ServiceSettings
from orchard_env.errors import ConfigError, OrchardError
from orchard_env.sdk import SandboxClient
from provision.base import Progress, ServiceStatus, StageResult, UpResult

DEFAULT_CONTEXT = "local"


@dataclass(frozen=True)
class LocalPaths:
    state_dir: Path

    @property
    def pid_file(self) -> Path:
        return self.state_dir / "orchard.pid"

    @property
    def log_file(self) -> Path:
        return self.state_dir / "orchard.log"

    @property
    def bundle_cache(self) -> Path:
        return self.state_dir / "bundle"


def _pid_alive(pid: int) -> bool:
    with contextlib.suppress(ChildProcessError):
        if os.waitpid(pid, os.WNOHANG)[0] == pid:  # our own child that has exited
            return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _serves_state_dir(pid: int, state_dir: Path) -> bool:
    """Whether ``pid`` is an orchestrator started for ``state_dir`` (its environment says so).
    A pid file can name a reused pid, or be copied from another state dir: such a process is
    someone else's and is never stopped. Without /proc (not Linux) the pid file is trusted."""
    proc = Path(f"/proc/{pid}")
    if not Path("/proc/self/environ").exists():
        return True
    try:
        environ = (proc / "environ").read_bytes().split(b"\0")
        cmdline = (proc / "cmdline").read_bytes()
    except OSError:  # gone, or another user's process
        return False
    wanted = f"ORCHARD_STATE_DIR={state_dir}".encode()
    return b"orchard_env.orchestrator" in cmdline and wanted in environ


def _read_pid(paths: LocalPaths) -> int | None:
    """The pid of this state dir's running orchestrator, or None."""
    try:
        pid = int(paths.pid_file.read_text().strip())
    except (FileNotFoundError, ValueError):
        return None
    if not _pid_alive(pid) or not _serves_state_dir(pid, paths.state_dir):
        return None
    return pid


def _service_env(settings: ServiceSettings) -> dict[str, str]:
    """The child's environment: every resolved setting passed explicitly as ORCHARD_*."""
    env = dict(os.environ)
    for key, value in vars(settings).items():
        if value is not None:
            if isinstance(value, tuple):
                text = ",".join(value)
            elif isinstance(value, Mapping):
                text = ",".join(f"{k}={v}" for k, v in value.items())
            else:
                text = str(value)
            env["ORCHARD_" + key.upper()] = text
    return env


@dataclass(frozen=True)
class DownPlan:
    """What `orchard down` would stop and delete, said before it does."""

    url: str
    state_dir: Path
    pid: int | None
    sandboxes: int | None  # None: the engine could not be asked
    instance: str
    context: str
    context_exists: bool

    def describe(self) -> str:
        process = (
            f"stop the orchestrator at {self.url} (pid {self.pid}, state dir {self.state_dir})"
            if self.pid is not None
            else f"no orchestrator runs for state dir {self.state_dir} (nothing to stop)"
        )
        count = "an unknown number of" if self.sandboxes is None else str(self.sandboxes)
        parts = [process, f"delete {count} sandbox container(s) of instance {self.instance!r}"]
        if self.context_exists:
            parts.append(f"remove context {self.context!r}")
        return "; ".join(parts)


class LocalProvider:
    target = "local"

    def __init__(
        self,
        settings: ServiceSettings,
        *,
        context: str = DEFAULT_CONTEXT,
        make_current: bool = False,
    ) -> None:
        self.settings = dataclasses.replace(settings, state_dir=settings.state_dir.absolute())
        self.context = context
        self.make_current = make_current
        self.paths = LocalPaths(self.settings.state_dir)

    @classmethod
    def for_context(
        cls,
        choice: contexts.ContextChoice,
        *,
        port: int | None = None,
        state_dir: str | None = None,
        make_current: bool = False,
    ) -> LocalProvider:
        """The local service a context names (flag > env > the context's records > default),
        refusing flags that point somewhere else than an existing context records: acting on
        one service under another's context is how the wrong one gets stopped."""
        settings = config.service_settings(context=choice, port=port, state_dir=state_dir)
        provider = cls(settings, context=choice.name or DEFAULT_CONTEXT, make_current=make_current)
        if choice.exists:
            recorded = choice.values.get("state_dir")
            if recorded and Path(recorded).absolute() != provider.paths.state_dir:
                raise ConfigError(
                    f"context {provider.context!r} is the service of state dir {recorded}, "
                    f"not {provider.paths.state_dir}",
                    hint="drop --state-dir (and ORCHARD_STATE_DIR), or name another context "
                    "with --context",
                )
            url = choice.values.get("url")
            if choice.values.get("target", "local") == "local" and url and url != provider.url:
                raise ConfigError(
                    f"context {provider.context!r} is the service at {url}, not {provider.url}",
                    hint="drop --port (and ORCHARD_PORT), or name another context with --context",
                )
        return provider

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.settings.host in ("0.0.0.0", "::") else self.settings.host
        return f"http://{host}:{self.settings.port}"

    # --- stages ------------------------------------------------------------------------

    def provision(self, progress: Progress) -> StageResult:
        from orchard_env.orchestrator.backends.docker_engine import find_engine

        progress("looking for a container engine")
        engine = find_engine(self.settings.docker_host)
        return StageResult("provision", f"container engine at {engine}")

    def images(self, progress: Progress) -> StageResult:
        import docker

        from images.local import SANDBOX_IMAGE, ensure_sandbox_image
        from orchard_env.agent.bundle import ensure_bundle
        from orchard_env.orchestrator.backends.docker_engine import find_engine

        progress("building the agent bundle")
        bundle = ensure_bundle(self.paths.bundle_cache)
        tools = self._tools(progress)
        client = docker.DockerClient(base_url=find_engine(self.settings.docker_host))
        try:
            present = bool(client.images.list(name=SANDBOX_IMAGE))
            if not present:
                progress(
                    f"building {SANDBOX_IMAGE} from Debian packages (first run: a few minutes)"
                )
            image = ensure_sandbox_image(client, progress=progress)
        finally:
            client.close()
        how = "present" if present else "built locally from Debian packages (no registry needed)"
        return StageResult(
            "images", f"agent bundle {bundle.name}; {tools}; sandbox image {image} {how}"
        )

    def _tools(self, progress: Progress) -> str:
        """Build (or find cached) the tools payload the service will mount."""
        from orchard_env.tools.payload import ensure_payload

        if self.settings.tools_dir is not None:
            return f"tools payload {self.settings.tools_dir}"
        if not self.settings.tools:
            return "no tools payload (tools = none)"
        progress(
            f"building the tools payload ({', '.join(self.settings.tools)}; first run: minutes)"
        )
        payload = ensure_payload(
            self.settings.tools,
            self.settings.tools_versions,
            cache_dir=self.settings.tools_cache_dir,
            progress=progress,
        )
        self.settings = dataclasses.replace(self.settings, tools_dir=payload)
        return f"tools payload {payload.name} ({', '.join(self.settings.tools)})"

    def deploy(self, progress: Progress) -> StageResult:
        api_key = self._admin_key(progress)
        pid = _read_pid(self.paths)
        skipped = pid is not None and self._healthy(api_key)
        if not skipped:
            if pid is not None:
                self._stop_process(pid, progress)
            pid = self._start_process(progress)
        current = contexts.write_context(
            self.context,
            {
                "url": self.url,
                "api_key": api_key,
                "target": "local",
                "state_dir": str(self.settings.state_dir),
                "instance": self.settings.instance,
            },
            make_current=self.make_current,
        )
        verb = "already running" if skipped else "started"
        which = "the current one" if current else "not the current one"
        return StageResult(
            "deploy",
            f"orchestrator {verb} at {self.url} (pid {pid}); context {self.context!r} ({which})",
            skipped=skipped,
        )

    def smoke(self, progress: Progress) -> StageResult:
        from orchard_env.smoke import run_smoke

        progress("running the smoke test")
        with SandboxClient(base_url=self.url, context=self.context) as client:
            report = run_smoke(client)
        if not report.ok:
            failed = ", ".join(step.name for step in report.failed)
            raise OrchardError(
                f"smoke test failed: {failed}",
                hint=f"`orchard smoke --context {self.context}` shows each check; "
                f"the service log is {self.paths.log_file}",
            )
        return StageResult("smoke", f"{len(report.steps)} checks passed in {report.seconds:.1f} s")

    # --- provider API -------------------------------------------------------------------

    def up(self, progress: Progress, *, smoke: bool = True) -> UpResult:
        result = UpResult(url=self.url, context=self.context)
        stages = [self.provision, self.images, self.deploy] + ([self.smoke] if smoke else [])
        for stage in stages:
            result.stages.append(stage(progress))
        return result

    def down_plan(self) -> DownPlan:
        """What :meth:`down` would do; asks the engine how many sandboxes there are."""
        try:
            sandboxes: int | None = asyncio.run(self._remove_sandboxes(delete=False))
        except OrchardError:
            sandboxes = None
        return DownPlan(
            url=self.url,
            state_dir=self.paths.state_dir,
            pid=_read_pid(self.paths),
            sandboxes=sandboxes,
            instance=self.settings.instance,
            context=self.context,
            context_exists=self.context in contexts.load_config_file().get("contexts", {}),
        )

    def down(self, progress: Progress) -> None:
        pid = _read_pid(self.paths)
        if pid is not None:
            self._stop_process(pid, progress)
        progress("removing this service's sandboxes")
        removed = asyncio.run(self._remove_sandboxes())
        if removed:
            progress(f"removed {removed} sandbox container(s)")
        contexts.remove_context(self.context)

    async def _remove_sandboxes(self, *, delete: bool = True) -> int:
        """Delete the containers of this service (its instance and state dir), with or without
        it running (or, ``delete=False``, only count them); another service's on the same
        engine are not listed, so never touched."""
        from orchard_env.orchestrator.backends.docker_engine import DockerEngineBackend

        backend = DockerEngineBackend(self.settings, bundle_dir=self.paths.bundle_cache)
        try:
            sandboxes = await backend.list()
            if delete:
                await asyncio.gather(*(backend.delete(sb.sandbox_id) for sb in sandboxes))
        finally:
            await backend.close()
        return len(sandboxes)

    def status(self) -> ServiceStatus:
        pid = _read_pid(self.paths)
        detail = {"state_dir": str(self.settings.state_dir), "log": str(self.paths.log_file)}
        if pid is None:
            return ServiceStatus("local", False, None, detail)
        detail["pid"] = str(pid)
        try:
            with SandboxClient(base_url=self.url, context=self.context, retries=0) as client:
                health = client.health()
                detail["sandboxes"] = str(len(client.list_sandboxes()))
        except OrchardError as exc:
            detail["error"] = exc.message
            return ServiceStatus("local", False, self.url, detail)
        detail["backend"] = health.backend
        detail["version"] = health.version
        return ServiceStatus("local", True, self.url, detail)

    # --- internals ----------------------------------------------------------------------

    def _admin_key(self, progress: Progress) -> str:
        """The context's admin key if the service's store knows it, else a new one."""
        from orchard_env.orchestrator.keys import create_key_sync, key_is_valid_sync

        with contextlib.suppress(OrchardError):
            _, values = contexts.active_context(contexts.load_config_file(), self.context)
            existing = values.get("api_key")
            if existing and key_is_valid_sync(self.settings, existing, admin=True):
                return str(existing)
        progress("creating an admin API key")
        created = create_key_sync(self.settings, name=f"{self.context}-admin", admin=True)
        return created.api_key

    def _healthy(self, api_key: str) -> bool:
        try:
            with SandboxClient(base_url=self.url, api_key=api_key, retries=0) as client:
                client.health()
        except OrchardError:
            return False
        return True

    def _port_error(self, port: int) -> str | None:
        """Why this service cannot listen on ``port``, or None if it can."""
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((self.settings.host, port))
            except OSError as exc:
                return exc.strerror or str(exc)
        return None

    def _check_port_free(self) -> None:
        port = self.settings.port
        reason = self._port_error(port)
        if reason is None:
            return
        # A port that is free now, never a fixed one: that may be another service's.
        free = next((p for p in range(port + 1, port + 200) if self._port_error(p) is None), None)
        instead = (
            f"`orchard up --port {free} --state-dir {self.settings.state_dir}`"
            if free is not None
            else "`orchard up --port <a free port>`"
        )
        raise OrchardError(
            f"port {port} on {self.settings.host} is taken: {reason} (if an Orchard service "
            "answers there, it is another state directory's: `orchard status` shows this one's)",
            hint=f"stop what listens there, or give this service a free port: {instead}",
        )

    def _start_process(self, progress: Progress) -> int:
        self._check_port_free()
        self.paths.state_dir.mkdir(parents=True, exist_ok=True)
        progress(f"starting the orchestrator (log: {self.paths.log_file})")
        # posix_spawn, not Popen: the service outlives this process, so there is no Popen
        # object to wait on, only a pid (and a pid file).
        log_fd = os.open(self.paths.log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        null_fd = os.open(os.devnull, os.O_RDONLY)
        try:
            pid = os.posix_spawn(
                sys.executable,
                [sys.executable, "-m", "orchard_env.orchestrator"],
                _service_env(self.settings),
                file_actions=[
                    (os.POSIX_SPAWN_DUP2, null_fd, 0),
                    (os.POSIX_SPAWN_DUP2, log_fd, 1),
                    (os.POSIX_SPAWN_DUP2, log_fd, 2),
                ],
                setsid=True,
            )
        finally:
            os.close(log_fd)
            os.close(null_fd)
        self.paths.pid_file.write_text(f"{pid}\n")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if not _pid_alive(pid):
                tail = self.paths.log_file.read_text(errors="replace")[-2000:]
                raise OrchardError(
                    f"the orchestrator exited at start:\n{tail}",
                    hint=f"the whole log is {self.paths.log_file}",
                )
            if self._healthy(""):
                return pid
            time.sleep(0.2)
        raise OrchardError(
            f"the orchestrator did not answer on {self.url} within 60 s",
            hint=f"see {self.paths.log_file}",
        )

    def _stop_process(self, pid: int, progress: Progress) -> None:
        progress(f"stopping the orchestrator (pid {pid})")
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 20
        while _pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if _pid_alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.paths.pid_file.unlink(missing_ok=True)
