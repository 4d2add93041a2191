"""`orchard deploy` / `orchard undeploy` logic against a fake Kubernetes API over real HTTP,
driven by the real `kubernetes` client."""

from __future__ import annotations

import base64
import socket
from pathlib import Path

import pytest

from manifests import BOOTSTRAP_SECRET, MASKED
from manifests.apply import KubeApi, apply
from manifests.deploy import connect, deploy, dry_run, new_api_key, undeploy
from manifests.render import DeployValues, render
from orchard_env.errors import BackendUnavailable, ConfigError, PermissionDenied, Timeout
from orchard_env.orchestrator.keys import KEY_RE
from provision.profile import DeploymentProfile, parse_profile
from tests.manifests.kube_fake import FakeKube

REFS = {
    "orchestrator": "registry.example/orchard/orchestrator:0.1.0-abc1234",
    "agent-injector": "registry.example/orchard/agent-injector:0.1.0-abc1234",
    "sandbox": "registry.example/orchard/sandbox:0.1.0-abc1234",
}
SECRET_PATH = f"/api/v1/namespaces/orchard/secrets/{BOOTSTRAP_SECRET}"
DEPLOYMENT_PATH = "/apis/apps/v1/namespaces/orchard/deployments/orchard-orchestrator"


def _profile(**service: object) -> DeploymentProfile:
    return parse_profile({"target": "kubeconfig", "service": service}, source="test")


def _stored_key(kube: FakeKube) -> str:
    secret = kube.get(SECRET_PATH)
    assert secret is not None
    return base64.b64decode(secret["data"]["api-key"]).decode()


def test_deploy_applies_everything_waits_and_returns_the_key(
    kube: FakeKube, kubeconfig: Path
) -> None:
    messages: list[str] = []
    result = deploy(
        _profile(), REFS, kubeconfig=kubeconfig, progress=messages.append, interval=0.01
    )
    assert result.key_created
    assert result.api_key is not None and KEY_RE.match(result.api_key)
    assert _stored_key(kube) == result.api_key
    assert result.endpoint == "http://127.0.0.1:8000"
    assert result.port_forward == (
        f"kubectl -n orchard port-forward svc/orchard 8000:80 --kubeconfig {kubeconfig}"
    )
    assert {applied.action for applied in result.applied} == {"created"}
    assert len(result.applied) == len(render(DeployValues("o", "a")))
    # Every apply is a server-side apply by the field manager "orchard", forced.
    patches = [r for r in kube.requests if r.method == "PATCH"]
    assert len(patches) == len(result.applied)
    for request in patches:
        assert request.content_type == "application/apply-patch+yaml"
        assert request.query["fieldManager"] == "orchard"
        assert request.query["force"] == "true"
        assert "dryRun" not in request.query
    assert messages[0] == f"connected to {kube.url}"
    assert "namespace/orchard created" in messages
    assert "deployment.apps/orchard-orchestrator -n orchard created" in messages
    assert "deployment orchard-orchestrator: 0/1 updated, 0 available" in messages
    # The key is never in a progress message.
    assert not any(result.api_key in message for message in messages)


def test_a_second_deploy_changes_nothing_and_keeps_the_key(
    kube: FakeKube, kubeconfig: Path
) -> None:
    first = deploy(_profile(), REFS, kubeconfig=kubeconfig, interval=0.01)
    versions = {path: obj["metadata"]["resourceVersion"] for path, obj in kube.objects.items()}
    second = deploy(_profile(), REFS, kubeconfig=kubeconfig, interval=0.01)
    assert not second.key_created
    assert second.api_key == first.api_key
    assert {applied.action for applied in second.applied} == {"unchanged"}
    assert {path: obj["metadata"]["resourceVersion"] for path, obj in kube.objects.items()} == (
        versions
    )


def test_a_new_image_configures_the_deployment_only(kube: FakeKube, kubeconfig: Path) -> None:
    deploy(_profile(), REFS, kubeconfig=kubeconfig, interval=0.01)
    newer = {**REFS, "orchestrator": "registry.example/orchard/orchestrator:0.2.0-def5678"}
    result = deploy(_profile(), newer, kubeconfig=kubeconfig, interval=0.01)
    changed = [str(applied) for applied in result.applied if applied.action != "unchanged"]
    assert changed == ["deployment.apps/orchard-orchestrator -n orchard configured"]
    deployment = kube.get(DEPLOYMENT_PATH)
    assert deployment is not None
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == newer["orchestrator"]


