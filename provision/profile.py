"""The deployment profile: one YAML file describes one Orchard deployment.

`orchard init` writes a commented default (:func:`default_profile_yaml`); `orchard up`
reads it (:func:`load_profile`) and `orchard up --plan` prints what it would do without
acting. Every value is validated here, once; a bad value is a
:class:`~orchard_env.errors.ConfigError` naming its key (``sandbox_pool.max_nodes``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from orchard_env.errors import ConfigError
from orchard_env.quantities import parse_cpu, parse_memory

Target = Literal["local", "aks", "kubeconfig"]
Tier = Literal["Free", "Standard", "Premium"]
OsDisk = Literal["auto", "Managed", "Ephemeral"]

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_ACR_NAME = re.compile(r"^[a-zA-Z0-9]{5,50}$")


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class AzureSettings(_Section):
    """Where and how the AKS cluster lives (target ``aks``)."""

    subscription_id: str | None = Field(
        default=None, description="default: AZURE_SUBSCRIPTION_ID, then `az account show`"
    )
    location: str = "eastus"
    resource_group: str | None = Field(default=None, description="default: <name>-rg")
    cluster_name: str | None = Field(default=None, description="default: <name>-aks")
    acr_name: str | None = Field(
        default=None, description="5-50 letters/digits, globally unique; default from <name>"
    )
    kubernetes_version: str | None = Field(default=None, description="default: AKS's default")
    tier: Tier = "Free"
    log_analytics: bool = False
    tags: dict[str, str] = Field(default_factory=dict)

    @field_validator("acr_name")
    @classmethod
    def _acr(cls, value: str | None) -> str | None:
        if value is not None and not _ACR_NAME.match(value):
            raise ValueError(f"{value!r} must be 5-50 letters and digits (no dashes)")
        return value


class KubeconfigSettings(_Section):
    """An existing cluster (target ``kubeconfig``)."""

    path: str | None = Field(default=None, description="default: KUBECONFIG, then ~/.kube/config")
    context: str | None = Field(default=None, description="default: the current context")


class NodePool(_Section):
    vm_size: str = "Standard_D4as_v5"
    min_nodes: int = Field(default=1, ge=0, le=1000)
    max_nodes: int = Field(default=3, ge=1, le=1000)

    @model_validator(mode="after")
    def _range(self) -> NodePool:
        if self.min_nodes > self.max_nodes:
            raise ValueError(f"min_nodes ({self.min_nodes}) is above max_nodes ({self.max_nodes})")
        return self


class SandboxPool(NodePool):
    """Nodes that run sandboxes: labelled and tainted ``workload=sandbox``."""

    vm_size: str = "Standard_D16as_v5"
    min_nodes: int = Field(default=0, ge=0, le=1000)
    max_nodes: int = Field(default=10, ge=1, le=1000)
    spot: bool = True
    max_pods: int = Field(default=30, ge=10, le=250)
    os_disk: OsDisk = Field(
        default="auto", description="auto: Ephemeral where the size has a temp disk, else Managed"
    )


class RegistrySettings(_Section):
    server: str | None = Field(
        default=None, description="e.g. myacr.azurecr.io; default for aks: the created ACR"
    )
    repository: str = "orchard"
    plain_http: bool = Field(
        default=False,
        description="a registry without TLS (a local one): checked, pushed to and pulled "
        "from over HTTP",
    )


class BuildSettings(_Section):
    """How `orchard up` builds the images (the options of `orchard images build`)."""

    base_images: dict[str, str] = Field(
        default_factory=dict,
        description="ARG: image, e.g. BASE_IMAGE: a mirror's python:3.11-slim",
    )
    ca_bundle: str | None = Field(
        default=None, description="CA certificates pip trusts in the build (a proxy's)"
    )


class Toleration(_Section):
    """A taint the orchestrator's pods tolerate (a Kubernetes toleration)."""

    key: str | None = None
    operator: Literal["Equal", "Exists"] = "Equal"
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None

    @model_validator(mode="after")
    def _operator(self) -> Toleration:
        if self.operator == "Exists" and self.value is not None:
            raise ValueError("a toleration with operator Exists takes no value")
        if self.key is None and self.operator != "Exists":
            raise ValueError("a toleration without a key needs operator Exists")
        return self


class NodeSnapshotter(_Section):
    """Where the node snapshotter (``snapshots: true``) finds what it reads, and runs."""

    containerd_root: str = Field(
        default="/var/lib/containerd",
        description="the sandbox nodes' containerd state (k3s: /var/lib/rancher/k3s/agent/"
        "containerd)",
    )
    tolerations: list[Toleration] = Field(
        default_factory=list,
        description="taints of the sandbox nodes beyond workload=sandbox and spot",
    )

    @field_validator("containerd_root")
    @classmethod
    def _absolute(cls, value: str) -> str:
        if not value.startswith("/"):
            raise ValueError(f"{value!r} is not an absolute path")
        return value


class ServiceProfile(_Section):
    namespace: str = "orchard"
    sandbox_namespace: str = "orchard-sandboxes"
    replicas: int = Field(default=1, ge=1, le=20)
    load_balancer: bool = False
    load_balancer_source_ranges: list[str] = Field(default_factory=list)
    redis: bool = Field(default=False, description="needed for more than one replica")
    node_selector: dict[str, str] = Field(
        default_factory=dict, description="labels of the nodes the orchestrator runs on"
    )
    tolerations: list[Toleration] = Field(
        default_factory=list, description="taints of those nodes it tolerates"
    )

    @field_validator("namespace", "sandbox_namespace")
    @classmethod
    def _namespace(cls, value: str) -> str:
        if not _DNS_LABEL.match(value):
            raise ValueError(f"{value!r} is not a valid namespace name (a DNS label)")
        return value

    @model_validator(mode="after")
    def _replicas(self) -> ServiceProfile:
        if self.replicas > 1 and not self.redis:
            raise ValueError("replicas above 1 need redis: true (shared state)")
        return self


