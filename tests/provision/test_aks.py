"""The AKS target against a fake Resource Manager at the HTTP layer (the real Azure SDKs)."""

from __future__ import annotations

import stat
from pathlib import Path
from typing import Any

import pytest
import responses
import yaml

from orchard_env.errors import AuthenticationRequired, ConfigError, OrchardError, PermissionDenied
from provision.aks import (
    ACR_PULL_ROLE,
    CREDENTIALS_HINT,
    AksTarget,
    os_disk_type,
    resolve_subscription,
)
from provision.base import Change
from provision.profile import DeploymentProfile, parse_profile
from tests.provision.arm_fake import (
    CLIENT_OPTIONS,
    KUBELET_OBJECT_ID,
    SUBSCRIPTION,
    FakeArm,
    FakeCredential,
    NoCredential,
)

RG = f"/subscriptions/{SUBSCRIPTION}/resourceGroups/demo-rg"
CLUSTER = f"{RG}/providers/Microsoft.ContainerService/managedClusters/demo-aks"
REGISTRY = f"{RG}/providers/Microsoft.ContainerRegistry/registries/demoacr"
WORKSPACE = f"{RG}/providers/Microsoft.OperationalInsights/workspaces/demo-logs"


def profile(**overrides: Any) -> DeploymentProfile:
    data: dict[str, Any] = {
        "name": "demo",
        "target": "aks",
        "azure": {"subscription_id": SUBSCRIPTION, "log_analytics": True},
        "sandbox_pool": {"vm_size": "Standard_D8ads_v5", "max_nodes": 4},
    }
    for key, value in overrides.items():
        data[key] = {**data.get(key, {}), **value} if isinstance(value, dict) else value
    return parse_profile(data, source="test")


class Recorder:
    def __init__(self) -> None:
        self.sleeps: list[float] = []
        self.messages: list[str] = []

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)

    def progress(self, message: str) -> None:
        self.messages.append(message)


def target(p: DeploymentProfile, recorder: Recorder | None = None, **kwargs: Any) -> AksTarget:
    recorder = recorder or Recorder()
    return AksTarget(
        p,
        credential=kwargs.pop("credential", FakeCredential()),
        client_options=CLIENT_OPTIONS,
        sleep=recorder.sleep,
        **kwargs,
    )


def body_of(arm: FakeArm, path: str) -> Any:
    (sent,) = [r for r in arm.sent("PUT") if r.path.lower() == path.lower()]
    return sent.body


