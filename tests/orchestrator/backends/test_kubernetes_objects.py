"""What the Kubernetes backend sends: every pod, Secret and NetworkPolicy validated against
the official schemas of each supported Kubernetes version, their content, and how pod
statuses are read."""

from __future__ import annotations

import base64
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import kubernetes_validate
import pytest

import manifests
from orchard_env.agent.bundle import BUNDLE_MOUNT, launch_argv, launch_env
from orchard_env.config import ServiceSettings
from orchard_env.orchestrator.backends.base import SANDBOX_CAPABILITIES, SandboxSpec, SandboxState
from orchard_env.orchestrator.backends.kube_objects import (
    dependent_names,
    egress_policy,
    pod_manifest,
    token_secret,
)
from orchard_env.orchestrator.backends.kube_status import PodView, view_pod
from orchard_env.orchestrator.backends.kubernetes import KubernetesBackend
from tests.orchestrator.backends.conftest import AGENT_IMAGE, NAMESPACE, Cluster
from tests.orchestrator.backends.kube_fake import KINDS, TOKEN, fake_cluster
from tests.orchestrator.backends.test_kubernetes import make_spec

SUPPORTED = manifests.SUPPORTED_KUBERNETES_VERSIONS
VARIANTS = {
    "blocked": {},
    "network": {"block_network": False},
    "everything": {
        "block_network": False,
        "cpu": 0.25,
        "memory_bytes": 512 * 1024**2,
        "env": {"LANG": "C.UTF-8", "ORCHARD_AGENT_TOKEN": "ignored"},
        "labels": {"team": "rl", "run.id": "r-1_2"},
        "owner": "0123456789",
        "workdir": "/home/user/work",
    },
    "no-record": {"record_annotation": None, "owner": None},
}


def test_the_installed_schemas_cover_every_supported_version() -> None:
    shipped = kubernetes_validate.utils.all_versions()
    oldest = tuple(int(part) for part in shipped[0].split(".")[:2])
    for version in SUPPORTED:
        assert tuple(int(part) for part in version.split(".")) >= oldest
        assert (
            kubernetes_validate.utils.major_minor(version) <= kubernetes_validate.latest_version()
        )


async def test_every_object_sent_is_valid_for_every_supported_version(tmp_path: Path) -> None:
    """Through the backend and the real client, as the API server receives them: the fake
    API server validates each object strictly against every supported version's schema and
    answers 422 Invalid otherwise."""
    with fake_cluster(tmp_path, validate_versions=SUPPORTED) as (api, kubelet, kubeconfig):
        cluster = Cluster(api, kubelet, kubeconfig)
        for name, changes in VARIANTS.items():
            runtime_class = "gvisor" if name == "everything" else None
            kube = KubernetesBackend(cluster.settings(tmp_path, runtime_class=runtime_class))
            try:
                await kube.create(make_spec(name, **changes))
            finally:
                await kube.close()
        created = {r.path.rsplit("/", 1)[-1] for r in api.requests if r.method == "POST"}
        assert created == {"pods", "secrets", "networkpolicies"}
        assert cluster.names("pods") == sorted(VARIANTS)
        assert len(cluster.names("networkpolicies")) == 2


@pytest.mark.parametrize("version", SUPPORTED)
def test_objects_with_ipv6_exceptions_are_valid(
    version: str, kube_settings: ServiceSettings
) -> None:
    settings = replace(kube_settings, egress_except=("10.0.0.0/8", "fd00::/8"))
    spec = make_spec(block_network=False)
    pod = {**pod_manifest(settings, spec), "metadata": {"name": "sb-one", "uid": "u-1"}}
    policy = egress_policy(settings, spec, pod)
    kubernetes_validate.validate(policy, version, strict=True)
    blocks = policy["spec"]["egress"][0]["to"]
    assert blocks == [
        {"ipBlock": {"cidr": "0.0.0.0/0", "except": ["10.0.0.0/8"]}},
        {"ipBlock": {"cidr": "::/0", "except": ["fd00::/8"]}},
    ]


def sent_pod(settings: ServiceSettings, spec: SandboxSpec) -> dict[str, Any]:
    return pod_manifest(settings, spec)


