"""The service's configuration: one table, the precedence of :mod:`orchard_env.contexts`.

Explicit argument (CLI flag) > ``ORCHARD_*`` environment variable > a local context's state
dir, port and instance > the config file's ``[service]`` section > the default in the table
below. Nothing is read at import time: call :func:`service_settings` when you need values.
A bad value raises :class:`~orchard_env.errors.ConfigError` naming its key and where it
came from.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from orchard_env.contexts import ContextChoice, Setting, config_path, load_config_file, resolve
from orchard_env.errors import ConfigError, InvalidRequest
from orchard_env.quantities import parse_cpu, parse_memory, sandbox_cpu, sandbox_memory
from orchard_env.tools import VERSIONS, parse_harnesses, parse_versions


def state_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "orchard"


def _bool(value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError("expected true or false")


def _positive_int(value: str) -> int:
    number = int(value)
    if number <= 0:
        raise ValueError("must be a positive whole number")
    return number


def _non_negative_int(value: str) -> int:
    number = int(value)
    if number < 0:
        raise ValueError("must be zero or a positive whole number")
    return number


def _harness_profile(value: str) -> tuple[str, ...]:
    try:
        return parse_harnesses(value)
    except InvalidRequest as exc:
        raise ValueError(exc.message) from None


def _volume_mode(value: str) -> str:
    if value not in ("image", "initcontainer", "off"):
        raise ValueError("must be image, initcontainer or off")
    return value


PULL_POLICIES = ("IfNotPresent", "Always", "Never")


def _pull_policy(value: str) -> str:
    if value not in PULL_POLICIES:
        raise ValueError("must be " + ", ".join(PULL_POLICIES[:-1]) + " or " + PULL_POLICIES[-1])
    return value


def _cidr_list(value: str) -> tuple[str, ...]:
    networks = tuple(item.strip() for item in value.split(",") if item.strip())
    for network in networks:
        ipaddress.ip_network(network)  # ValueError names the bad one
    return networks


# The one table. Service settings are read by `orchard serve`; client settings by the SDK/CLI.
SERVICE_SETTINGS: tuple[Setting, ...] = (
    Setting("host", "127.0.0.1", str, "address the orchestrator listens on"),
    Setting("port", "8000", _positive_int, "port the orchestrator listens on"),
    Setting("state_dir", None, Path, "where the database, logs and sandbox dirs live"),
    Setting("backend", "docker", str, "sandbox backend: docker (local engine) or kubernetes"),
    Setting("docker_host", None, str, "engine socket URL; default: DOCKER_HOST, then the usual"),
    Setting(
        "instance",
        None,
        str,
        "name of this orchestrator; labels its sandboxes (default: local engine, one of the "
        "state dir's own, kept in <state_dir>/instance; Kubernetes, 'default')",
    ),
    Setting("require_api_key", "true", _bool, "reject requests without a valid X-API-Key"),
    Setting("default_cpu", "1", sandbox_cpu, "CPU cores of a sandbox that asks for none"),
    Setting("default_memory", "2Gi", sandbox_memory, "memory of a sandbox that asks for none"),
    Setting("max_cpu", "16", sandbox_cpu, "largest CPU a sandbox may ask for"),
    Setting("max_memory", "64Gi", sandbox_memory, "largest memory a sandbox may ask for"),
    Setting("pids_limit", "4096", _positive_int, "process limit per sandbox"),
    Setting("max_sandboxes", "1000", _positive_int, "live sandboxes of the whole service"),
    Setting("key_max_sandboxes", "100", _positive_int, "live sandboxes per non-admin key"),
    Setting("key_max_cpu", "64", parse_cpu, "CPU cores of a non-admin key's live sandboxes"),
    Setting("key_max_memory", "256Gi", parse_memory, "memory of a non-admin key's sandboxes"),
    Setting("default_workdir", "/workspace", str, "working directory of a new sandbox"),
    Setting("sandbox_ttl_seconds", "7200", _non_negative_int, "lifetime cap; 0 = none"),
    Setting("idle_timeout_seconds", "1800", _non_negative_int, "idle expiry; 0 = none"),
    Setting(
        "ready_timeout_seconds",
        "3600",
        _positive_int,
        "how long a sandbox may take to start (image pull included) when it asks for no timeout",
    ),
    Setting(
        "max_ready_timeout_seconds", "7200", _positive_int, "the largest timeout a create may ask"
    ),
    Setting("reap_interval_seconds", "15", _positive_int, "how often the reaper runs"),
    Setting("max_output_bytes", str(16 * 1024 * 1024), _positive_int, "exec output cap"),
    Setting(
        "max_body_bytes",
        str(32 * 1024 * 1024),
        _positive_int,
        "largest JSON request body (413 past it); raw file uploads are streamed, not capped",
    ),
    Setting("job_retention_seconds", "86400", _positive_int, "how long finished jobs stay"),
    Setting(
        "snapshot_ttl_seconds",
        str(7 * 86400),
        _non_negative_int,
        "lifetime of a snapshot that asks for none (forks' too); 0 = kept until deleted",
    ),
    Setting("agent_bundle_dir", None, Path, "the relocatable agent bundle to mount"),
    # The tools payload (agent harnesses at /opt/sandbox-tools, see orchard_env.tools)
    Setting(
        "tools",
        "all",
        _harness_profile,
        "harnesses in the tools payload: all, none or a list (codex,claude,opencode,pi,hermes)",
    ),
    Setting(
        "tools_versions",
        "",
        parse_versions,
        "version overrides, NAME=VERSION,... (e.g. codex=0.172.0)",
    ),
    Setting("tools_dir", None, Path, "a built tools payload to mount (default: built and cached)"),
    Setting(
        "tools_cache_dir",
        None,
        Path,
        "where payloads are cached (default /var/cache/orchard/tools)",
    ),
    Setting("bootstrap_key_file", None, Path, "file with an API key imported as admin at start"),
    # Kubernetes backend
    Setting("k8s_namespace", "orchard-sandboxes", str, "namespace the sandbox pods run in"),
    Setting("k8s_kubeconfig", None, str, "kubeconfig file; default: in-cluster, then KUBECONFIG"),
    Setting("k8s_context", None, str, "kubeconfig context; default: the current one"),
    Setting("agent_image", None, str, "agent-injector image (copies the bundle into each pod)"),
    Setting("agent_port", "9090", _positive_int, "TCP port of the agent inside a pod"),
    Setting("tools_image", None, str, "tools image (the payload at /opt/sandbox-tools)"),
    Setting(
        "tools_volume_mode",
        "initcontainer",
        _volume_mode,
        "how pods get the tools image: image (an image volume, Kubernetes >= 1.33 with the "
        "ImageVolume feature), initcontainer (copied into an emptyDir) or off",
    ),
    Setting("runtime_class", None, str, "runtimeClassName for sandbox pods (gvisor, kata)"),
    Setting(
        "image_pull_policy",
        "IfNotPresent",
        _pull_policy,
        "imagePullPolicy of a sandbox's image: IfNotPresent (an image the node has is used, "
        "as the local engine does, whatever its tag), Always (the registry asked at every "
        "create: for tags you push again) or Never",
    ),
    Setting(
        "ephemeral_storage",
        "10Gi",
        parse_memory,
        "disk limit of a sandbox without one (a pod's ephemeral-storage; locally where the "
        "engine's storage can enforce it), and the largest disk a sandbox may ask for",
    ),
    Setting(
        "egress_except",
        "10.0.0.0/8,172.16.0.0/12,192.168.0.0/16,100.64.0.0/10,169.254.0.0/16",
        _cidr_list,
        "ranges a sandbox with network may never reach (cluster, metadata)",
    ),
    # Snapshots on Kubernetes (the node snapshotter DaemonSet): on when both are set
    Setting("registry", None, str, "repository snapshots are pushed to (<registry>/<repo>)"),
    Setting("snapshotter_token_file", None, Path, "file with the node snapshotters' token"),
    Setting("snapshotter_namespace", "orchard-snapshotter", str, "namespace of the snapshotters"),
    Setting("snapshotter_port", "9091", _positive_int, "TCP port of the node snapshotters"),
    Setting("registry_config", None, Path, "docker config JSON with the registry's credentials"),
    Setting("registry_plain_http", "false", _bool, "speak plain HTTP to the registry (tests)"),
    Setting(
        "model_endpoints_file",
        None,
        Path,
        "TOML file of the model endpoints (and their keys) sandbox gateways forward to",
    ),
)


def _state_file(path: Path, make: Callable[[], str]) -> str:
    """The text of a per-state-dir identity file, written (owner-only) by the first reader."""
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    value = make()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # another process wrote it first: theirs wins
        return path.read_text().strip()
    with os.fdopen(fd, "w") as handle:
        handle.write(value + "\n")
    return value


def state_instance(directory: Path) -> str:
    """The instance name of the service whose state is in ``directory``, when none is set:
    ``default-<8 hex>``, made once and kept in ``<directory>/instance``, so two state dirs on
    one engine never share one. A state dir that already has a database from before this
    file existed keeps ``default``, the name its containers carry."""

    def make() -> str:
        legacy = (directory / "orchard.db").exists()
        return "default" if legacy else f"default-{secrets.token_hex(4)}"

    return _state_file(directory / "instance", make)


def state_id(directory: Path) -> str:
    """A random id of the state dir ``directory`` (``<directory>/state-id``), made once. The
    local engine labels containers with it: a service adopts only containers carrying its own,
    whatever their instance name says."""
    return _state_file(directory / "state-id", lambda: secrets.token_hex(8))


@dataclass(frozen=True)
class ServiceSettings:
    host: str
    port: int
    state_dir: Path
    backend: str
    docker_host: str | None
    instance: str
    require_api_key: bool
    default_cpu: float
    default_memory: int
    max_cpu: float
    max_memory: int
    pids_limit: int
    max_sandboxes: int
    key_max_sandboxes: int
    key_max_cpu: float
    key_max_memory: int
    default_workdir: str
    sandbox_ttl_seconds: int
    idle_timeout_seconds: int
    ready_timeout_seconds: int
    max_ready_timeout_seconds: int
    reap_interval_seconds: int
    max_output_bytes: int
    max_body_bytes: int
    job_retention_seconds: int
    snapshot_ttl_seconds: int
    agent_bundle_dir: Path | None
    bootstrap_key_file: Path | None
    k8s_namespace: str
    k8s_kubeconfig: str | None
    k8s_context: str | None
    agent_image: str | None
    agent_port: int
    runtime_class: str | None
    ephemeral_storage: int
    egress_except: tuple[str, ...]
    registry: str | None = None
    snapshotter_token_file: Path | None = None
    snapshotter_namespace: str = "orchard-snapshotter"
    snapshotter_port: int = 9091
    registry_config: Path | None = None
    registry_plain_http: bool = False
    model_endpoints_file: Path | None = None
    tools: tuple[str, ...] = ()
    tools_versions: Mapping[str, str] = field(default_factory=lambda: dict(VERSIONS))
    tools_dir: Path | None = None
    tools_cache_dir: Path | None = None
    tools_image: str | None = None
    tools_volume_mode: str = "initcontainer"
    image_pull_policy: str = "IfNotPresent"

    @property
    def db_path(self) -> Path:
        return self.state_dir / "orchard.db"

    @property
    def sandboxes_dir(self) -> Path:
        return self.state_dir / "sandboxes"


def _local_context_values(choice: ContextChoice) -> dict[str, Any]:
    """What a local context records about its service: state dir, port and instance."""
    values: dict[str, Any] = {
        k: choice.values[k] for k in ("state_dir", "instance") if k in choice.values
    }
    port = urlsplit(str(choice.values.get("url", ""))).port
    if port is not None:
        values["port"] = port
    return values


def service_settings(*, context: ContextChoice | None = None, **overrides: Any) -> ServiceSettings:
    """Resolve the orchestrator's settings (flags as keyword arguments). With a local
    ``context``, its state dir, port and instance rank between the environment and the
    config file's ``[service]`` section (flag > env > context > file > default)."""
    file_values = dict(load_config_file().get("service", {}))
    label = f"{config_path()} [service]"
    if context is not None and context.exists:
        file_values.update(_local_context_values(context))
        label += f" or context {context.name!r}"
    values = resolve(SERVICE_SETTINGS, overrides, file_values, label)
    if values["state_dir"] is None:
        values["state_dir"] = state_dir()
    if values["instance"] is None:
        values["instance"] = (
            state_instance(values["state_dir"]) if values["backend"] == "docker" else "default"
        )
    if values["backend"] not in ("docker", "kubernetes"):
        raise ConfigError(
            f"unknown backend {values['backend']!r}", hint="backend is docker or kubernetes"
        )
    return ServiceSettings(**values)


def default_service_settings(**overrides: Any) -> ServiceSettings:
    """The table's defaults plus ``overrides``, with no environment or config file read (for
    tests and benchmarks that run an orchestrator of their own)."""
    values: dict[str, Any] = {s.key: None for s in SERVICE_SETTINGS}
    values.update({s.key: s.parse(s.default) for s in SERVICE_SETTINGS if s.default is not None})
    values.update(overrides)
    return ServiceSettings(**values)