def test_the_create_path_puts_every_resource_and_polls_each_operation(arm: FakeArm) -> None:
    recorder = Recorder()
    outputs = target(profile(), recorder).provision(recorder.progress)

    role_path = f"{REGISTRY}/providers/Microsoft.Authorization/roleAssignments/"
    writes = [w.replace(role_path, "ROLE/") for w in arm.writes()]
    assert writes == [
        f"PUT /subscriptions/{SUBSCRIPTION}/resourcegroups/demo-rg",
        f"PUT {WORKSPACE}",
        f"PUT {REGISTRY}",
        f"PUT {CLUSTER}",
        f"PUT {CLUSTER}/agentPools/sandbox",
        f"PUT ROLE/{writes[-1].rsplit('/', 1)[1]}",
    ]
    # Four long-running operations, each polled to Succeeded ("InProgress", then "Succeeded")
    # and followed by a GET of the resource.
    assert list(arm.operation_polls.values()) == [2, 2, 2, 2]
    gets = [r.path for r in arm.sent("GET")]
    for path in (WORKSPACE, REGISTRY, CLUSTER, f"{CLUSTER}/agentPools/sandbox"):
        assert gets.count(path) == 1, path  # the final GET of its LRO (reads before were 404s)

    cluster = body_of(arm, CLUSTER)
    assert cluster["identity"] == {"type": "SystemAssigned"}
    assert cluster["sku"] == {"name": "Base", "tier": "Free"}
    assert cluster["tags"] == {"created-by": "orchard", "orchard-deployment": "demo"}
    properties = cluster["properties"]
    assert properties["networkProfile"] == {
        "networkPlugin": "azure",
        "networkPluginMode": "overlay",
        "networkPolicy": "calico",
        "loadBalancerSku": "standard",
        "outboundType": "loadBalancer",
    }
    assert properties["agentPoolProfiles"] == [
        {
            "name": "system",
            "mode": "System",
            "vmSize": "Standard_D4as_v5",
            "osType": "Linux",
            "osSKU": "AzureLinux",
            "count": 1,
            "enableAutoScaling": True,
            "minCount": 1,
            "maxCount": 3,
            "osDiskType": "Managed",  # D4as_v5 has no temp disk
        }
    ]
    assert properties["addonProfiles"]["omsagent"]["config"] == {
        "logAnalyticsWorkspaceResourceID": WORKSPACE
    }
    assert body_of(arm, f"{CLUSTER}/agentPools/sandbox") == {
        "properties": {
            "mode": "User",
            "vmSize": "Standard_D8ads_v5",
            "osType": "Linux",
            "osSKU": "AzureLinux",
            "count": 0,
            "enableAutoScaling": True,
            "minCount": 0,
            "maxCount": 4,
            "osDiskType": "Ephemeral",  # D8ads_v5 has a temp disk
            "maxPods": 30,
            "nodeLabels": {"workload": "sandbox"},
            "nodeTaints": ["workload=sandbox:NoSchedule"],
            "kubeletConfig": {"podMaxPids": 4096},
            "scaleSetPriority": "Spot",
            "scaleSetEvictionPolicy": "Delete",
            "spotMaxPrice": -1,
        }
    }
    (role,) = [r for r in arm.sent("PUT") if "roleAssignments" in r.path]
    assert role.body == {
        "properties": {
            "roleDefinitionId": f"/subscriptions/{SUBSCRIPTION}/providers/"
            f"Microsoft.Authorization/roleDefinitions/{ACR_PULL_ROLE}",
            "principalId": KUBELET_OBJECT_ID,
            "principalType": "ServicePrincipal",
        }
    }
    assert outputs["registry"] == "demoacr.azurecr.io"
    assert outputs["context"] == "demo-aks"
    assert outputs["kubelet_object_id"] == KUBELET_OBJECT_ID
    assert "creating AKS cluster demo-aks (typically 5-10 minutes)" in recorder.messages


def test_regular_pools_and_managed_disks_as_the_profile_says(arm: FakeArm) -> None:
    p = profile(
        sandbox_pool={"vm_size": "Standard_D16as_v5", "spot": False, "min_nodes": 1},
        azure={"log_analytics": False, "tier": "Standard"},
    )
    target(p).provision(lambda _m: None)
    pool = body_of(arm, f"{CLUSTER}/agentPools/sandbox")["properties"]
    assert "scaleSetPriority" not in pool and "spotMaxPrice" not in pool
    assert (pool["osDiskType"], pool["minCount"], pool["count"]) == ("Managed", 1, 1)
    assert body_of(arm, CLUSTER)["sku"]["tier"] == "Standard"
    assert "addonProfiles" not in body_of(arm, CLUSTER)["properties"]
    assert not [r for r in arm.requests if "OperationalInsights" in r.path]


def test_a_rerun_when_everything_exists_writes_nothing(arm: FakeArm) -> None:
    target(profile()).provision(lambda _m: None)
    arm.requests.clear()
    recorder = Recorder()
    outputs = target(profile(), recorder).provision(recorder.progress)
    assert arm.writes() == []
    assert outputs["changes"] == ["update kubeconfig context demo-aks"]  # fresh credentials
    plan = target(profile()).plan()
    assert {c.action for c in plan.changes} == {"keep", "update"}