def test_the_pod_spec(kube_settings: ServiceSettings) -> None:
    settings = replace(kube_settings, runtime_class="kata", reap_interval_seconds=15)
    spec = make_spec(**VARIANTS["everything"])
    pod = sent_pod(settings, spec)
    metadata, pod_spec = pod["metadata"], pod["spec"]
    assert metadata["name"] == "sb-one" and metadata["namespace"] == NAMESPACE
    assert metadata["labels"] == {
        "app.kubernetes.io/managed-by": "orchard",
        "orchard.instance": "test",
        "orchard.sandbox-id": "sb-one",
        "orchard.owner": "0123456789",
        "orchard.network": "open",
        "orchard.label/team": "rl",
        "orchard.label/run.id": "r-1_2",
    }
    assert metadata["annotations"] == {
        "orchard.record": spec.record_annotation,
        "orchard.agent-secret": dependent_names(spec)[0],  # the key's, for the orchestrator
    }
    # The labels the deployment's NetworkPolicies and RBAC notes match.
    assert manifests.SANDBOX_MANAGED_BY in metadata["labels"].items()
    assert manifests.NETWORK_LABEL in metadata["labels"].items()
    assert metadata["labels"][manifests.SANDBOX_ID_LABEL] == "sb-one"

    assert pod_spec["restartPolicy"] == "Never"
    assert pod_spec["automountServiceAccountToken"] is False
    assert pod_spec["enableServiceLinks"] is False
    assert pod_spec["activeDeadlineSeconds"] == 600 + 60  # TTL + a margin for the reaper
    assert pod_spec["runtimeClassName"] == "kata"
    assert pod_spec["securityContext"] == {"seccompProfile": {"type": "RuntimeDefault"}}
    assert pod_spec["nodeSelector"] == {"workload": "sandbox", "kubernetes.io/arch": "amd64"}
    assert pod_spec["tolerations"] == [
        {"key": "workload", "operator": "Equal", "value": "sandbox", "effect": "NoSchedule"},
        {
            "key": "kubernetes.azure.com/scalesetpriority",
            "operator": "Equal",
            "value": "spot",
            "effect": "NoSchedule",
        },
    ]
    assert pod_spec["volumes"] == [{"name": "orchard-agent", "emptyDir": {"sizeLimit": "512Mi"}}]

    (init,) = pod_spec["initContainers"]
    assert (init["image"], init["args"]) == (AGENT_IMAGE, [BUNDLE_MOUNT])
    assert init["volumeMounts"] == [{"name": "orchard-agent", "mountPath": BUNDLE_MOUNT}]
    assert init["resources"] == {
        "requests": {"cpu": "250m", "memory": str(256 * 1024**2)},
        "limits": {"cpu": "250m", "memory": str(256 * 1024**2)},
    }
    assert init["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert init["securityContext"]["runAsNonRoot"] is True

    (main,) = pod_spec["containers"]
    assert main["image"] == spec.image
    assert main["command"] == launch_argv(BUNDLE_MOUNT, f"tcp:0.0.0.0:{settings.agent_port}")
    assert main["args"] == []
    assert main["workingDir"] == "/home/user/work"
    # Neither the key nor the sandbox's env (LANG here) is in the pod: the agent gets both
    # when the orchestrator enrolls it.
    assert [e["name"] for e in main["env"]] == [*launch_env(BUNDLE_MOUNT), "ORCHARD_AGENT_WORKDIR"]
    assert main["volumeMounts"] == [
        {"name": "orchard-agent", "mountPath": BUNDLE_MOUNT, "readOnly": True}
    ]
    assert main["resources"] == {
        "requests": {
            "cpu": "250m",
            "memory": str(512 * 1024**2),
            "ephemeral-storage": str(1024**3),
        },
        "limits": {
            "cpu": "250m",
            "memory": str(512 * 1024**2),
            "ephemeral-storage": str(settings.ephemeral_storage),
        },
    }
    assert main["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"], "add": list(SANDBOX_CAPABILITIES)},
    }
    assert main["readinessProbe"]["tcpSocket"] == {"port": settings.agent_port}
    assert main["ports"] == [{"name": "agent", "containerPort": settings.agent_port}]


def test_without_ttl_or_runtime_class_the_pod_has_neither(kube_settings: ServiceSettings) -> None:
    spec = make_spec(ttl_seconds=None)
    pod_spec = sent_pod(kube_settings, spec)["spec"]
    assert "activeDeadlineSeconds" not in pod_spec
    assert "runtimeClassName" not in pod_spec
    # An owner that cannot be a label value stays off the labels (it is in the record).
    labels = sent_pod(kube_settings, make_spec(owner="a b"))["metadata"]["labels"]
    assert "orchard.owner" not in labels


