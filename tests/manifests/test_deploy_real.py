"""`orchard deploy` / `orchard undeploy` against the real local control plane (kube_real tier):
the real API server's server-side apply and validation, its Pod Security admission on the
namespaces' labels, its RBAC authorizer on the Role and ClusterRole the deploy installs, and
the real namespace controller finalizing `undeploy`."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client as k8s
from kubernetes import config as k8s_config

from manifests import BOOTSTRAP_SECRET
from manifests.deploy import deploy, undeploy
from provision.profile import DeploymentProfile, parse_profile
from tests.kube_local import LocalCluster, unique_name
from tests.orchestrator.backends.kube_real import deployment_node

pytestmark = pytest.mark.kube_real
REFS = {
    "orchestrator": "registry.example/orchard/orchestrator:0.1.0-abc1234",
    "agent-injector": "registry.example/orchard/agent-injector:0.1.0-abc1234",
}
BUSYBOX = "registry.example/busybox:1"


@dataclass
class Deployment:
    local: LocalCluster
    profile: DeploymentProfile
    namespace: str
    sandbox_namespace: str

    def deploy(self) -> Any:
        return deploy(self.profile, REFS, kubeconfig=self.local.kubeconfig, interval=0.2)

    def undeploy(self) -> list[str]:
        return undeploy(self.profile, kubeconfig=self.local.kubeconfig, interval=0.2)


@pytest.fixture
def deployment(local_cluster: LocalCluster) -> Iterator[Deployment]:
    namespace = unique_name("orchard")
    sandboxes = f"{namespace}-sb"
    profile = parse_profile(
        {
            "target": "kubeconfig",
            "service": {"namespace": namespace, "sandbox_namespace": sandboxes},
        },
        source="test",
    )
    with deployment_node(local_cluster, namespace, sandboxes, run_agents=False):
        try:
            yield Deployment(local_cluster, profile, namespace, sandboxes)
        finally:
            undeploy(profile, kubeconfig=local_cluster.kubeconfig, interval=0.2)


def _pod(name: str, **container: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {"containers": [{"name": "main", "image": BUSYBOX, **container}]},
    }


def _refusal(call: Any, *args: Any) -> k8s.ApiException:
    with pytest.raises(k8s.ApiException) as raised:
        call(*args)
    return raised.value


def _message(refused: k8s.ApiException) -> str:
    message: str = json.loads(refused.body)["message"]
    return message


def test_deploy_applies_waits_for_the_rollout_and_a_second_deploy_changes_nothing(
    deployment: Deployment,
) -> None:
    first = deployment.deploy()
    assert first.key_created
    actions = {str(applied).rsplit(" ", 1)[0]: applied.action for applied in first.applied}
    # The ServiceAccount controller makes every new namespace's "default", usually before the
    # apply reaches it ("configured"); on a busy machine the apply may come first.
    default_account = f"serviceaccount/default -n {deployment.sandbox_namespace}"
    assert actions.pop(default_account) in ("configured", "created")
    assert set(actions.values()) == {"created"}
    with deployment.local.admin() as api:
        core = k8s.CoreV1Api(api)
        secret = core.read_namespaced_secret(BOOTSTRAP_SECRET, deployment.namespace)
        assert base64.b64decode(secret.data["api-key"]).decode() == first.api_key
        # The orchestrator's pod was admitted under the restricted profile and scheduled.
        pods = core.list_namespaced_pod(deployment.namespace).items
        assert [pod.spec.node_name for pod in pods] == ["orchard-test-node"]
        labels = core.read_namespace(deployment.sandbox_namespace).metadata.labels
        assert labels["pod-security.kubernetes.io/enforce"] == "baseline"
    second = deployment.deploy()
    assert not second.key_created
    assert second.api_key == first.api_key
    # A real API server's no-op server-side apply: nothing changed, no new resourceVersion.
    assert {applied.action for applied in second.applied} == {"unchanged"}


def test_undeploy_waits_for_the_namespaces_to_be_finalized(deployment: Deployment) -> None:
    deployment.deploy()
    deleted = deployment.undeploy()
    assert set(deleted) >= {deployment.namespace, deployment.sandbox_namespace}
    with deployment.local.admin() as api:
        core = k8s.CoreV1Api(api)
        for namespace in deleted:
            assert _refusal(core.read_namespace, namespace).status == 404
        roles = k8s.RbacAuthorizationV1Api(api).list_cluster_role(
            label_selector=f"app.kubernetes.io/instance={deployment.profile.name}"
        )
        assert not [r for r in roles.items if deployment.namespace in r.metadata.name]
    assert deployment.undeploy() == []  # quiet when already gone


def test_pod_security_admission_enforces_the_namespaces_profiles(deployment: Deployment) -> None:
    deployment.deploy()
    with deployment.local.admin() as api:
        core = k8s.CoreV1Api(api)
        privileged = _pod("privileged", securityContext={"privileged": True})
        refused = _refusal(core.create_namespaced_pod, deployment.sandbox_namespace, privileged)
        assert refused.status == 403
        assert 'violates PodSecurity "baseline:latest": privileged' in _message(refused)
        # Root without a seccomp profile passes baseline (sandboxes run any image) ...
        core.create_namespaced_pod(deployment.sandbox_namespace, _pod("plain"))
        # ... but not the orchestrator namespace's restricted profile.
        refused = _refusal(core.create_namespaced_pod, deployment.namespace, _pod("plain"))
        assert refused.status == 403
        assert 'violates PodSecurity "restricted:latest"' in _message(refused)


def test_the_orchestrators_service_account_can_do_what_it_needs_and_no_more(
    deployment: Deployment, tmp_path: Path
) -> None:
    deployment.deploy()
    config = deployment.local.service_account_kubeconfig(
        tmp_path / "orchestrator", deployment.namespace, "orchard-orchestrator"
    )
    sandboxes = deployment.sandbox_namespace
    with k8s_config.new_client_from_config(str(config)) as api:
        core = k8s.CoreV1Api(api)
        core.create_namespaced_pod(sandboxes, _pod("sb-1"))
        assert core.read_namespaced_pod("sb-1", sandboxes).metadata.name == "sb-1"
        assert [p.metadata.name for p in core.list_namespaced_pod(sandboxes).items] == ["sb-1"]
        core.create_namespaced_secret(
            sandboxes, {"metadata": {"name": "orchard-agent-sb-1"}, "stringData": {"t": "x"}}
        )
        core.list_node()  # GET /resources reports node capacity
        refusals = {
            "list secrets": (core.list_namespaced_secret, sandboxes),
            "patch pods": (core.patch_namespaced_pod, "sb-1", sandboxes, {"metadata": {}}),
            "pods in another namespace": (core.create_namespaced_pod, "default", _pod("x")),
            "namespaces": (core.create_namespace, {"metadata": {"name": unique_name("x")}}),
            "nodes": (core.patch_node, "orchard-test-node", {"metadata": {}}),
            "clusterrolebindings": (
                k8s.RbacAuthorizationV1Api(api).create_cluster_role_binding,
                {
                    "metadata": {"name": unique_name("escalate")},
                    "roleRef": {
                        "apiGroup": "rbac.authorization.k8s.io",
                        "kind": "ClusterRole",
                        "name": "cluster-admin",
                    },
                    "subjects": [
                        {
                            "kind": "ServiceAccount",
                            "name": "orchard-orchestrator",
                            "namespace": deployment.namespace,
                        }
                    ],
                },
            ),
        }
        for what, (call, *args) in refusals.items():
            assert _refusal(call, *args).status == 403, what
        # pods/exec: the orchestrator never goes through the exec API (the agent does exec).
        with pytest.raises(k8s.ApiException) as raised:
            core.connect_post_namespaced_pod_exec("sb-1", sandboxes, command=["id"], stdout=True)
        assert raised.value.status == 403
        assert 'cannot create resource "pods/exec"' in _message(raised.value)
        core.delete_namespaced_pod("sb-1", sandboxes, grace_period_seconds=0)