def test_changed_bounds_update_the_pool_and_other_changes_are_drift(arm: FakeArm) -> None:
    target(profile()).provision(lambda _m: None)
    arm.requests.clear()
    changed = profile(sandbox_pool={"max_nodes": 8, "vm_size": "Standard_D16ads_v5"})
    plan = target(changed).plan()
    pool_changes = [c for c in plan.changes if c.kind == "node pool" and c.name == "sandbox"]
    assert pool_changes == [
        Change(
            "drift",
            "node pool",
            "sandbox",
            (
                "vm_size is Standard_D8ads_v5, the profile says Standard_D16ads_v5",
                "Orchard does not recreate pools: delete it to change this",
            ),
        ),
        Change("update", "node pool", "sandbox", ("max_count: 4 -> 8",)),
    ]
    assert arm.writes() == []  # the plan only reads
    target(changed).provision(lambda _m: None)
    assert arm.writes() == [f"PUT {CLUSTER}/agentPools/sandbox"]
    sent = body_of(arm, f"{CLUSTER}/agentPools/sandbox")["properties"]
    assert (sent["maxCount"], sent["vmSize"]) == (8, "Standard_D8ads_v5")  # never recreated


def test_the_plan_only_reads(arm: FakeArm) -> None:
    plan = target(profile()).plan()
    assert {r.method for r in arm.requests} <= {"GET", "POST"}
    assert [r.path for r in arm.sent("POST")] == [
        f"/subscriptions/{SUBSCRIPTION}/providers/Microsoft.ContainerRegistry/checkNameAvailability"
    ]
    assert [(c.action, c.kind, c.name) for c in plan.changes] == [
        ("create", "resource group", "demo-rg"),
        ("create", "Log Analytics workspace", "demo-logs"),
        ("create", "container registry", "demoacr"),
        ("create", "AKS cluster", "demo-aks"),
        ("create", "node pool", "sandbox"),
        ("create", "role assignment", "AcrPull on demoacr"),
        ("update", "kubeconfig context", "demo-aks"),
    ]


def test_a_taken_registry_name_names_the_profile_key(arm: FakeArm) -> None:
    arm.taken_registry_names.add("demoacr")
    with pytest.raises(ConfigError) as caught:
        target(profile()).plan()
    assert caught.value.message == "the registry name 'demoacr' is taken (ACR names are global)"
    assert caught.value.hint is not None and "azure.acr_name" in caught.value.hint


def test_unregistered_providers_are_registered_and_waited_for(arm: FakeArm) -> None:
    arm.providers["Microsoft.ContainerService"] = "NotRegistered"
    recorder = Recorder()
    target(profile(), recorder).provision(recorder.progress)
    register = f"/subscriptions/{SUBSCRIPTION}/providers/Microsoft.ContainerService/register"
    assert f"POST {register}" in arm.writes()
    assert recorder.sleeps == [10]  # "Registering" once, then "Registered"
    assert arm.providers["Microsoft.ContainerService"] == "Registered"


def test_an_existing_role_assignment_is_success(arm: FakeArm) -> None:
    arm.role_failures.append((409, "RoleAssignmentExists"))
    outputs = target(profile()).provision(lambda _m: None)
    assert outputs["kubelet_object_id"] == KUBELET_OBJECT_ID
    assert not arm.role_assignments  # the 409 stood for an assignment made elsewhere


def test_principal_not_found_is_retried_through_replication_lag(arm: FakeArm) -> None:
    arm.role_failures += [(400, "PrincipalNotFound"), (400, "PrincipalNotFound")]
    recorder = Recorder()
    target(profile(), recorder).provision(recorder.progress)
    assert recorder.sleeps == [5, 10]  # backoff, no real sleeping
    assert len(arm.role_assignments) == 1
    assert sum("waiting for the kubelet identity" in m for m in recorder.messages) == 2


def test_principal_not_found_gives_up_after_the_deadline(arm: FakeArm) -> None:
    arm.role_failures += [(400, "PrincipalNotFound")] * 50
    now = [0.0]

    def clock() -> float:
        return now[0]

    recorder = Recorder()

    def sleep(seconds: float) -> None:
        recorder.sleeps.append(seconds)
        now[0] += seconds

    aks = AksTarget(
        profile(),
        credential=FakeCredential(),
        client_options=CLIENT_OPTIONS,
        sleep=sleep,
        clock=clock,
    )
    with pytest.raises(OrchardError) as caught:
        aks.provision(lambda _m: None)
    assert caught.value.message.startswith("granting AcrPull: PrincipalNotFound: ")
    assert sum(recorder.sleeps) >= 180 and max(recorder.sleeps) == 30