def test_a_masked_or_broken_secret_gets_a_real_key(kube: FakeKube, kubeconfig: Path) -> None:
    """`kubectl apply` of `orchard deploy --render` stores the mask; a deploy replaces it."""
    client = connect(kubeconfig)
    try:
        masked = render(DeployValues(REFS["orchestrator"], REFS["agent-injector"]))
        apply(masked, api_client=client)
    finally:
        client.close()
    assert _stored_key(kube) == MASKED
    result = deploy(_profile(), REFS, kubeconfig=kubeconfig, interval=0.01)
    assert result.key_created
    assert result.api_key is not None and KEY_RE.match(result.api_key)
    assert _stored_key(kube) == result.api_key


def test_load_balancer_endpoint(kube: FakeKube, kubeconfig: Path) -> None:
    profile = _profile(load_balancer=True, load_balancer_source_ranges=["198.51.100.0/24"])
    messages: list[str] = []
    result = deploy(profile, REFS, kubeconfig=kubeconfig, progress=messages.append, interval=0.01)
    assert result.endpoint == "http://203.0.113.10"
    assert result.port_forward is None
    assert "service orchard-public: waiting for a load balancer address" in messages
    public = kube.get("/api/v1/namespaces/orchard/services/orchard-public")
    assert public is not None
    assert public["spec"]["loadBalancerSourceRanges"] == ["198.51.100.0/24"]


def test_dry_run_stores_nothing_and_says_what_would_change(
    kube: FakeKube, kubeconfig: Path
) -> None:
    planned = dry_run(_profile(), REFS, kubeconfig=kubeconfig)
    assert kube.objects == {}
    assert [str(applied) for applied in planned[:4]] == [
        "namespace/orchard created",
        "namespace/orchard-sandboxes created",
        "clusterrole.rbac.authorization.k8s.io/orchard-nodes-orchard created",
        "clusterrolebinding.rbac.authorization.k8s.io/orchard-nodes-orchard created",
    ]
    assert {applied.action for applied in planned[4:]} == {"unchecked"}
    assert str(planned[4]) == (
        "serviceaccount/orchard-orchestrator -n orchard would be created "
        "(its namespace does not exist yet)"
    )
    assert all(r.query.get("dryRun") == "All" for r in kube.requests if r.method == "PATCH")

    deploy(_profile(), REFS, kubeconfig=kubeconfig, interval=0.01)
    before = dict(kube.objects)
    planned = dry_run(_profile(), REFS, kubeconfig=kubeconfig)
    assert {applied.action for applied in planned} == {"unchanged"}  # the key is kept
    newer = {**REFS, "agent-injector": "registry.example/orchard/agent-injector:0.2.0"}
    planned = dry_run(_profile(), newer, kubeconfig=kubeconfig)
    assert [str(a) for a in planned if a.action != "unchanged"] == [
        "configmap/orchard-config -n orchard configured",
        "deployment.apps/orchard-orchestrator -n orchard configured",
    ]
    assert kube.objects == before


def test_namespaces_orchard_did_not_create_are_refused(kube: FakeKube, kubeconfig: Path) -> None:
    kube.objects["/api/v1/namespaces/orchard"] = {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {"name": "orchard", "labels": {"team": "ml"}},
    }
    expected = "namespace orchard exists and was not created by orchard deploy"
    with pytest.raises(ConfigError) as caught:
        deploy(_profile(), REFS, kubeconfig=kubeconfig)
    assert caught.value.message == expected
    with pytest.raises(ConfigError) as caught:
        undeploy(_profile(), kubeconfig=kubeconfig)
    assert caught.value.message == expected
    assert [r.method for r in kube.requests if r.method != "GET"] == []


def test_another_deployments_namespace_is_refused(kube: FakeKube, kubeconfig: Path) -> None:
    other = parse_profile(
        {"name": "team-a", "target": "kubeconfig", "service": {"sandbox_namespace": "a-sbx"}},
        source="test",
    )
    deploy(other, REFS, kubeconfig=kubeconfig, interval=0.01)
    with pytest.raises(ConfigError) as caught:
        deploy(_profile(), REFS, kubeconfig=kubeconfig, interval=0.01)
    assert caught.value.message == (
        "namespace orchard belongs to the Orchard deployment 'team-a', not 'orchard'"
    )


