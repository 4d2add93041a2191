"""AKS (target ``aks``): everything `orchard up` needs in an Azure subscription.

In order: the resource group; the resource providers it uses (registered if they are not);
an optional Log Analytics workspace; an Azure Container Registry; the AKS cluster (Azure CNI
overlay with Calico network policy, a System pool autoscaled between the profile's bounds);
the sandbox pool (User mode, autoscaled from ``sandbox_pool.min_nodes`` (0 by default),
labelled and tainted ``workload=sandbox``, spot with eviction Delete and max price -1 when the
profile says so, an ephemeral OS disk only where the size has a temp disk); AcrPull on the
registry for the cluster's kubelet identity; and the cluster's user credentials merged into
the kubeconfig as a named context (mode 0600).

Every step reads before it writes (:meth:`AksTarget.plan` is those reads alone), creates
only what is missing, updates only what can change in place (autoscaler bounds, sandbox
labels and taints) and reports everything else that differs as drift: it never recreates what
exists. Everything it creates carries the tags ``created-by=orchard`` and
``orchard-deployment=<name>``; :meth:`AksTarget.delete` removes only what carries them.

This is the only module (with the ACR login of the image push) that imports ``azure.*``, and
only lazily: without the ``azure`` extra the target fails with an install hint.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import yaml

from orchard_env.errors import AuthenticationRequired, ConfigError, OrchardError, PermissionDenied
from provision.base import Change, Progress
from provision.kubeconfig import (
    SANDBOX_LABEL,
    SANDBOX_TAINT,
    kubeconfig_path,
    merge_kubeconfig,
    read_kubeconfig,
    remove_kubeconfig_context,
    write_kubeconfig,
)
from provision.profile import DeploymentProfile

if TYPE_CHECKING:
    from azure.core.credentials import TokenCredential
    from azure.core.polling import LROPoller
    from azure.mgmt.authorization import AuthorizationManagementClient
    from azure.mgmt.containerregistry import ContainerRegistryManagementClient
    from azure.mgmt.containerregistry.models import Registry
    from azure.mgmt.containerservice import ContainerServiceClient
    from azure.mgmt.containerservice.models import AgentPool, ManagedCluster
    from azure.mgmt.loganalytics import LogAnalyticsManagementClient
    from azure.mgmt.loganalytics.models import Workspace
    from azure.mgmt.resource.resources import ResourceManagementClient
    from azure.mgmt.resource.resources.models import ResourceGroup

AZURE_EXTRA_HINT = "install the azure extra: pip install 'orchard[azure]'"
CREDENTIALS_HINT = (
    "run `az login`, or set AZURE_CLIENT_ID, AZURE_TENANT_ID and AZURE_CLIENT_SECRET for a "
    "service principal (ORCHARD_DEBUG=1 shows every credential that was tried)"
)
MANAGEMENT_SCOPE = "https://management.azure.com/.default"
ACR_PULL_ROLE = "7f951dda-4ed3-4680-a7ca-43fe172d538d"  # the built-in AcrPull role
SYSTEM_POOL = "system"
SANDBOX_POOL = "sandbox"
CREATED_BY = ("created-by", "orchard")
DEPLOYMENT_TAG = "orchard-deployment"
KATA_RUNTIME_CLASSES = ("kata-vm-isolation", "kata-mshv-vm-isolation")
ROLE_RETRY_SECONDS = 180.0  # a new kubelet identity takes up to a few minutes to replicate
LRO_REPORT_SECONDS = 15.0
_SDK_MODULES = (
    "azure.identity",
    "azure.mgmt.containerservice",
    "azure.mgmt.containerregistry",
    "azure.mgmt.authorization",
    "azure.mgmt.loganalytics",
    "azure.mgmt.resource.resources",
)

T = TypeVar("T")


def check_sdk() -> None:
    """Raise a one-line install hint when the Azure SDKs are missing."""
    import importlib.util

    for name in _SDK_MODULES:
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            raise ConfigError(
                f"the aks target needs {name}, which is not installed", hint=AZURE_EXTRA_HINT
            )


def resolve_subscription(
    profile: DeploymentProfile,
    run: Callable[..., subprocess.CompletedProcess[str]] = subprocess.run,
) -> str:
    """azure.subscription_id, else AZURE_SUBSCRIPTION_ID, else `az account show`."""
    if profile.azure.subscription_id:
        return profile.azure.subscription_id
    if os.environ.get("AZURE_SUBSCRIPTION_ID"):
        return os.environ["AZURE_SUBSCRIPTION_ID"]
    hint = "set azure.subscription_id in the profile, or AZURE_SUBSCRIPTION_ID"
    try:
        done = run(
            ["az", "account", "show", "--query", "id", "-o", "tsv"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ConfigError("no Azure subscription given and `az` is not usable", hint=hint) from exc
    if done.returncode != 0 or not done.stdout.strip():
        raise ConfigError(
            "no Azure subscription given and `az account show` names none",
            hint=f"{hint}, or run `az login`",
        )
    return done.stdout.strip()


def os_disk_type(vm_size: str, wanted: str, *, key: str) -> str:
    """Ephemeral only where the size has a temp disk (the `d` sizes); else Managed."""
    from orchard_env.cost.prices import load_price_table

    spec = load_price_table().skus.get(vm_size)
    if spec is not None:
        has_temp_disk = spec.temp_disk_gib > 0
    else:  # Standard_D8ads_v5: the letters after the vCPU count; `d` = a local temp disk
        parts = vm_size.split("_")
        letters = parts[1].lstrip("ABCDEFGHLMNV").lstrip("0123456789-") if len(parts) > 1 else ""
        has_temp_disk = "d" in letters
    if wanted == "Managed":
        return "Managed"
    if wanted == "Ephemeral" and not has_temp_disk:
        raise ConfigError(
            f"{key}: {vm_size} has no temp disk, so it cannot use an Ephemeral OS disk",
            hint="use a size with a 'd' (e.g. Standard_D8ads_v5), or os_disk: Managed",
        )
    return "Ephemeral" if has_temp_disk else "Managed"


@dataclass(frozen=True)
class PoolSpec:
    """What the profile asks of one node pool."""

    name: str
    mode: str
    vm_size: str
    min_count: int
    max_count: int
    spot: bool
    os_disk_type: str
    max_pods: int | None = None
    labels: dict[str, str] = field(default_factory=dict)
    taints: tuple[str, ...] = ()
    pod_max_pids: int | None = None
    workload_runtime: str | None = None

    @property
    def priority(self) -> str:
        return "Spot" if self.spot else "Regular"

    def settings(self) -> dict[str, Any]:
        """The pool's properties as SDK keyword arguments (shared by both pool models)."""
        from azure.mgmt.containerservice import models as m

        values: dict[str, Any] = {
            "mode": self.mode,
            "vm_size": self.vm_size,
            "os_type": "Linux",
            "os_sku": "AzureLinux",
            "count": self.min_count,
            "enable_auto_scaling": True,
            "min_count": self.min_count,
            "max_count": self.max_count,
            "os_disk_type": self.os_disk_type,
        }
        if self.max_pods is not None:
            values["max_pods"] = self.max_pods
        if self.labels:
            values["node_labels"] = dict(self.labels)
        if self.taints:
            values["node_taints"] = list(self.taints)
        if self.pod_max_pids is not None:
            values["kubelet_config"] = m.KubeletConfig(pod_max_pids=self.pod_max_pids)
        if self.workload_runtime is not None:
            values["workload_runtime"] = self.workload_runtime
        if self.spot:
            values.update(
                scale_set_priority="Spot", scale_set_eviction_policy="Delete", spot_max_price=-1
            )
        return values

    def describe(self) -> str:
        kind = "spot" if self.spot else "regular"
        return (
            f"{self.mode} {self.vm_size} x {self.min_count}..{self.max_count} ({kind}, "
            f"{self.os_disk_type} OS disk)"
        )