def test_missing_permission_for_role_assignments_gets_a_hint(arm: FakeArm) -> None:
    arm.role_failures.append((403, "AuthorizationFailed"))
    with pytest.raises(PermissionDenied) as caught:
        target(profile()).provision(lambda _m: None)
    assert caught.value.message == "not allowed to grant AcrPull on demoacr to the cluster"
    hint = caught.value.hint or ""
    assert "Owner, User Access Administrator or Role Based Access Control Administrator" in hint
    assert f"--assignee-object-id {KUBELET_OBJECT_ID}" in hint


def test_no_credentials_is_one_line_with_a_hint_and_no_request(arm: FakeArm) -> None:
    with pytest.raises(AuthenticationRequired) as caught:
        target(profile(), credential=NoCredential()).plan()
    assert caught.value.message == "no usable Azure credentials"
    assert caught.value.hint == CREDENTIALS_HINT
    assert "az login" in CREDENTIALS_HINT and "AZURE_CLIENT_SECRET" in CREDENTIALS_HINT
    assert arm.requests == []


def test_a_forbidden_read_says_what_was_being_done() -> None:
    def forbidden(request: Any) -> tuple[int, dict[str, str], str]:
        return 403, {}, '{"error": {"code": "AuthorizationFailed", "message": "no read"}}'

    with responses.RequestsMock() as mock:
        group = f"https://management.azure.com/subscriptions/{SUBSCRIPTION}/resourcegroups/demo-rg"
        mock.add_callback(responses.GET, group, forbidden)
        with pytest.raises(PermissionDenied) as caught:
            target(profile()).plan()
    assert caught.value.message == "reading resource group demo-rg: AuthorizationFailed: no read"
    assert caught.value.hint is not None and "Contributor" in caught.value.hint


def test_the_kubeconfig_is_merged_as_a_named_context_with_mode_0600(
    arm: FakeArm, tmp_path: Path
) -> None:
    path = tmp_path / "kube" / "config"
    path.parent.mkdir()
    other = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "kind", "cluster": {"server": "https://127.0.0.1:6443"}}],
        "users": [{"name": "kind", "user": {"token": "t"}}],
        "contexts": [{"name": "kind", "context": {"cluster": "kind", "user": "kind"}}],
        "current-context": "kind",
    }
    path.write_text(yaml.safe_dump(other))
    target(profile()).provision(lambda _m: None)
    merged = yaml.safe_load(path.read_text())
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [c["name"] for c in merged["contexts"]] == ["kind", "demo-aks"]
    assert merged["current-context"] == "demo-aks"
    (cluster,) = [c for c in merged["clusters"] if c["name"] == "demo-aks"]
    assert cluster["cluster"]["server"] == "https://demo-aks-dns.hcp.eastus.azmk8s.io:443"


def test_delete_removes_the_resource_group_it_created(arm: FakeArm, tmp_path: Path) -> None:
    target(profile()).provision(lambda _m: None)
    arm.requests.clear()
    aks = target(profile())
    changes = aks.deletion_plan()
    assert changes == [Change("delete", "resource group", "demo-rg", ("and everything in it",))]
    recorder = Recorder()
    aks.delete(recorder.progress, changes)
    assert arm.writes() == [f"DELETE /subscriptions/{SUBSCRIPTION}/resourcegroups/demo-rg"]
    assert arm.resources == {}
    assert list(arm.operation_polls.values())[-1] == 2
    merged = yaml.safe_load((tmp_path / "kube" / "config").read_text())
    assert merged["contexts"] == [] and merged["current-context"] == ""
    assert target(profile()).deletion_plan() == []  # gone: nothing more to do


