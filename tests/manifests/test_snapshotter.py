"""The node snapshotter objects a `snapshots: true` profile adds: valid for every supported
Kubernetes version, only the privileges the snapshotter needs, reachable from the
orchestrator only, and the orchestrator's settings pointing at them."""

from __future__ import annotations

import base64
from dataclasses import replace
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from manifests import MASKED, SNAPSHOTTER_PORT, SUPPORTED_KUBERNETES_VERSIONS
from manifests.deploy import deploy, undeploy
from manifests.render import DeployValues, KubeObject, render, values_from_profile
from orchard_env.config import SERVICE_SETTINGS
from orchard_env.errors import ConfigError
from orchard_env.snapshotter.server import SnapshotterSettings
from provision.profile import parse_profile
from tests.manifests.kube_fake import FakeKube
from tests.manifests.test_deploy import REFS

TOKEN = "t" * 43
PROFILE = {
    "name": "lab",
    "target": "aks",
    "snapshots": True,
    "registry": {"server": "labacr.azurecr.io", "repository": "orchard"},
    "service": {"namespace": "lab", "sandbox_namespace": "lab-sandboxes"},
}
REPOSITORY = "labacr.azurecr.io/orchard/snapshots"


def _values(**changes: Any) -> DeployValues:
    return values_from_profile(parse_profile({**PROFILE, **changes}, source="test"), REFS)


def _by(objects: list[KubeObject], kind: str, name: str, namespace: str) -> KubeObject:
    found = [
        o
        for o in objects
        if o["kind"] == kind
        and o["metadata"]["name"] == name
        and o["metadata"].get("namespace", namespace) == namespace
    ]
    assert len(found) == 1, f"{kind}/{name} in {namespace}: {len(found)} found"
    return found[0]


@pytest.mark.parametrize("version", SUPPORTED_KUBERNETES_VERSIONS)
def test_every_object_is_valid_for_every_supported_version(version: str) -> None:
    for obj in render(_values()):
        kubernetes_validate.validate(obj, f"{version}.0", strict=True)


def test_without_snapshots_nothing_of_it_is_rendered() -> None:
    objects = render(_values(snapshots=False))
    assert not [o for o in objects if "snapshotter" in o["metadata"]["name"]]
    config = _by(objects, "ConfigMap", "orchard-config", "lab")["data"]
    assert "ORCHARD_REGISTRY" not in config
    assert "ORCHARD_SNAPSHOTTER_TOKEN_FILE" not in config


def test_snapshots_need_a_registry() -> None:
    with pytest.raises(ConfigError, match="needs the registry"):
        _values(registry={})


def test_the_daemonset_has_exactly_the_privileges_it_needs() -> None:
    objects = render(_values())
    namespace = _by(objects, "Namespace", "lab-snapshotter", "lab-snapshotter")
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"
    daemonset = _by(objects, "DaemonSet", "orchard-snapshotter", "lab-snapshotter")
    pod = daemonset["spec"]["template"]["spec"]
    assert pod["hostPID"] is True
    assert "hostNetwork" not in pod and "hostIPC" not in pod
    assert pod["automountServiceAccountToken"] is False
    assert pod["nodeSelector"] == {"workload": "sandbox"}
    assert {t["key"] for t in pod["tolerations"]} == {
        "workload",
        "kubernetes.azure.com/scalesetpriority",
    }
    (container,) = pod["containers"]
    assert container["image"] == REFS["orchestrator"]
    assert container["command"] == ["python", "-m", "orchard_env.snapshotter"]
    assert container["securityContext"] == {
        "runAsUser": 0,
        "runAsGroup": 0,
        "runAsNonRoot": False,
        "privileged": False,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"], "add": ["DAC_READ_SEARCH", "SYS_ADMIN"]},
    }
    host_paths = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    assert host_paths == {"containerd": "/var/lib/containerd", "cgroup": "/sys/fs/cgroup"}
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert mounts["containerd"] == {
        "name": "containerd",
        "mountPath": "/var/lib/containerd",  # the same path: mountinfo names upperdirs by it
        "readOnly": True,
    }
    assert mounts["cgroup"]["mountPath"] == "/sys/fs/cgroup"