def system_pool(profile: DeploymentProfile) -> PoolSpec:
    pool = profile.system_pool
    return PoolSpec(
        name=SYSTEM_POOL,
        mode="System",
        vm_size=pool.vm_size,
        min_count=max(1, pool.min_nodes),  # a System pool keeps at least one node
        max_count=pool.max_nodes,
        spot=False,  # AKS refuses a spot System pool
        os_disk_type=os_disk_type(pool.vm_size, "auto", key="system_pool.vm_size"),
    )


def sandbox_pool(profile: DeploymentProfile) -> PoolSpec:
    pool = profile.sandbox_pool
    key, value = SANDBOX_LABEL
    runtime = profile.runtime_class
    return PoolSpec(
        name=SANDBOX_POOL,
        mode="User",
        vm_size=pool.vm_size,
        min_count=pool.min_nodes,
        max_count=pool.max_nodes,
        spot=pool.spot,
        os_disk_type=os_disk_type(pool.vm_size, pool.os_disk, key="sandbox_pool.os_disk"),
        max_pods=pool.max_pods,
        labels={key: value},
        taints=(f"{SANDBOX_TAINT['key']}={SANDBOX_TAINT['value']}:{SANDBOX_TAINT['effect']}",),
        pod_max_pids=profile.limits.pids_limit,
        workload_runtime="KataVmIsolation" if runtime in KATA_RUNTIME_CLASSES else None,
    )