@pytest.mark.parametrize("policy", [None, "Always", "Never"])
def test_the_sandbox_image_pull_policy_is_stated(
    kube_settings: ServiceSettings, policy: str | None
) -> None:
    """IfNotPresent unless set, for :latest too (Kubernetes' default would be Always)."""
    settings = kube_settings if policy is None else replace(kube_settings, image_pull_policy=policy)
    main = sent_pod(settings, make_spec(image="r.example/img:latest"))["spec"]["containers"][0]
    assert main["imagePullPolicy"] == (policy or "IfNotPresent")


@pytest.mark.parametrize(
    ("disk", "request_bytes"), [(256 * 1024**2, 256 * 1024**2), (5 * 1024**3, 1024**3)]
)
def test_a_sandbox_disk_is_its_ephemeral_storage_limit(
    kube_settings: ServiceSettings, disk: int, request_bytes: int
) -> None:
    container = sent_pod(kube_settings, make_spec(disk_bytes=disk))["spec"]["containers"][0]
    assert container["resources"]["limits"]["ephemeral-storage"] == str(disk)
    assert container["resources"]["requests"]["ephemeral-storage"] == str(request_bytes)


def test_the_secret_and_the_policy(kube_settings: ServiceSettings) -> None:
    spec = make_spec(block_network=False)
    pod = {**sent_pod(kube_settings, spec)}
    pod["metadata"] = {**pod["metadata"], "uid": "u-1"}
    owner = [{"apiVersion": "v1", "kind": "Pod", "name": "sb-one", "uid": "u-1"}]
    secret = token_secret(kube_settings, spec, pod)
    assert secret["metadata"]["name"] == dependent_names(spec)[0]
    assert secret["metadata"]["ownerReferences"] == owner
    assert secret["immutable"] is True
    assert base64.b64decode(secret["data"]["token"]).decode() == spec.agent_token
    policy = egress_policy(kube_settings, spec, pod)
    assert policy["metadata"]["name"] == dependent_names(spec)[1]
    assert policy["metadata"]["ownerReferences"] == owner
    assert policy["spec"]["policyTypes"] == ["Egress"]
    internet, dns = policy["spec"]["egress"]
    assert internet == {
        "to": [{"ipBlock": {"cidr": "0.0.0.0/0", "except": list(kube_settings.egress_except)}}]
    }
    assert dns["ports"] == [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]
    assert KINDS["networkpolicies"] == (policy["apiVersion"], policy["kind"])


# --- reading pod statuses ------------------------------------------------------------------------


def pod_with(status: dict[str, Any], **metadata: Any) -> dict[str, Any]:
    return {
        "metadata": {
            "name": "sb-one",
            "annotations": {"orchard.agent-secret": "orchard-agent-sb-one-abc"},
            **metadata,
        },
        "spec": {"containers": [{"name": "sandbox", "env": []}]},
        "status": status,
    }


def waiting(name: str, reason: str, message: str = "") -> dict[str, Any]:
    return {"name": name, "state": {"waiting": {"reason": reason, "message": message}}}


def terminated(name: str, code: int, reason: str, message: str | None = None) -> dict[str, Any]:
    state: dict[str, Any] = {"exitCode": code, "reason": reason}
    if message is not None:
        state["message"] = message
    return {"name": name, "state": {"terminated": state}}