def test_the_snapshotter_starts_from_what_the_daemonset_gives_it(tmp_path: Path) -> None:
    """The DaemonSet's environment is what the snapshotter's settings read (paths moved
    under tmp_path: the token and credentials files as the Secrets mount them)."""
    objects = render(_values(snapshots=True))
    pod = _by(objects, "DaemonSet", "orchard-snapshotter", "lab-snapshotter")["spec"]
    container = pod["template"]["spec"]["containers"][0]
    env = {v["name"]: v["value"] for v in container["env"]}
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    for key in ("ORCHARD_SNAPSHOTTER_TOKEN_FILE", "ORCHARD_REGISTRY_CONFIG"):
        assert str(Path(env[key]).parent) in mounts
        moved = tmp_path / Path(env[key]).name
        moved.write_text(TOKEN if key.endswith("TOKEN_FILE") else '{"auths": {}}')
        env[key] = str(moved)
    settings = SnapshotterSettings.from_env(env)
    assert settings.port == SNAPSHOTTER_PORT
    assert settings.target_prefix == f"{REPOSITORY}:"
    assert container["ports"][0]["containerPort"] == SNAPSHOTTER_PORT


def test_only_the_orchestrator_reaches_the_snapshotters() -> None:
    objects = render(_values())
    policy = _by(objects, "NetworkPolicy", "orchard-snapshotter-ingress", "lab-snapshotter")
    assert policy["spec"]["podSelector"] == {}
    assert policy["spec"]["ingress"] == [
        {
            "from": [
                {
                    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "lab"}},
                    "podSelector": {
                        "matchLabels": {"app.kubernetes.io/name": "orchard-orchestrator"}
                    },
                }
            ],
            "ports": [{"port": SNAPSHOTTER_PORT, "protocol": "TCP"}],
        }
    ]


def test_the_orchestrator_may_list_the_snapshotter_pods_and_nothing_more() -> None:
    objects = render(_values())
    role = _by(objects, "Role", "orchard-orchestrator", "lab-snapshotter")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list"]}]
    binding = _by(objects, "RoleBinding", "orchard-orchestrator", "lab-snapshotter")
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "orchard-orchestrator", "namespace": "lab"}
    ]
    # The sandbox namespace's binding still names the service namespace too.
    sandboxes = _by(objects, "RoleBinding", "orchard-orchestrator", "lab-sandboxes")
    assert sandboxes["subjects"][0]["namespace"] == "lab"


def test_the_orchestrators_settings_and_mounts_point_at_the_snapshotters() -> None:
    values = _values()
    objects = render(values)
    config = _by(objects, "ConfigMap", "orchard-config", "lab")["data"]
    parsed = {s.key: s.parse(config[s.env]) for s in SERVICE_SETTINGS if s.env in config}
    assert parsed["registry"] == REPOSITORY
    assert parsed["snapshotter_namespace"] == "lab-snapshotter"
    assert parsed["snapshotter_port"] == SNAPSHOTTER_PORT
    pod = _by(objects, "Deployment", "orchard-orchestrator", "lab")["spec"]["template"]["spec"]
    volumes = {v["name"]: v["secret"] for v in pod["volumes"] if "secret" in v}
    mounts = {m["mountPath"]: m["name"] for m in pod["containers"][0]["volumeMounts"]}
    token_dir = str(parsed["snapshotter_token_file"].parent)
    assert volumes[mounts[token_dir]]["secretName"] == "orchard-snapshotter-token"
    registry_dir = str(parsed["registry_config"].parent)
    assert volumes[mounts[registry_dir]] == {
        "secretName": "orchard-registry",
        "defaultMode": 0o440,
        "optional": True,
    }