def test_a_rollout_that_does_not_finish_says_why(kube: FakeKube, kubeconfig: Path) -> None:
    kube.rollout_polls = 10**6
    kube.objects["/api/v1/namespaces/orchard/pods/orchard-orchestrator-abc"] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "orchard-orchestrator-abc",
            "namespace": "orchard",
            "labels": {"app.kubernetes.io/name": "orchard-orchestrator"},
        },
        "status": {
            "containerStatuses": [
                {
                    "name": "orchestrator",
                    "ready": False,
                    "state": {
                        "waiting": {
                            "reason": "ImagePullBackOff",
                            "message": 'Back-off pulling image "registry.example/x"',
                        }
                    },
                }
            ]
        },
    }
    with pytest.raises(Timeout) as caught:
        deploy(_profile(), REFS, kubeconfig=kubeconfig, timeout=0.05, interval=0.01)
    assert caught.value.message == (
        "deployment orchard-orchestrator in orchard did not become ready in 0 s: "
        "deployment orchard-orchestrator: 0/1 updated, 0 available; "
        "pod orchard-orchestrator-abc: orchestrator ImagePullBackOff: "
        'Back-off pulling image "registry.example/x"'
    )
    assert caught.value.hint == (
        "`kubectl -n orchard describe pods -l app.kubernetes.io/name=orchard-orchestrator` "
        "shows more"
    )


def test_forbidden_is_a_clear_permission_error(kube: FakeKube, kubeconfig: Path) -> None:
    kube.forbidden.add(
        "/apis/rbac.authorization.k8s.io/v1/namespaces/orchard-sandboxes/roles/orchard-orchestrator"
    )
    with pytest.raises(PermissionDenied) as caught:
        deploy(_profile(), REFS, kubeconfig=kubeconfig, interval=0.01)
    assert caught.value.message.startswith("the cluster forbids it (GET /apis/rbac")
    assert "cluster-admin" in (caught.value.hint or "")


def test_wrong_credentials_and_no_cluster(kube: FakeKube, tmp_path: Path) -> None:
    bad = kube.kubeconfig(tmp_path / "bad", token="wrong")
    with pytest.raises(PermissionDenied, match=r"^the cluster refused the credentials"):
        deploy(_profile(), REFS, kubeconfig=bad)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    kube.url = f"http://127.0.0.1:{port}"  # nothing listens there
    gone = kube.kubeconfig(tmp_path / "gone")
    with pytest.raises(BackendUnavailable) as caught:
        deploy(_profile(), REFS, kubeconfig=gone)
    assert caught.value.message.startswith(f"cannot reach the Kubernetes API at {kube.url}")


def test_missing_kubeconfig_and_context(tmp_path: Path, kubeconfig: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        connect(tmp_path / "absent")
    assert caught.value.message == f"kubeconfig {tmp_path / 'absent'} does not exist"
    with pytest.raises(ConfigError) as caught:
        connect(kubeconfig, context="nope")
    assert caught.value.message == (
        f"cannot use kubeconfig {kubeconfig}: Invalid kube-config file. "
        f"Expected object with name nope in {kubeconfig}/contexts list"
    )


def test_undeploy_deletes_sandboxes_first_and_is_quiet_when_gone(
    kube: FakeKube, kubeconfig: Path
) -> None:
    deploy(_profile(), REFS, kubeconfig=kubeconfig, interval=0.01)
    kube.delete_polls = 2
    messages: list[str] = []
    deleted = undeploy(_profile(), kubeconfig=kubeconfig, progress=messages.append, interval=0.01)
    assert deleted == ["orchard-sandboxes", "orchard"]
    deletes = [r.path for r in kube.requests if r.method == "DELETE"]
    assert deletes == [
        "/api/v1/namespaces/orchard-sandboxes",
        "/api/v1/namespaces/orchard",
        "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings/orchard-nodes-orchard",
        "/apis/rbac.authorization.k8s.io/v1/clusterroles/orchard-nodes-orchard",
    ]
    assert "waiting for orchard-sandboxes, orchard to be deleted" in messages
    assert kube.objects == {}
    assert undeploy(_profile(), kubeconfig=kubeconfig, interval=0.01) == []


def test_generated_keys_are_orchestrator_keys() -> None:
    keys = {new_api_key() for _ in range(20)}
    assert len(keys) == 20
    assert all(KEY_RE.match(key) for key in keys)


def test_kube_api_refuses_a_client_without_param_serialize() -> None:
    class Old:
        pass

    with pytest.raises(ConfigError, match="is too old for Orchard"):
        KubeApi(Old())
