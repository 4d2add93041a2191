"""What `orchard deploy` renders: valid for every supported Kubernetes version, least
privilege, no secret in a printed render, and the profile's values where they belong."""

from __future__ import annotations

import base64
from dataclasses import replace
from typing import Any

import kubernetes_validate
import pytest
import yaml

from manifests import (
    AGENT_PORT,
    BOOTSTRAP_SECRET,
    MASKED,
    SUPPORTED_KUBERNETES_VERSIONS,
)
from manifests.render import (
    DeployValues,
    KubeObject,
    overlay_patches,
    render,
    to_yaml,
    values_from_profile,
)
from orchard_env.config import SERVICE_SETTINGS
from orchard_env.errors import ConfigError
from provision.profile import DeploymentProfile, parse_profile
from tests.manifests.test_deploy import REFS

API_KEY = "ork_0123456789_" + "s" * 43
FULL = DeployValues(
    orchestrator_image=REFS["orchestrator"],
    agent_image=REFS["agent-injector"],
    overlay="aks",
    replicas=3,
    load_balancer=True,
    load_balancer_source_ranges=("198.51.100.0/24",),
    redis=True,
    runtime_class="gvisor",
    api_key=API_KEY,
    redis_password="p" * 43,
)


def _profile(data: dict[str, Any]) -> DeploymentProfile:
    return parse_profile(data, source="test")


RENDERS: dict[str, DeployValues] = {
    "default": values_from_profile(_profile({"target": "kubeconfig"}), REFS),
    "aks": values_from_profile(_profile({"target": "aks"}), REFS),
    "generic": values_from_profile(
        _profile(
            {
                "name": "lab",
                "target": "kubeconfig",
                "runtime_class": "kata",
                "service": {
                    "namespace": "lab",
                    "sandbox_namespace": "lab-sandboxes",
                    "load_balancer": True,
                    "load_balancer_source_ranges": ["10.0.0.0/8"],
                    "node_selector": {"pool": "system"},
                    "tolerations": [{"key": "dedicated", "operator": "Exists"}],
                },
                "limits": {"default_cpu": "500m", "max_memory": "8Gi", "pids_limit": 512},
            }
        ),
        REFS,
    ),
    "aks-redis-lb-keys": FULL,
}


def _by(objects: list[KubeObject], kind: str, name: str) -> KubeObject:
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def _orchestrator(objects: list[KubeObject]) -> KubeObject:
    return _by(objects, "Deployment", "orchard-orchestrator")


@pytest.mark.parametrize("version", SUPPORTED_KUBERNETES_VERSIONS)
@pytest.mark.parametrize("which", list(RENDERS))
def test_every_object_is_valid_for_every_supported_version(which: str, version: str) -> None:
    for obj in render(RENDERS[which]):
        # strict: unknown fields are errors too (a typo would be silently dropped by the server)
        kubernetes_validate.validate(obj, f"{version}.0", strict=True)


@pytest.mark.parametrize("which", list(RENDERS))
def test_every_object_is_in_its_namespace_and_labelled(which: str) -> None:
    values = RENDERS[which]
    objects = render(values)
    namespaces = [o["metadata"]["name"] for o in objects if o["kind"] == "Namespace"]
    assert namespaces == [values.namespace, values.sandbox_namespace]
    sandbox_kinds = set()
    for obj in objects:
        metadata = obj["metadata"]
        labels = metadata["labels"]
        assert labels["app.kubernetes.io/part-of"] == "orchard"
        assert labels["app.kubernetes.io/managed-by"] == "orchard-deploy"
        assert labels["app.kubernetes.io/instance"] == values.name
        if obj["kind"] in ("Namespace", "ClusterRole", "ClusterRoleBinding"):
            assert "namespace" not in metadata
        elif metadata["namespace"] == values.sandbox_namespace:
            sandbox_kinds.add(f"{obj['kind']}/{metadata['name']}")
        else:
            assert metadata["namespace"] == values.namespace
    assert sandbox_kinds == {
        "Role/orchard-orchestrator",
        "RoleBinding/orchard-orchestrator",
        "ServiceAccount/default",
        "NetworkPolicy/orchard-default-deny",
        "NetworkPolicy/orchard-agent-ingress",
        "NetworkPolicy/orchard-dns-egress",
    }