class Limits(_Section):
    """Sandbox sizes and lifetimes the service enforces."""

    default_cpu: str = "1"
    default_memory: str = "2Gi"
    max_cpu: str = "8"
    max_memory: str = "32Gi"
    ephemeral_storage: str = "10Gi"
    pids_limit: int = Field(default=4096, ge=64)
    sandbox_ttl_seconds: int = Field(default=7200, ge=0)
    idle_timeout_seconds: int = Field(default=1800, ge=0)

    @field_validator("default_cpu", "max_cpu")
    @classmethod
    def _cpu(cls, value: str) -> str:
        parse_cpu(value)
        return value

    @field_validator("default_memory", "max_memory", "ephemeral_storage")
    @classmethod
    def _memory(cls, value: str) -> str:
        parse_memory(value)
        return value


class DeploymentProfile(_Section):
    """One deployment of Orchard."""

    name: str = "orchard"
    target: Target = "aks"
    azure: AzureSettings = Field(default_factory=AzureSettings)
    kubeconfig: KubeconfigSettings = Field(default_factory=KubeconfigSettings)
    system_pool: NodePool = Field(default_factory=NodePool)
    sandbox_pool: SandboxPool = Field(default_factory=SandboxPool)
    runtime_class: str | None = Field(default=None, description="e.g. gvisor or kata")
    image_pull_policy: Literal["IfNotPresent", "Always", "Never"] = Field(
        default="IfNotPresent",
        description="of sandbox images; Always for tags you push again",
    )
    registry: RegistrySettings = Field(default_factory=RegistrySettings)
    build: BuildSettings = Field(default_factory=BuildSettings)
    service: ServiceProfile = Field(default_factory=ServiceProfile)
    limits: Limits = Field(default_factory=Limits)
    image_tag: str | None = Field(default=None, description="default: <version>-<git commit>")
    tools: bool = Field(
        default=False,
        description="the tools image (agent harnesses, 1.4 GB, Claude Code inside: your own "
        "registry only): up builds and pushes it, sandboxes get it",
    )
    model_endpoints: str | None = Field(
        default=None,
        description="TOML file of the model endpoints sandbox gateways forward to (keys: "
        'key_file = "/etc/orchard/model-keys/<key>", from your Secret orchard-model-keys)',
    )
    snapshotter: NodeSnapshotter = Field(default_factory=NodeSnapshotter)
    snapshots: bool = Field(
        default=False,
        description="snapshots on Kubernetes: a node snapshotter on each sandbox node pushes "
        "them to <registry.server>/<registry.repository>/snapshots",
    )

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not _DNS_LABEL.match(value) or len(value) > 40:
            raise ValueError(f"{value!r} must be a DNS label of at most 40 characters")
        return value

    @property
    def resource_group(self) -> str:
        return self.azure.resource_group or f"{self.name}-rg"

    @property
    def cluster_name(self) -> str:
        return self.azure.cluster_name or f"{self.name}-aks"

    @property
    def acr_name(self) -> str:
        return self.azure.acr_name or re.sub(r"[^a-z0-9]", "", f"{self.name}acr")[:50].ljust(5, "0")


def _key(loc: tuple[int | str, ...]) -> str:
    return ".".join(str(part) for part in loc) or "(top level)"


def parse_profile(data: Any, *, source: str) -> DeploymentProfile:
    """Validate already-loaded YAML; errors name the key and the file."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: a profile is a mapping of keys to values")
    try:
        return DeploymentProfile.model_validate(data)
    except ValidationError as exc:
        problems = []
        for error in exc.errors():
            key = _key(error["loc"])
            if error["type"] == "extra_forbidden":
                problems.append(f"unknown key {key!r}")
            else:
                message = str(error["msg"]).removeprefix("Value error, ")
                problems.append(f"{key}: {message}")
        raise ConfigError(
            f"{source}: " + "; ".join(problems),
            hint="`orchard init --print` shows every key with its default",
        ) from exc


def load_profile(path: Path) -> DeploymentProfile:
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(
            f"cannot read profile {path}: {exc.strerror or exc}",
            hint="`orchard init` writes a commented default profile",
        ) from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"profile {path} is not valid YAML: {exc}") from exc
    return parse_profile(data, source=f"profile {path}")


def _yaml_lines(model: type[BaseModel], values: dict[str, Any], indent: int) -> list[str]:
    lines: list[str] = []
    pad = "  " * indent
    for name, field in model.model_fields.items():
        value = values[name]
        comment = f"  # {field.description}" if field.description else ""
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            lines.append(f"{pad}{name}:")
            lines.extend(_yaml_lines(annotation, value, indent + 1))
            continue
        rendered = yaml.safe_dump(value, default_flow_style=True, width=1000).strip()
        rendered = rendered.removesuffix("\n...").removesuffix("...").strip()
        lines.append(f"{pad}{name}: {rendered}{comment}")
    return lines


def default_profile_yaml(target: Target = "aks", name: str = "orchard") -> str:
    """A complete, commented profile with every key at its default."""
    profile = DeploymentProfile(name=name, target=target)
    header = [
        "# Orchard deployment profile. `orchard up --profile <file> --plan` shows what it does.",
        "# Every key is optional; the values below are the defaults.",
    ]
    body = _yaml_lines(DeploymentProfile, profile.model_dump(), 0)
    return "\n".join([*header, *body]) + "\n"