def test_delete_in_a_group_it_did_not_create_removes_only_its_own_resources(
    arm: FakeArm,
) -> None:
    group = f"/subscriptions/{SUBSCRIPTION}/resourcegroups/demo-rg"
    arm.add(group, {"location": "eastus", "tags": {"team": "ml"}})
    target(profile()).provision(lambda _m: None)
    arm.add(f"{RG}/providers/Microsoft.Storage/storageAccounts/theirs", {"location": "eastus"})
    arm.requests.clear()
    changes = target(profile()).deletion_plan()
    assert [(c.kind, c.name) for c in changes] == [
        ("AKS cluster", "demo-aks"),
        ("container registry", "demoacr"),
        ("Log Analytics workspace", "demo-logs"),
    ]
    target(profile()).delete(lambda _m: None, changes)
    assert arm.writes() == [f"DELETE {CLUSTER}", f"DELETE {REGISTRY}", f"DELETE {WORKSPACE}"]
    assert arm.get(group) is not None
    assert arm.get(f"{RG}/providers/Microsoft.Storage/storageAccounts/theirs") is not None


def test_an_existing_cluster_without_calico_is_drift_and_a_warning(arm: FakeArm) -> None:
    arm.add(f"/subscriptions/{SUBSCRIPTION}/resourcegroups/demo-rg", {"location": "eastus"})
    arm.add(
        CLUSTER,
        {
            "location": "eastus",
            "sku": {"name": "Base", "tier": "Free"},
            "properties": {
                "networkProfile": {"networkPlugin": "kubenet"},
                "agentPoolProfiles": [{"name": "nodepool1", "mode": "System"}],
            },
        },
    )
    plan = target(profile()).plan()
    (cluster,) = [c for c in plan.changes if c.kind == "AKS cluster"]
    assert cluster.action == "drift"
    assert cluster.details == ("network policy is none: sandboxes would not be isolated",)
    assert any("isolation would be fake" in w for w in plan.warnings)
    (system,) = [c for c in plan.changes if c.name == "system"]
    assert system.action == "drift"


@pytest.mark.parametrize(
    ("size", "wanted", "expected"),
    [
        ("Standard_D8ads_v5", "auto", "Ephemeral"),
        ("Standard_D8as_v5", "auto", "Managed"),
        ("Standard_D8ads_v5", "Managed", "Managed"),
        ("Standard_E16ads_v6", "auto", "Ephemeral"),  # not in the price table: by its name
        ("Standard_E16as_v6", "auto", "Managed"),
    ],
)
def test_os_disk_is_ephemeral_only_where_the_size_has_a_temp_disk(
    size: str, wanted: str, expected: str
) -> None:
    assert os_disk_type(size, wanted, key="sandbox_pool.os_disk") == expected


def test_an_ephemeral_disk_on_a_size_without_temp_disk_names_the_key() -> None:
    with pytest.raises(ConfigError) as caught:
        os_disk_type("Standard_D8as_v5", "Ephemeral", key="sandbox_pool.os_disk")
    assert caught.value.message == (
        "sandbox_pool.os_disk: Standard_D8as_v5 has no temp disk, so it cannot use an "
        "Ephemeral OS disk"
    )


def test_the_subscription_comes_from_the_profile_the_environment_or_az(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import subprocess

    def az(args: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        assert args[:3] == ["az", "account", "show"]
        return subprocess.CompletedProcess(args, 0, stdout="from-az\n", stderr="")

    assert resolve_subscription(profile(), run=az) == SUBSCRIPTION
    unset = profile(azure={"subscription_id": None})
    assert resolve_subscription(unset, run=az) == "from-az"
    monkeypatch.setenv("AZURE_SUBSCRIPTION_ID", "from-env")
    assert resolve_subscription(unset, run=az) == "from-env"
    monkeypatch.delenv("AZURE_SUBSCRIPTION_ID")

    def no_az(args: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        raise FileNotFoundError("az")

    with pytest.raises(ConfigError) as caught:
        resolve_subscription(unset, run=no_az)
    assert caught.value.message == "no Azure subscription given and `az` is not usable"