def _text(value: Any) -> str:
    """An SDK enum's value (``NetworkPolicy.CALICO`` -> ``calico``), or the plain string."""
    return str(getattr(value, "value", value))


def _pool_diff(spec: PoolSpec, pool: AgentPool) -> tuple[list[str], list[str]]:
    """(changes made in place, drift that would need a new pool)."""
    updates: list[str] = []
    drift: list[str] = []
    in_place: list[tuple[str, Any, Any]] = [
        ("min_count", pool.min_count, spec.min_count),
        ("max_count", pool.max_count, spec.max_count),
        ("autoscaling", bool(pool.enable_auto_scaling), True),
        ("node_labels", dict(pool.node_labels or {}), spec.labels),
        ("node_taints", sorted(pool.node_taints or []), sorted(spec.taints)),
    ]
    for label, have, want in in_place:
        if have != want:
            updates.append(f"{label}: {have} -> {want}")
    fixed: list[tuple[str, Any, Any]] = [
        ("vm_size", pool.vm_size, spec.vm_size),
        ("priority", pool.scale_set_priority or "Regular", spec.priority),
        ("os_disk_type", pool.os_disk_type, spec.os_disk_type),
        ("max_pods", pool.max_pods, spec.max_pods),
    ]
    for label, have_raw, want in fixed:
        have = _text(have_raw) if have_raw is not None else None
        if want is not None and have is not None and have.lower() != str(want).lower():
            drift.append(f"{label} is {have}, the profile says {want}")
    return updates, drift


@dataclass
class _Found:
    """What the reads found (None: missing)."""

    group: ResourceGroup | None = None
    unregistered: list[str] = field(default_factory=list)
    workspace: Workspace | None = None
    registry: Registry | None = None
    registry_name_free: bool = True
    cluster: ManagedCluster | None = None
    pools: dict[str, AgentPool | None] = field(default_factory=dict)
    acr_pull: bool = False


@dataclass
class AksPlan:
    changes: list[Change]
    warnings: list[str]
    found: _Found