def test_the_token_is_masked_until_the_deploy_makes_it() -> None:
    masked = render(_values())
    for namespace in ("lab", "lab-snapshotter"):
        secret = _by(masked, "Secret", "orchard-snapshotter-token", namespace)
        assert secret["stringData"] == {"token": MASKED}
    with_token = render(replace(_values(), snapshotter_token=TOKEN))
    for namespace in ("lab", "lab-snapshotter"):
        secret = _by(with_token, "Secret", "orchard-snapshotter-token", namespace)
        assert base64.b64decode(secret["data"]["token"]).decode() == TOKEN


def _stored_token(kube: FakeKube, namespace: str) -> str:
    secret = kube.get(f"/api/v1/namespaces/{namespace}/secrets/orchard-snapshotter-token")
    assert secret is not None
    return base64.b64decode(secret["data"]["token"]).decode()


def test_deploy_makes_one_token_keeps_it_and_undeploy_removes_the_namespace(
    kube: FakeKube, kubeconfig: Path
) -> None:
    profile = parse_profile({**PROFILE, "target": "kubeconfig"}, source="test")
    deploy(profile, REFS, kubeconfig=kubeconfig, interval=0.01)
    token = _stored_token(kube, "lab")
    assert len(token) >= 32
    assert _stored_token(kube, "lab-snapshotter") == token
    assert kube.get("/apis/apps/v1/namespaces/lab-snapshotter/daemonsets/orchard-snapshotter")
    second = deploy(profile, REFS, kubeconfig=kubeconfig, interval=0.01)
    assert {applied.action for applied in second.applied} == {"unchanged"}
    assert _stored_token(kube, "lab-snapshotter") == token
    deleted = undeploy(profile, kubeconfig=kubeconfig, interval=0.01)
    assert deleted == ["lab-sandboxes", "lab", "lab-snapshotter"]
    assert kube.objects == {}


def test_a_local_registry_a_moved_containerd_and_tainted_nodes() -> None:
    """A registry without TLS, a containerd root elsewhere (k3s, the local cluster) and a
    further taint on the sandbox nodes reach the snapshotter and the orchestrator."""
    values = _values(
        target="kubeconfig",
        registry={"server": "10.200.0.2:5000", "plain_http": True},
        snapshotter={
            "containerd_root": "/var/lib/rancher/k3s/agent/containerd",
            "tolerations": [{"key": "lab.example/gpu", "operator": "Exists"}],
        },
    )
    objects = render(values)
    pod = _by(objects, "DaemonSet", "orchard-snapshotter", "lab-snapshotter")["spec"]["template"]
    container = pod["spec"]["containers"][0]
    env = {v["name"]: v["value"] for v in container["env"]}
    assert env["ORCHARD_SNAPSHOTTER_PLAIN_HTTP"] == "10.200.0.2:5000"
    assert env["ORCHARD_SNAPSHOTTER_TARGET_PREFIX"] == "10.200.0.2:5000/orchard/snapshots:"
    root = "/var/lib/rancher/k3s/agent/containerd"
    volume = next(v for v in pod["spec"]["volumes"] if v["name"] == "containerd")
    assert volume["hostPath"] == {"path": root, "type": "Directory"}
    mount = next(m for m in container["volumeMounts"] if m["name"] == "containerd")
    assert mount == {"name": "containerd", "mountPath": root, "readOnly": True}
    assert pod["spec"]["tolerations"][-1] == {"key": "lab.example/gpu", "operator": "Exists"}
    config = _by(objects, "ConfigMap", "orchard-config", "lab")["data"]
    parsed = {s.key: s.parse(config[s.env]) for s in SERVICE_SETTINGS if s.env in config}
    assert parsed["registry_plain_http"] is True
    default = _by(render(_values()), "ConfigMap", "orchard-config", "lab")["data"]
    assert "ORCHARD_REGISTRY_PLAIN_HTTP" not in default
    for version in SUPPORTED_KUBERNETES_VERSIONS:
        for obj in objects:
            kubernetes_validate.validate(obj, f"{version}.0", strict=True)


def test_the_containerd_root_is_an_absolute_path() -> None:
    with pytest.raises(
        ConfigError, match=r"snapshotter.containerd_root: 'var/lib' is not an absolute"
    ):
        _values(snapshotter={"containerd_root": "var/lib"})