RUNNING = {"name": "sandbox", "state": {"running": {"startedAt": "2026-01-01T00:00:00Z"}}}
UNSCHEDULABLE = {
    "type": "PodScheduled",
    "status": "False",
    "reason": "Unschedulable",
    "message": "0/3 nodes are available: 3 node(s) didn't match Pod's node affinity/selector.",
}
STATUSES: list[tuple[str, dict[str, Any], PodView]] = [
    ("new", {}, PodView(SandboxState.CREATING)),
    ("pending", {"phase": "Pending"}, PodView(SandboxState.CREATING)),
    (
        "unschedulable",
        {"phase": "Pending", "conditions": [UNSCHEDULABLE]},
        PodView(SandboxState.UNSCHEDULABLE, UNSCHEDULABLE["message"]),
    ),
    (
        "pulling the sandbox image failed",
        {"phase": "Pending", "containerStatuses": [waiting("sandbox", "ImagePullBackOff", "x")]},
        PodView(
            SandboxState.FAILED,
            "container sandbox: ImagePullBackOff: x",
            pull_failure=("sandbox", "ImagePullBackOff", "x"),
        ),
    ),
    (
        "an invalid image name",
        {"phase": "Pending", "containerStatuses": [waiting("sandbox", "InvalidImageName")]},
        PodView(
            SandboxState.FAILED,
            "container sandbox: InvalidImageName",
            pull_failure=("sandbox", "InvalidImageName", ""),
        ),
    ),
    (
        "pulling the agent image failed",
        {
            "phase": "Pending",
            "initContainerStatuses": [waiting("agent-injector", "ErrImagePull", "not found")],
        },
        PodView(
            SandboxState.FAILED,
            "container agent-injector: ErrImagePull: not found",
            pull_failure=("agent-injector", "ErrImagePull", "not found"),
        ),
    ),
    (
        "the runtime could not make the container (the kubelet retries)",
        {
            "phase": "Pending",
            "containerStatuses": [waiting("sandbox", "CreateContainerError", "name in use")],
        },
        PodView(SandboxState.CREATING),
    ),
    (
        "another configuration error",
        {
            "phase": "Pending",
            "containerStatuses": [
                waiting("sandbox", "CreateContainerConfigError", "couldn't find key token")
            ],
        },
        PodView(SandboxState.FAILED, "CreateContainerConfigError: couldn't find key token"),
    ),
    (
        "the injector failed",
        {
            "phase": "Failed",
            "initContainerStatuses": [terminated("agent-injector", 2, "Error", "usage")],
        },
        PodView(SandboxState.FAILED, "the agent injector failed: Error (exit code 2): usage"),
    ),
    (
        "running",
        {"phase": "Running", "containerStatuses": [RUNNING]},
        PodView(SandboxState.RUNNING),
    ),
    (
        "the node stopped reporting",
        {"phase": "Unknown"},
        PodView(SandboxState.RUNNING, "its pod's node does not report the pod's state"),
    ),
    (
        "out of memory",
        {"phase": "Failed", "containerStatuses": [terminated("sandbox", 137, "OOMKilled")]},
        PodView(SandboxState.EXITED, "OOMKilled", 137),
    ),
    (
        "past its deadline",
        {
            "phase": "Failed",
            "reason": "DeadlineExceeded",
            "message": "Pod was active on the node longer than the specified deadline",
            "containerStatuses": [terminated("sandbox", 137, "Error")],
        },
        PodView(
            SandboxState.EXITED,
            "DeadlineExceeded: Pod was active on the node longer than the specified deadline; "
            "Error",
            137,
        ),
    ),
    (
        "evicted before it ran",
        {
            "phase": "Failed",
            "reason": "Evicted",
            "message": "The node was low on resource: ephemeral-storage.",
        },
        PodView(SandboxState.FAILED, "Evicted: The node was low on resource: ephemeral-storage."),
    ),
]


@pytest.mark.parametrize(
    ("status", "expected"), [(s, e) for _, s, e in STATUSES], ids=[n for n, _, _ in STATUSES]
)
def test_pod_statuses_read_as_sandbox_states(status: dict[str, Any], expected: PodView) -> None:
    assert view_pod(pod_with(status)) == expected


def test_a_pod_being_deleted_has_exited() -> None:
    pod = pod_with({"phase": "Running", "containerStatuses": [RUNNING]}, deletionTimestamp="x")
    assert view_pod(pod) == PodView(SandboxState.EXITED, "its pod is being deleted")


def test_long_kubelet_messages_are_clipped() -> None:
    status = {
        "phase": "Pending",
        "containerStatuses": [waiting("sandbox", "ErrImagePull", "x" * 5000)],
    }
    reason = view_pod(pod_with(status)).reason
    assert reason is not None and len(reason) < 700 and reason.endswith("...")


def test_the_fake_api_server_refuses_what_a_real_one_would(cluster: Cluster) -> None:
    """The checks the tests above rely on do bite (straight HTTP, past the client's models)."""
    url = f"{cluster.api.url}/api/v1/namespaces/{NAMESPACE}/pods"
    headers = {"Authorization": f"Bearer {TOKEN}"}
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "p", "labels": {"ok": "yes"}},
        "spec": {"containers": [{"name": "c", "image": "i", "bogus": True}]},
    }
    response = httpx.post(url, json=pod, headers=headers)
    assert response.status_code == 422
    assert "Additional properties are not allowed ('bogus' was unexpected)" in response.text
    del pod["spec"]["containers"][0]["bogus"]
    pod["metadata"]["labels"] = {"bad key!": "x"}
    response = httpx.post(url, json=pod, headers=headers)
    assert response.status_code == 422 and "invalid label key" in response.text
    assert httpx.post(url, json=pod).status_code == 401
    secrets_list = url.replace("/pods", "/secrets")
    assert httpx.get(secrets_list, headers=headers).status_code == 403  # no list on secrets
    assert cluster.names("pods") == []