class AksTarget:
    """One AKS deployment described by a profile.

    ``credential``: any azure-core ``TokenCredential`` (default: ``DefaultAzureCredential``).
    ``client_options``: passed to every management client (tests pass ``polling_interval=0``,
    ``retry_total=0``). ``sleep``: how retries wait (tests pass a recorder).
    """

    target = "aks"

    def __init__(
        self,
        profile: DeploymentProfile,
        *,
        credential: TokenCredential | None = None,
        subscription_id: str | None = None,
        client_options: dict[str, Any] | None = None,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        check_sdk()
        logging.getLogger("azure.identity").setLevel(logging.ERROR)
        self.profile = profile
        if credential is None:
            from azure.identity import DefaultAzureCredential

            credential = DefaultAzureCredential()
        self.credential: TokenCredential = credential
        self._subscription_id = subscription_id
        self._options = dict(client_options or {})
        self._sleep = sleep
        self._clock = clock
        self._clients: dict[str, Any] = {}
        self.kubeconfig = kubeconfig_path(profile)
        self.context = profile.kubeconfig.context or profile.cluster_name

    # --- names -----------------------------------------------------------------------------

    @property
    def subscription_id(self) -> str:
        if self._subscription_id is None:
            self._subscription_id = resolve_subscription(self.profile)
        return self._subscription_id

    @property
    def rg(self) -> str:
        return self.profile.resource_group

    @property
    def cluster_name(self) -> str:
        return self.profile.cluster_name

    @property
    def acr_name(self) -> str:
        return self.profile.acr_name

    @property
    def workspace_name(self) -> str:
        return f"{self.profile.name}-logs"

    @property
    def location(self) -> str:
        return self.profile.azure.location

    @property
    def tags(self) -> dict[str, str]:
        return {
            **self.profile.azure.tags,
            CREATED_BY[0]: CREATED_BY[1],
            DEPLOYMENT_TAG: self.profile.name,
        }

    def _ours(self, tags: dict[str, str] | None) -> bool:
        tags = tags or {}
        return (
            tags.get(CREATED_BY[0]) == CREATED_BY[1]
            and tags.get(DEPLOYMENT_TAG) == self.profile.name
        )

    def namespaces(self) -> list[str]:
        names = ["Microsoft.ContainerService", "Microsoft.ContainerRegistry"]
        if self.profile.azure.log_analytics:
            names += ["Microsoft.OperationalInsights", "Microsoft.OperationsManagement"]
        return names

    # --- clients -----------------------------------------------------------------------------

    def _client(self, key: str, factory: Callable[..., T]) -> T:
        if key not in self._clients:
            self._clients[key] = factory(self.credential, self.subscription_id, **self._options)
        client: T = self._clients[key]
        return client

    @property
    def resources(self) -> ResourceManagementClient:
        from azure.mgmt.resource.resources import ResourceManagementClient

        return self._client("resources", ResourceManagementClient)

    @property
    def aks(self) -> ContainerServiceClient:
        from azure.mgmt.containerservice import ContainerServiceClient

        return self._client("aks", ContainerServiceClient)

    @property
    def acr(self) -> ContainerRegistryManagementClient:
        from azure.mgmt.containerregistry import ContainerRegistryManagementClient

        return self._client("acr", ContainerRegistryManagementClient)

    @property
    def logs(self) -> LogAnalyticsManagementClient:
        from azure.mgmt.loganalytics import LogAnalyticsManagementClient

        return self._client("logs", LogAnalyticsManagementClient)

    @property
    def auth(self) -> AuthorizationManagementClient:
        from azure.mgmt.authorization import AuthorizationManagementClient

        return self._client("auth", AuthorizationManagementClient)

    # --- errors ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _errors(self, doing: str) -> Iterator[None]:
        """Azure SDK errors become one-line Orchard errors naming what was being done."""
        from azure.core.exceptions import ClientAuthenticationError, HttpResponseError

        try:
            yield
        except ClientAuthenticationError as exc:
            raise AuthenticationRequired(
                "Azure rejected the credentials", hint=CREDENTIALS_HINT
            ) from exc
        except HttpResponseError as exc:
            code = exc.error.code if exc.error is not None else None
            text = exc.error.message if exc.error is not None else exc.reason
            message = f"{doing}: {code + ': ' if code else ''}{text or exc.status_code}"
            if exc.status_code == 403 or code == "AuthorizationFailed":
                raise PermissionDenied(
                    message,
                    hint="the signed-in identity needs Contributor on the subscription (or the "
                    "resource group); `az account show` names the identity",
                ) from exc
            raise OrchardError(message) from exc

    def check_credentials(self) -> None:
        """Fail fast, in one line, when no credential works."""
        from azure.core.exceptions import ClientAuthenticationError

        try:
            self.credential.get_token(MANAGEMENT_SCOPE)
        except ClientAuthenticationError as exc:
            raise AuthenticationRequired(
                "no usable Azure credentials", hint=CREDENTIALS_HINT
            ) from exc

    def _wait(self, poller: LROPoller[T], what: str, progress: Progress) -> T:
        started = self._clock()
        while not poller.done():
            poller.wait(LRO_REPORT_SECONDS)
            if not poller.done():
                progress(f"{what} ({self._clock() - started:.0f} s)")
        return poller.result()

    # --- reads -------------------------------------------------------------------------------

    def _get(self, doing: str, call: Callable[[], T]) -> T | None:
        from azure.core.exceptions import ResourceNotFoundError

        with self._errors(doing):
            try:
                return call()
            except ResourceNotFoundError:
                return None

    def _read(self) -> _Found:
        found = _Found()
        rg = self.rg
        found.group = self._get(
            f"reading resource group {rg}", lambda: self.resources.resource_groups.get(rg)
        )
        with self._errors("reading resource providers"):
            for namespace in self.namespaces():
                provider = self.resources.providers.get(namespace)
                if (provider.registration_state or "").lower() != "registered":
                    found.unregistered.append(namespace)
        if found.group is None:
            found.registry_name_free = self._acr_name_free()
            return found
        if self.profile.azure.log_analytics:
            found.workspace = self._get(
                f"reading workspace {self.workspace_name}",
                lambda: self.logs.workspaces.get(rg, self.workspace_name),
            )
        found.registry = self._get(
            f"reading registry {self.acr_name}", lambda: self.acr.registries.get(rg, self.acr_name)
        )
        if found.registry is None:
            found.registry_name_free = self._acr_name_free()
        found.cluster = self._get(
            f"reading cluster {self.cluster_name}",
            lambda: self.aks.managed_clusters.get(rg, self.cluster_name),
        )
        if found.cluster is not None:
            for name in (SYSTEM_POOL, SANDBOX_POOL):
                found.pools[name] = self._get(
                    f"reading node pool {name}",
                    functools.partial(self.aks.agent_pools.get, rg, self.cluster_name, name),
                )
            if found.registry is not None:
                found.acr_pull = self._has_acr_pull(found.registry, found.cluster)
        return found

    def _acr_name_free(self) -> bool:
        from azure.mgmt.containerregistry.models import RegistryNameCheckRequest

        with self._errors(f"checking the registry name {self.acr_name}"):
            status = self.acr.registries.check_name_availability(
                RegistryNameCheckRequest(
                    name=self.acr_name, type="Microsoft.ContainerRegistry/registries"
                )
            )
        return bool(status.name_available)

    @staticmethod
    def _kubelet_object_id(cluster: ManagedCluster) -> str:
        identity = (cluster.identity_profile or {}).get("kubeletidentity")
        if identity is None or not identity.object_id:
            raise OrchardError(
                f"cluster {cluster.name} has no kubelet identity",
                hint="Orchard needs a cluster with a managed identity (not a service principal)",
            )
        return str(identity.object_id)

    def _has_acr_pull(self, registry: Registry, cluster: ManagedCluster) -> bool:
        principal = self._kubelet_object_id(cluster)
        with self._errors("reading role assignments on the registry"):
            assignments = self.auth.role_assignments.list_for_scope(
                str(registry.id), filter=f"principalId eq '{principal}'"
            )
            return any(
                str(a.role_definition_id).lower().endswith(ACR_PULL_ROLE) for a in assignments
            )

    # --- plan --------------------------------------------------------------------------------

    def plan(self) -> AksPlan:
        """Read everything (GETs only) and say what :meth:`provision` would do."""
        self.check_credentials()
        system, sandbox = system_pool(self.profile), sandbox_pool(self.profile)
        found = self._read()
        changes: list[Change] = []
        warnings: list[str] = []
        where = f"in {self.location}"
        changes.append(
            Change("keep", "resource group", self.rg)
            if found.group is not None
            else Change("create", "resource group", self.rg, (where,))
        )
        changes += [
            Change("update", "resource provider", ns, ("register",)) for ns in found.unregistered
        ]
        if self.profile.azure.log_analytics:
            changes.append(
                Change("keep", "Log Analytics workspace", self.workspace_name)
                if found.workspace is not None
                else Change(
                    "create",
                    "Log Analytics workspace",
                    self.workspace_name,
                    ("PerGB2018, 30 days retention",),
                )
            )
        if found.registry is not None:
            changes.append(
                Change(
                    "keep", "container registry", self.acr_name, (str(found.registry.login_server),)
                )
            )
        elif not found.registry_name_free:
            raise ConfigError(
                f"the registry name {self.acr_name!r} is taken (ACR names are global)",
                hint="set azure.acr_name in the profile to another 5-50 letters and digits",
            )
        else:
            changes.append(
                Change(
                    "create",
                    "container registry",
                    self.acr_name,
                    (f"Basic, {self.acr_name}.azurecr.io",),
                )
            )
        changes += self._cluster_changes(found, system, sandbox, warnings)
        role = f"AcrPull on {self.acr_name}"
        changes.append(
            Change("keep", "role assignment", role, ("kubelet identity",))
            if found.acr_pull
            else Change("create", "role assignment", role, ("for the cluster's kubelet identity",))
        )
        changes.append(
            Change("update", "kubeconfig context", self.context, (str(self.kubeconfig),))
        )
        runtime = self.profile.runtime_class
        if runtime and runtime not in KATA_RUNTIME_CLASSES:
            warnings.append(
                f"runtime_class {runtime!r}: AKS nodes do not ship it (AKS offers "
                f"{KATA_RUNTIME_CLASSES[0]!r}); install it on the sandbox nodes yourself or "
                "sandbox pods will not start"
            )
        return AksPlan(changes, warnings, found)

    def _cluster_changes(
        self, found: _Found, system: PoolSpec, sandbox: PoolSpec, warnings: list[str]
    ) -> list[Change]:
        cluster = found.cluster
        if cluster is None:
            version = self.profile.azure.kubernetes_version or "AKS default"
            return [
                Change(
                    "create",
                    "AKS cluster",
                    self.cluster_name,
                    (
                        f"Kubernetes {version}, {self.profile.azure.tier} tier, {self.location}",
                        "Azure CNI overlay, Calico network policy",
                        f"pool {SYSTEM_POOL}: {system.describe()}",
                    ),
                ),
                Change(
                    "create",
                    "node pool",
                    SANDBOX_POOL,
                    (sandbox.describe(), f"labels workload=sandbox, taint {sandbox.taints[0]}"),
                ),
            ]
        drift = []
        network = cluster.network_profile
        policy = _text(network.network_policy) if network and network.network_policy else "none"
        if policy.lower() not in ("calico", "cilium", "azure"):
            drift.append(f"network policy is {policy}: sandboxes would not be isolated")
            warnings.append(
                f"cluster {self.cluster_name} enforces no NetworkPolicy (network policy "
                f"{policy}); sandbox isolation would be fake"
            )
        tier = _text(cluster.sku.tier) if cluster.sku and cluster.sku.tier else "Free"
        if tier.lower() != self.profile.azure.tier.lower():
            drift.append(
                f"tier is {tier}, the profile says {self.profile.azure.tier} "
                f"(`az aks update --tier {self.profile.azure.tier.lower()}` changes it)"
            )
        wanted = self.profile.azure.kubernetes_version
        if wanted and cluster.kubernetes_version and cluster.kubernetes_version != wanted:
            drift.append(
                f"Kubernetes {cluster.kubernetes_version}, the profile says {wanted} "
                "(upgrade with `az aks upgrade`)"
            )
        changes = [
            Change("drift" if drift else "keep", "AKS cluster", self.cluster_name, tuple(drift))
        ]
        for spec in (system, sandbox):
            pool = found.pools.get(spec.name)
            if pool is None and spec.mode == "System":
                changes.append(
                    Change(
                        "drift",
                        "node pool",
                        spec.name,
                        (
                            "the cluster has no pool of this name; "
                            "its own System pool is used as it is",
                        ),
                    )
                )
            elif pool is None:
                changes.append(Change("create", "node pool", spec.name, (spec.describe(),)))
            else:
                updates, pool_drift = _pool_diff(spec, pool)
                if pool_drift:
                    changes.append(
                        Change(
                            "drift",
                            "node pool",
                            spec.name,
                            (
                                *pool_drift,
                                "Orchard does not recreate pools: delete it to change this",
                            ),
                        )
                    )
                if updates:
                    changes.append(Change("update", "node pool", spec.name, tuple(updates)))
                elif not pool_drift:
                    changes.append(Change("keep", "node pool", spec.name, (spec.describe(),)))
        return changes

    # --- provision ---------------------------------------------------------------------------

    def provision(self, progress: Progress) -> dict[str, Any]:
        """Create what is missing, update what changed in place; returns the stage's outputs."""
        progress("checking Azure credentials")
        plan = self.plan()
        for change in plan.changes:
            if change.action != "keep":
                detail = f" ({'; '.join(change.details)})" if change.details else ""
                progress(f"{change.action} {change.kind} {change.name}{detail}")
        for warning in plan.warnings:
            progress(f"WARNING: {warning}")
        found = plan.found
        if found.group is None:
            progress(f"creating resource group {self.rg}")
            with self._errors(f"creating resource group {self.rg}"):
                self.resources.resource_groups.create_or_update(
                    self.rg, {"location": self.location, "tags": self.tags}
                )
        for namespace in found.unregistered:
            self._register(namespace, progress)
        workspace_id = self._ensure_workspace(found, progress)
        registry = self._ensure_registry(found, progress)
        cluster = self._ensure_cluster(found, workspace_id, progress)
        self._ensure_pools(found, progress)
        principal = self._kubelet_object_id(cluster)
        if not found.acr_pull:
            self._assign_acr_pull(str(registry.id), principal, progress)
        self._write_credentials(progress)
        return {
            "subscription_id": self.subscription_id,
            "resource_group": self.rg,
            "cluster": self.cluster_name,
            "registry": str(registry.login_server),
            "registry_id": str(registry.id),
            "kubelet_object_id": principal,
            "kubeconfig": str(self.kubeconfig),
            "context": self.context,
            "changes": [
                f"{c.action} {c.kind} {c.name}" for c in plan.changes if c.action != "keep"
            ],
            "warnings": plan.warnings,
        }

    def _register(self, namespace: str, progress: Progress) -> None:
        progress(f"registering resource provider {namespace}")
        deadline = self._clock() + 600
        with self._errors(f"registering {namespace}"):
            self.resources.providers.register(namespace)
            while True:
                state = self.resources.providers.get(namespace).registration_state or ""
                if state.lower() == "registered":
                    return
                if self._clock() > deadline:
                    raise OrchardError(
                        f"resource provider {namespace} is still {state} after 10 minutes",
                        hint="`az provider show -n " + namespace + "` shows it; rerun later",
                    )
                self._sleep(10)

    def _ensure_workspace(self, found: _Found, progress: Progress) -> str | None:
        if not self.profile.azure.log_analytics:
            return None
        if found.workspace is not None:
            return str(found.workspace.id)
        from azure.mgmt.loganalytics import models as lam

        what = f"creating Log Analytics workspace {self.workspace_name}"
        progress(what)
        with self._errors(what):
            poller = self.logs.workspaces.begin_create_or_update(
                self.rg,
                self.workspace_name,
                lam.Workspace(
                    location=self.location,
                    tags=self.tags,
                    properties=lam.WorkspaceProperties(
                        sku=lam.WorkspaceSku(name="PerGB2018"), retention_in_days=30
                    ),
                ),
            )
            return str(self._wait(poller, what, progress).id)

    def _ensure_registry(self, found: _Found, progress: Progress) -> Registry:
        if found.registry is not None:
            return found.registry
        from azure.mgmt.containerregistry import models as acrm

        what = f"creating container registry {self.acr_name}"
        progress(what)
        with self._errors(what):
            poller = self.acr.registries.begin_create(
                self.rg,
                self.acr_name,
                acrm.Registry(
                    location=self.location,
                    tags=self.tags,
                    sku=acrm.Sku(name="Basic"),
                    properties=acrm.RegistryProperties(admin_user_enabled=False),
                ),
            )
            return self._wait(poller, what, progress)

    def _ensure_cluster(
        self, found: _Found, workspace_id: str | None, progress: Progress
    ) -> ManagedCluster:
        if found.cluster is not None:
            return found.cluster
        from azure.mgmt.containerservice import models as m

        system = system_pool(self.profile)
        addons = None
        if workspace_id is not None:
            addons = {
                "omsagent": m.ManagedClusterAddonProfile(
                    enabled=True, config={"logAnalyticsWorkspaceResourceID": workspace_id}
                )
            }
        cluster = m.ManagedCluster(
            location=self.location,
            tags=self.tags,
            identity=m.ManagedClusterIdentity(type="SystemAssigned"),
            sku=m.ManagedClusterSKU(name="Base", tier=self.profile.azure.tier),
            properties=m.ManagedClusterProperties(
                dns_prefix=self.cluster_name,
                kubernetes_version=self.profile.azure.kubernetes_version,
                agent_pool_profiles=[
                    m.ManagedClusterAgentPoolProfile(name=system.name, **system.settings())
                ],
                network_profile=m.ContainerServiceNetworkProfile(
                    network_plugin="azure",
                    network_plugin_mode="overlay",
                    network_policy="calico",
                    load_balancer_sku="standard",
                    outbound_type="loadBalancer",
                ),
                addon_profiles=addons,
            ),
        )
        what = f"creating AKS cluster {self.cluster_name} (typically 5-10 minutes)"
        progress(what)
        with self._errors(f"creating AKS cluster {self.cluster_name}"):
            poller = self.aks.managed_clusters.begin_create_or_update(
                self.rg, self.cluster_name, cluster
            )
            return self._wait(poller, what, progress)

    def _ensure_pools(self, found: _Found, progress: Progress) -> None:
        from azure.mgmt.containerservice import models as m

        for spec in (system_pool(self.profile), sandbox_pool(self.profile)):
            existing = found.pools.get(spec.name)
            if existing is None:
                if spec.mode == "System":
                    continue  # created with the cluster, or the cluster's own System pool
                pool = m.AgentPool(
                    properties=m.AgentPoolManagedClusterAgentPoolProfileProperties(
                        **spec.settings()
                    )
                )
                what = f"creating node pool {spec.name}: {spec.describe()}"
            else:
                updates, _ = _pool_diff(spec, existing)
                if not updates:
                    continue
                pool = existing
                pool.enable_auto_scaling = True
                pool.min_count, pool.max_count = spec.min_count, spec.max_count
                pool.count = min(max(pool.count or 0, spec.min_count), spec.max_count)
                if spec.mode == "User":
                    pool.node_labels = {**(pool.node_labels or {}), **spec.labels}
                    pool.node_taints = list(spec.taints)
                what = f"updating node pool {spec.name}: {'; '.join(updates)}"
            progress(what)
            with self._errors(what):
                poller = self.aks.agent_pools.begin_create_or_update(
                    self.rg, self.cluster_name, spec.name, pool
                )
                self._wait(poller, what, progress)

    def _assign_acr_pull(self, registry_id: str, principal: str, progress: Progress) -> None:
        """AcrPull for the kubelet identity; an existing assignment is success."""
        from azure.core.exceptions import HttpResponseError, ResourceExistsError
        from azure.mgmt.authorization.v2022_04_01.models import RoleAssignmentCreateParameters

        name = str(uuid.uuid5(uuid.NAMESPACE_URL, f"{registry_id}|{principal}|{ACR_PULL_ROLE}"))
        parameters = RoleAssignmentCreateParameters(
            role_definition_id=f"/subscriptions/{self.subscription_id}/providers/"
            f"Microsoft.Authorization/roleDefinitions/{ACR_PULL_ROLE}",
            principal_id=principal,
            principal_type="ServicePrincipal",
        )
        progress(f"granting the cluster AcrPull on {self.acr_name}")
        deadline = self._clock() + ROLE_RETRY_SECONDS
        delay = 5.0
        while True:
            try:
                self.auth.role_assignments.create(registry_id, name, parameters)
                return
            except ResourceExistsError:
                return  # RoleAssignmentExists: someone (or an earlier run) granted it
            except HttpResponseError as exc:
                code = exc.error.code if exc.error is not None else None
                if code == "PrincipalNotFound" and self._clock() < deadline:
                    progress(
                        f"waiting for the kubelet identity to replicate (retry in {delay:.0f} s)"
                    )
                    self._sleep(delay)
                    delay = min(delay * 2, 30.0)
                    continue
                if exc.status_code == 403 or code == "AuthorizationFailed":
                    raise PermissionDenied(
                        f"not allowed to grant AcrPull on {self.acr_name} to the cluster",
                        hint="role assignments need Owner, User Access Administrator or Role "
                        "Based Access Control Administrator; ask one to run `az role assignment "
                        f"create --assignee-object-id {principal} --assignee-principal-type "
                        f"ServicePrincipal --role AcrPull --scope {registry_id}`, then rerun",
                    ) from exc
                with self._errors("granting AcrPull"):
                    raise

    def _write_credentials(self, progress: Progress) -> None:
        progress(f"merging the cluster's credentials into {self.kubeconfig} as {self.context!r}")
        with self._errors(f"fetching the credentials of {self.cluster_name}"):
            result = self.aks.managed_clusters.list_cluster_user_credentials(
                self.rg, self.cluster_name
            )
        kubeconfigs = result.kubeconfigs or []
        if not kubeconfigs or kubeconfigs[0].value is None:
            raise OrchardError(f"AKS returned no kubeconfig for {self.cluster_name}")
        new = yaml.safe_load(bytes(kubeconfigs[0].value))
        merged = merge_kubeconfig(read_kubeconfig(self.kubeconfig), new, name=self.context)
        write_kubeconfig(self.kubeconfig, merged)

    # --- delete ------------------------------------------------------------------------------

    def deletion_plan(self) -> list[Change]:
        """What :meth:`delete` would delete: only what carries this deployment's tags."""
        self.check_credentials()
        rg = self.rg
        group = self._get(
            f"reading resource group {rg}", lambda: self.resources.resource_groups.get(rg)
        )
        if group is None:
            return []
        if self._ours(group.tags):
            return [Change("delete", "resource group", rg, ("and everything in it",))]
        changes = []
        reads: list[tuple[str, str, Callable[[], Any]]] = [
            (
                "AKS cluster",
                self.cluster_name,
                lambda: self.aks.managed_clusters.get(rg, self.cluster_name),
            ),
            (
                "container registry",
                self.acr_name,
                lambda: self.acr.registries.get(rg, self.acr_name),
            ),
        ]
        if self.profile.azure.log_analytics:
            reads.append(
                (
                    "Log Analytics workspace",
                    self.workspace_name,
                    lambda: self.logs.workspaces.get(rg, self.workspace_name),
                )
            )
        for kind, name, read in reads:
            resource = self._get(f"reading {kind} {name}", read)
            if resource is not None and self._ours(resource.tags):
                changes.append(Change("delete", kind, name))
        return changes

    def delete(self, progress: Progress, changes: list[Change] | None = None) -> list[Change]:
        """Delete what :meth:`deletion_plan` lists; what is already gone is skipped quietly."""
        from azure.core.exceptions import ResourceNotFoundError

        changes = self.deletion_plan() if changes is None else changes
        rg = self.rg
        for change in changes:
            what = f"deleting {change.kind} {change.name}"
            progress(what)
            begin: Callable[[], LROPoller[None]]
            if change.kind == "resource group":

                def begin() -> LROPoller[None]:
                    return self.resources.resource_groups.begin_delete(rg)
            elif change.kind == "AKS cluster":

                def begin() -> LROPoller[None]:
                    return self.aks.managed_clusters.begin_delete(rg, self.cluster_name)
            elif change.kind == "container registry":

                def begin() -> LROPoller[None]:
                    return self.acr.registries.begin_delete(rg, self.acr_name)
            else:

                def begin() -> LROPoller[None]:
                    return self.logs.workspaces.begin_delete(rg, self.workspace_name)

            with self._errors(what), contextlib.suppress(ResourceNotFoundError):
                self._wait(begin(), what, progress)
        self.remove_credentials()
        return changes

    def remove_credentials(self) -> None:
        if self.kubeconfig.exists():
            config = read_kubeconfig(self.kubeconfig)
            write_kubeconfig(self.kubeconfig, remove_kubeconfig_context(config, self.context))