def test_rbac_is_namespaced_and_least_privilege() -> None:
    objects = render(FULL)
    cluster_scoped = [o for o in objects if "namespace" not in o["metadata"]]
    assert {o["kind"] for o in cluster_scoped} == {"Namespace", "ClusterRole", "ClusterRoleBinding"}
    # The one cluster-scoped right: list nodes (GET /resources reports their capacity).
    name = f"orchard-nodes-{FULL.namespace}"
    assert _by(objects, "ClusterRole", name)["rules"] == [
        {"apiGroups": [""], "resources": ["nodes"], "verbs": ["list"]}
    ]
    nodes_binding = _by(objects, "ClusterRoleBinding", name)
    assert nodes_binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": name,
    }
    assert nodes_binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "orchard-orchestrator", "namespace": FULL.namespace}
    ]
    role = _by(objects, "Role", "orchard-orchestrator")
    assert role["metadata"]["namespace"] == FULL.sandbox_namespace
    rules = {
        (group, resource): sorted(rule["verbs"])
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
    }
    assert rules == {
        ("", "pods"): ["create", "delete", "get", "list", "watch"],
        ("", "pods/status"): ["get"],
        ("", "secrets"): ["create", "delete", "get"],
        ("networking.k8s.io", "networkpolicies"): ["create", "delete", "get", "list"],
    }
    binding = _by(objects, "RoleBinding", "orchard-orchestrator")
    assert binding["metadata"]["namespace"] == FULL.sandbox_namespace
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": "orchard-orchestrator",
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "orchard-orchestrator", "namespace": FULL.namespace}
    ]
    pod = _orchestrator(objects)["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "orchard-orchestrator"
    # Sandbox pods get no token even when their spec forgets to say so.
    default = _by(objects, "ServiceAccount", "default")
    assert default["metadata"]["namespace"] == FULL.sandbox_namespace
    assert default["automountServiceAccountToken"] is False


def test_a_render_without_keys_masks_every_secret_value() -> None:
    values = replace(FULL, api_key=None, redis_password=None)
    text = to_yaml(render(values))
    secrets = [o for o in yaml.safe_load_all(text) if o["kind"] == "Secret"]
    assert {s["metadata"]["name"] for s in secrets} == {BOOTSTRAP_SECRET, "orchard-redis"}
    for secret in secrets:
        assert "data" not in secret
        assert set(secret["stringData"].values()) == {MASKED}
    assert "ork_" not in text and "redis://" not in text


def test_a_render_with_keys_carries_them_base64_encoded() -> None:
    objects = render(FULL)
    secret = _by(objects, "Secret", BOOTSTRAP_SECRET)
    assert "stringData" not in secret
    assert base64.b64decode(secret["data"]["api-key"]).decode() == API_KEY
    redis = _by(objects, "Secret", "orchard-redis")["data"]
    assert base64.b64decode(redis["url"]).decode() == (
        f"redis://:{'p' * 43}@orchard-redis.orchard.svc:6379/0"
    )
    # Never in the ConfigMap or the pod spec.
    for obj in objects:
        if obj["kind"] != "Secret":
            assert API_KEY not in to_yaml([obj])


@pytest.mark.parametrize("which", list(RENDERS))
def test_the_configmap_holds_real_settings_with_the_profiles_values(which: str) -> None:
    values = RENDERS[which]
    data = _by(render(values), "ConfigMap", "orchard-config")["data"]
    table = {setting.env: setting for setting in SERVICE_SETTINGS}
    for name, raw in data.items():
        assert name in table, f"{name} is not a setting the orchestrator reads"
        table[name].parse(raw)  # a bad value would stop the orchestrator at start
    limits = values.limits
    assert data["ORCHARD_BACKEND"] == "kubernetes"
    assert data["ORCHARD_HOST"] == "0.0.0.0"
    assert data["ORCHARD_INSTANCE"] == values.name
    assert data["ORCHARD_K8S_NAMESPACE"] == values.sandbox_namespace
    assert data["ORCHARD_AGENT_IMAGE"] == REFS["agent-injector"]
    assert data["ORCHARD_AGENT_PORT"] == str(AGENT_PORT)
    assert data["ORCHARD_DEFAULT_CPU"] == limits.default_cpu
    assert data["ORCHARD_MAX_MEMORY"] == limits.max_memory
    assert data["ORCHARD_PIDS_LIMIT"] == str(limits.pids_limit)
    assert data["ORCHARD_EPHEMERAL_STORAGE"] == limits.ephemeral_storage
    assert data.get("ORCHARD_RUNTIME_CLASS") == values.runtime_class
    assert data["ORCHARD_STATE_DIR"] == "/var/lib/orchard"
    assert data["ORCHARD_BOOTSTRAP_KEY_FILE"] == "/etc/orchard/bootstrap/api-key"


def test_the_bootstrap_key_is_mounted_where_the_setting_points() -> None:
    objects = render(RENDERS["default"])
    pod = _orchestrator(objects)["spec"]["template"]["spec"]
    container = pod["containers"][0]
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    key_file = _by(objects, "ConfigMap", "orchard-config")["data"]["ORCHARD_BOOTSTRAP_KEY_FILE"]
    mount = mounts["bootstrap-key"]
    assert mount["readOnly"] is True
    assert key_file == f"{mount['mountPath']}/api-key"
    secret_volume = volumes["bootstrap-key"]["secret"]
    assert secret_volume["secretName"] == BOOTSTRAP_SECRET
    # Group-readable, and the orchestrator's group owns it (fsGroup): readable as non-root.
    assert secret_volume["defaultMode"] == 0o440
    assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsGroup"]


def test_the_orchestrator_fits_a_small_node_and_is_hardened() -> None:
    for values in RENDERS.values():
        objects = render(values)
        deployment = _orchestrator(objects)
        pod = deployment["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        requests = container["resources"]["requests"]
        assert requests == {"cpu": "250m", "memory": "512Mi"}
        assert container["resources"]["limits"] == {"cpu": "2", "memory": "2Gi"}
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}
        assert container["command"] == ["python", "-m", "orchard_env.orchestrator"]
        # Pod Security "restricted".
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert container["securityContext"] == {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        }
        selector = deployment["spec"]["selector"]["matchLabels"]
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert selector.items() <= labels.items()
        for kind, name in (("Service", "orchard"), ("PodDisruptionBudget", "orchard-orchestrator")):
            target = _by(objects, kind, name)["spec"]["selector"]
            target = target.get("matchLabels", target)
            assert target.items() <= labels.items()


def test_state_on_a_volume_without_redis_and_in_redis_with_it() -> None:
    objects = render(RENDERS["default"])
    deployment = _orchestrator(objects)
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes["state"]["persistentVolumeClaim"] == {"claimName": "orchard-state"}
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    assert deployment["spec"]["replicas"] == 1
    _by(objects, "PersistentVolumeClaim", "orchard-state")
    assert not [o for o in objects if o["metadata"]["name"].startswith("orchard-redis")]

    objects = render(FULL)
    deployment = _orchestrator(objects)
    pod = deployment["spec"]["template"]["spec"]
    assert "emptyDir" in {v["name"]: v for v in pod["volumes"]}["state"]
    assert deployment["spec"]["replicas"] == 3
    assert deployment["spec"]["strategy"]["type"] == "RollingUpdate"
    assert pod["containers"][0]["env"] == [
        {
            "name": "ORCHARD_REDIS_URL",
            "valueFrom": {"secretKeyRef": {"name": "orchard-redis", "key": "url"}},
        }
    ]
    assert "podAntiAffinity" in pod["affinity"]
    assert not [o for o in objects if o["metadata"]["name"] == "orchard-state"]
    redis = _by(objects, "Deployment", "orchard-redis")["spec"]["template"]["spec"]
    args = redis["containers"][0]["args"]
    assert args[args.index("--maxmemory-policy") + 1] == "noeviction"
    assert args[args.index("--appendonly") + 1] == "yes"
    assert args[args.index("--requirepass") + 1] == "$(REDIS_PASSWORD)"
    assert redis["volumes"][0]["persistentVolumeClaim"] == {"claimName": "orchard-redis-data"}


def test_the_aks_overlay_places_the_service_on_the_system_pool() -> None:
    system = {"kubernetes.azure.com/mode": "system"}
    objects = render(FULL)
    for name in ("orchard-orchestrator", "orchard-redis"):
        pod = _by(objects, "Deployment", name)["spec"]["template"]["spec"]
        assert pod["nodeSelector"] == system
        assert pod["tolerations"] == [
            {"key": "CriticalAddonsOnly", "operator": "Exists", "effect": "NoSchedule"}
        ]
    public = _by(objects, "Service", "orchard-public")
    assert public["metadata"]["annotations"] == {
        "service.beta.kubernetes.io/azure-load-balancer-health-probe-request-path": "/health",
        "service.beta.kubernetes.io/azure-load-balancer-tcp-idle-timeout": "30",
    }
    # Every AKS patch lands on an object of a full render (no typo silently does nothing).
    names = {(o["kind"], o["metadata"]["name"]) for o in objects}
    for patch in overlay_patches("aks"):
        assert (patch["kind"], patch["metadata"]["name"]) in names

    generic = render(replace(FULL, overlay="generic"))
    assert overlay_patches("generic") == []
    for obj in generic:
        text = to_yaml([obj])
        assert "azure" not in text, f"{obj['kind']}/{obj['metadata']['name']}"


def test_the_profile_places_the_orchestrator_beside_what_the_overlay_says() -> None:
    toleration = {"key": "lab.example/only", "value": "orchard", "effect": "NoSchedule"}
    placed = replace(FULL, node_selector={"disk": "ssd"}, tolerations=(toleration,))
    objects = render(placed)
    for name in ("orchard-orchestrator", "orchard-redis"):
        pod = _by(objects, "Deployment", name)["spec"]["template"]["spec"]
        assert pod["nodeSelector"] == {"kubernetes.azure.com/mode": "system", "disk": "ssd"}
        assert pod["tolerations"] == [
            {"key": "CriticalAddonsOnly", "operator": "Exists", "effect": "NoSchedule"},
            toleration,
        ]
    generic = _orchestrator(render(RENDERS["generic"]))["spec"]["template"]["spec"]
    assert generic["nodeSelector"] == {"pool": "system"}
    assert generic["tolerations"] == [{"key": "dedicated", "operator": "Exists"}]
    default = _orchestrator(render(RENDERS["default"]))["spec"]["template"]["spec"]
    assert "nodeSelector" not in default
    assert "tolerations" not in default


def test_the_load_balancer_only_for_the_source_ranges() -> None:
    assert not [
        o
        for o in render(RENDERS["default"])
        if o["kind"] == "Service" and (o["spec"]["type"] == "LoadBalancer")
    ]
    public = _by(render(RENDERS["generic"]), "Service", "orchard-public")
    assert public["spec"]["type"] == "LoadBalancer"
    assert public["spec"]["loadBalancerSourceRanges"] == ["10.0.0.0/8"]
    assert public["spec"]["selector"] == {"app.kubernetes.io/name": "orchard-orchestrator"}


def test_image_pull_policy_follows_the_tag() -> None:
    def policy(image: str) -> str:
        deployment = _orchestrator(render(replace(FULL, orchestrator_image=image)))
        return str(deployment["spec"]["template"]["spec"]["containers"][0]["imagePullPolicy"])

    assert policy("r.example/orchard/orchestrator:0.1.0-abc1234") == "IfNotPresent"
    assert policy("r.example/orchard/orchestrator:0.1.0-abc1234-dirty") == "Always"
    assert policy("r.example/orchard/orchestrator:latest") == "Always"
    assert policy("localhost:5000/orchard/orchestrator") == "Always"  # no tag: latest
    assert policy("r.example/orchard/orchestrator@sha256:" + "0" * 64) == "IfNotPresent"


def test_the_profile_sets_the_sandbox_image_pull_policy() -> None:
    def setting(data: dict[str, Any]) -> str:
        objects = render(values_from_profile(_profile(data), REFS))
        return str(_by(objects, "ConfigMap", "orchard-config")["data"]["ORCHARD_IMAGE_PULL_POLICY"])

    assert setting({}) == "IfNotPresent"
    assert setting({"image_pull_policy": "Always"}) == "Always"
    with pytest.raises(ConfigError, match=r"image_pull_policy: Input should be 'IfNotPresent'"):
        _profile({"image_pull_policy": "sometimes"})


def test_a_settings_change_rolls_the_pods() -> None:
    def checksum(values: DeployValues) -> str:
        template = _orchestrator(render(values))["spec"]["template"]
        return str(template["metadata"]["annotations"]["orchard.config/sha256"])

    base = RENDERS["default"]
    assert checksum(base) == checksum(base)
    assert checksum(replace(base, agent_image="r.example/other:1")) != checksum(base)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (
            {"target": "local"},
            "the profile's target is local: `orchard deploy` deploys to a Kubernetes cluster",
        ),
        (
            {"service": {"namespace": "kube-system"}},
            "service.namespace: 'kube-system' is a namespace Kubernetes itself uses",
        ),
        (
            {"service": {"sandbox_namespace": "default"}},
            "service.sandbox_namespace: 'default' is a namespace Kubernetes itself uses",
        ),
        (
            {"service": {"namespace": "same", "sandbox_namespace": "same"}},
            "service.namespace and service.sandbox_namespace are both 'same'",
        ),
        (
            {"service": {"load_balancer": True}},
            "service.load_balancer: a public load balancer needs source ranges",
        ),
        (
            {"service": {"load_balancer": True, "load_balancer_source_ranges": ["10.0.0.300/8"]}},
            "service.load_balancer_source_ranges: '10.0.0.300/8' does not appear to be an "
            "IPv4 or IPv6 network",
        ),
        (
            {"service": {"tolerations": [{"key": "k", "operator": "Exists", "value": "v"}]}},
            "test: service.tolerations.0: a toleration with operator Exists takes no value",
        ),
        (
            {"service": {"tolerations": [{"effect": "NoSchedule"}]}},
            "test: service.tolerations.0: a toleration without a key needs operator Exists",
        ),
        (
            {"service": {"redis": True, "replicas": 2}},
            "service.redis: this version of the orchestrator keeps its state in SQLite only",
        ),
    ],
)
def test_what_a_cluster_deployment_cannot_do_is_refused(data: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        values_from_profile(_profile(data), REFS)
    assert caught.value.message == message


def test_image_references_are_required() -> None:
    with pytest.raises(ConfigError, match=r"^no image reference for agent-injector$"):
        values_from_profile(_profile({}), {"orchestrator": "o"})
