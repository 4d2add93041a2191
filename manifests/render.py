"""Render the Kubernetes objects of one Orchard deployment.

The objects come from the YAML package data beside this module (``base/`` plus one overlay
from ``overlays/``), loaded with ``yaml.safe_load_all`` and then set from a
:class:`DeployValues` by structured code: nothing here assembles YAML from strings.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import ipaddress
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml

from manifests import (
    AGENT_PORT,
    BOOTSTRAP_SECRET,
    COMMON_LABELS,
    INSTANCE_LABEL,
    MASKED,
    MODEL_ENDPOINTS,
    MODEL_ENDPOINTS_DIR,
    MODEL_KEYS_DIR,
    MODEL_KEYS_SECRET,
    ORCHESTRATOR,
    REDIS,
    REDIS_SECRET,
    REDIS_SETTING,
    REGISTRY_CONFIG_DIR,
    REGISTRY_SECRET,
    SNAPSHOTTER,
    SNAPSHOTTER_PORT,
    SNAPSHOTTER_SECRET,
    SNAPSHOTTER_TOKEN_DIR,
    snapshotter_namespace,
)
from orchard_env.config import SERVICE_SETTINGS
from orchard_env.errors import ConfigError
from orchard_env.orchestrator.gateway.endpoints import load_endpoints
from provision.profile import DeploymentProfile, Limits

Overlay = Literal["aks", "generic"]
KubeObject = dict[str, Any]

# Where each base file's objects live: the service namespace or the sandbox namespace.
_SERVICE_FILES = (
    "namespace.yaml",
    "serviceaccount.yaml",
    "configmap.yaml",
    "bootstrap-key.yaml",
    "networkpolicies.yaml",
    "deployment.yaml",
    "service.yaml",
    "disruption.yaml",
)
_SANDBOX_FILES = ("namespace.yaml", "rbac.yaml", "networkpolicies.yaml")
_SNAPSHOTTER_FILES = (
    "namespace.yaml",
    "rbac.yaml",
    "token.yaml",
    "networkpolicies.yaml",
    "daemonset.yaml",
)

# Apply order: what others refer to comes first; the sandbox namespace is closed
# (NetworkPolicies) before the orchestrator that creates sandboxes starts.
KIND_ORDER = (
    "Namespace",
    "ClusterRole",
    "ClusterRoleBinding",
    "ServiceAccount",
    "Role",
    "RoleBinding",
    "ConfigMap",
    "Secret",
    "PersistentVolumeClaim",
    "NetworkPolicy",
    "Deployment",
    "DaemonSet",
    "Service",
    "PodDisruptionBudget",
)
CLUSTER_KINDS = frozenset({"Namespace", "ClusterRole", "ClusterRoleBinding"})
MODEL_ENDPOINTS_FILE = "endpoints.toml"  # its key in the ConfigMap
NODES_ROLE = "orchard-nodes"  # + "-<service namespace>": cluster-scoped names are cluster-wide
_RESERVED_NAMESPACES = frozenset({"default", "kube-system", "kube-public", "kube-node-lease"})


@dataclass(frozen=True)
class DeployValues:
    """Everything a render depends on. Secrets are ``None`` until ``orchard deploy`` makes or
    reads them; a render without them masks their values (safe to print)."""

    orchestrator_image: str
    agent_image: str
    tools_image: str | None = None  # the tools image, when it was built (--only tools)
    name: str = "orchard"
    namespace: str = "orchard"
    sandbox_namespace: str = "orchard-sandboxes"
    overlay: Overlay = "generic"
    replicas: int = 1
    load_balancer: bool = False
    load_balancer_source_ranges: tuple[str, ...] = ()
    redis: bool = False
    node_selector: Mapping[str, str] = field(default_factory=dict)  # the orchestrator's and Redis's
    tolerations: tuple[KubeObject, ...] = ()
    runtime_class: str | None = None
    image_pull_policy: str = "IfNotPresent"  # of sandbox images
    limits: Limits = field(default_factory=Limits)
    agent_port: int = AGENT_PORT
    api_key: str | None = None
    redis_password: str | None = None
    snapshots: bool = False
    snapshot_repository: str | None = None  # <registry>/<repository>/snapshots
    snapshotter_namespace: str = "orchard-snapshotter"
    snapshotter_token: str | None = None
    registry_plain_http: bool = False  # the snapshots' registry has no TLS
    containerd_root: str = "/var/lib/containerd"  # on the sandbox nodes
    snapshotter_tolerations: tuple[KubeObject, ...] = ()
    model_endpoints: str | None = None  # the endpoints file's TOML


def _has_redis_store() -> bool:
    return any(setting.key == REDIS_SETTING for setting in SERVICE_SETTINGS)


def values_from_profile(profile: DeploymentProfile, refs: Mapping[str, str]) -> DeployValues:
    """The values of a deployment profile plus its image references (keys ``orchestrator``
    and ``agent-injector``). Raises :class:`ConfigError` for what the profile's own schema
    allows but a cluster deployment cannot do."""
    if profile.target == "local":
        raise ConfigError(
            "the profile's target is local: `orchard deploy` deploys to a Kubernetes cluster",
            hint="set target: kubeconfig (any cluster) or aks in the profile",
        )
    service = profile.service
    for key, namespace in (
        ("service.namespace", service.namespace),
        ("service.sandbox_namespace", service.sandbox_namespace),
    ):
        if namespace in _RESERVED_NAMESPACES:
            raise ConfigError(
                f"{key}: {namespace!r} is a namespace Kubernetes itself uses",
                hint="give Orchard namespaces of its own (defaults: orchard, orchard-sandboxes)",
            )
    if service.namespace == service.sandbox_namespace:
        raise ConfigError(
            f"service.namespace and service.sandbox_namespace are both {service.namespace!r}",
            hint="sandboxes need a namespace of their own: it denies all traffic by default",
        )
    if service.load_balancer and not service.load_balancer_source_ranges:
        raise ConfigError(
            "service.load_balancer: a public load balancer needs source ranges",
            hint="set service.load_balancer_source_ranges, e.g. [203.0.113.0/24] "
            "(or [0.0.0.0/0] to accept anyone)",
        )
    for cidr in service.load_balancer_source_ranges:
        try:
            ipaddress.ip_network(cidr)
        except ValueError as exc:
            raise ConfigError(f"service.load_balancer_source_ranges: {exc}") from exc
    if service.redis and not _has_redis_store():
        raise ConfigError(
            "service.redis: this version of the orchestrator keeps its state in SQLite only",
            hint="set service.redis: false and service.replicas: 1",
        )
    snapshot_repository = None
    if profile.snapshots:
        if not profile.registry.server:
            raise ConfigError(
                "snapshots: true needs the registry to push snapshots to",
                hint="set registry.server in the profile (the images' registry: the "
                "snapshots go to <server>/<repository>/snapshots)",
            )
        snapshot_repository = f"{profile.registry.server}/{profile.registry.repository}/snapshots"
    model_endpoints = (
        _model_endpoints(Path(profile.model_endpoints).expanduser())
        if profile.model_endpoints
        else None
    )
    missing = [key for key in ("orchestrator", "agent-injector") if not refs.get(key)]
    if missing:
        raise ConfigError(f"no image reference for {', '.join(missing)}")
    return DeployValues(
        orchestrator_image=refs["orchestrator"],
        agent_image=refs["agent-injector"],
        tools_image=refs.get("tools"),
        name=profile.name,
        namespace=service.namespace,
        sandbox_namespace=service.sandbox_namespace,
        overlay="aks" if profile.target == "aks" else "generic",
        replicas=service.replicas,
        load_balancer=service.load_balancer,
        load_balancer_source_ranges=tuple(service.load_balancer_source_ranges),
        redis=service.redis,
        node_selector=dict(service.node_selector),
        tolerations=tuple(t.model_dump(exclude_none=True) for t in service.tolerations),
        runtime_class=profile.runtime_class,
        image_pull_policy=profile.image_pull_policy,
        limits=profile.limits,
        snapshots=profile.snapshots,
        snapshot_repository=snapshot_repository,
        snapshotter_namespace=snapshotter_namespace(service.namespace),
        registry_plain_http=profile.registry.plain_http,
        containerd_root=profile.snapshotter.containerd_root,
        snapshotter_tolerations=tuple(
            t.model_dump(exclude_none=True) for t in profile.snapshotter.tolerations
        ),
        model_endpoints=model_endpoints,
    )


def _model_endpoints(path: Path) -> str:
    """The profile's endpoints file, checked as the orchestrator will read it; its keys can
    only be files of the Secret mounted at MODEL_KEYS_DIR (a deployed orchestrator's
    environment holds no keys)."""
    try:
        endpoints = load_endpoints(path)
    except ConfigError as exc:
        # "model_endpoints_file <path>: ..." names the orchestrator's setting; here the key's.
        raise ConfigError("model_endpoints " + exc.message.split(" ", 1)[1]) from exc
    for endpoint in endpoints.endpoints.values():
        where = f"model_endpoints {path}: endpoints.{endpoint.name}"
        if endpoint.key_env:
            raise ConfigError(
                f"{where}.key_env: a deployed orchestrator has no such environment variable",
                hint=f'use key_file = "{MODEL_KEYS_DIR}/<key>", with the key in the Secret '
                f"{MODEL_KEYS_SECRET} of the service namespace",
            )
        if endpoint.key_file is not None and endpoint.key_file.parent != Path(MODEL_KEYS_DIR):
            raise ConfigError(
                f"{where}.key_file: {endpoint.key_file} is not in {MODEL_KEYS_DIR}, where the "
                f"Secret {MODEL_KEYS_SECRET} is mounted",
                hint=f'use key_file = "{MODEL_KEYS_DIR}/<key of the Secret>"',
            )
    return path.read_text()


# --- package data ---------------------------------------------------------------------------


def _load(*parts: str) -> list[KubeObject]:
    """The YAML documents of one package data file (comments-only documents skipped)."""
    text = resources.files("manifests").joinpath(*parts).read_text()
    return [doc for doc in yaml.safe_load_all(text) if doc is not None]


def overlay_patches(overlay: Overlay) -> list[KubeObject]:
    return _load("overlays", overlay, "patches.yaml")


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch: maps merge, ``null`` deletes, anything else replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


# --- rendering ------------------------------------------------------------------------------


def _pull_policy(image: str) -> str:
    """``Always`` for moving tags (latest, a dirty tree's build), else ``IfNotPresent``."""
    if "@" in image:  # pinned by digest
        return "IfNotPresent"
    tag = image.rsplit("/", 1)[-1].partition(":")[2] or "latest"
    return "Always" if tag == "latest" or tag.endswith("-dirty") else "IfNotPresent"


def _secret_data(values: Mapping[str, str | None]) -> dict[str, Any]:
    """``data`` (base64) when every value is known, else ``stringData`` with masked values."""
    if all(value is not None for value in values.values()):
        return {
            "data": {
                key: base64.b64encode(str(value).encode()).decode() for key, value in values.items()
            }
        }
    return {"stringData": dict.fromkeys(values, MASKED)}


def redis_url(values: DeployValues) -> str | None:
    if values.redis_password is None:
        return None
    host = f"{REDIS}.{values.namespace}.svc"
    return f"redis://:{values.redis_password}@{host}:6379/0"


def service_settings(values: DeployValues) -> dict[str, str]:
    """The orchestrator's settings this deployment sets (by setting key), beyond the
    ConfigMap's fixed ones."""
    limits = values.limits
    settings = {
        "instance": values.name,
        "k8s_namespace": values.sandbox_namespace,
        "agent_image": values.agent_image,
        "agent_port": str(values.agent_port),
        "image_pull_policy": values.image_pull_policy,
        **({"tools_image": values.tools_image} if values.tools_image else {}),
        "default_cpu": limits.default_cpu,
        "default_memory": limits.default_memory,
        "max_cpu": limits.max_cpu,
        "max_memory": limits.max_memory,
        "ephemeral_storage": limits.ephemeral_storage,
        "pids_limit": str(limits.pids_limit),
        "sandbox_ttl_seconds": str(limits.sandbox_ttl_seconds),
        "idle_timeout_seconds": str(limits.idle_timeout_seconds),
    }
    if values.runtime_class:
        settings["runtime_class"] = values.runtime_class
    if values.model_endpoints is not None:
        settings["model_endpoints_file"] = f"{MODEL_ENDPOINTS_DIR}/{MODEL_ENDPOINTS_FILE}"
    if values.snapshots and values.snapshot_repository:
        settings.update(
            registry=values.snapshot_repository,
            snapshotter_token_file=f"{SNAPSHOTTER_TOKEN_DIR}/token",
            snapshotter_namespace=values.snapshotter_namespace,
            snapshotter_port=str(SNAPSHOTTER_PORT),
            registry_config=f"{REGISTRY_CONFIG_DIR}/.dockerconfigjson",
        )
        if values.registry_plain_http:
            settings["registry_plain_http"] = "true"
    return settings


def _objects(values: DeployValues) -> list[tuple[str, KubeObject]]:
    """(namespace role, object) for each base object this deployment uses."""
    found = [("service", obj) for name in _SERVICE_FILES for obj in _load("base", "service", name)]
    if not values.redis:
        found += [("service", obj) for obj in _load("base", "service", "state.yaml")]
    if values.load_balancer:
        found += [("service", obj) for obj in _load("base", "service", "loadbalancer.yaml")]
    if values.model_endpoints is not None:
        found += [("service", obj) for obj in _load("base", "service", "model-endpoints.yaml")]
    if values.redis:
        found += [("service", obj) for obj in _load("base", "service", "redis.yaml")]
    for name in _SANDBOX_FILES:
        found += [("sandboxes", obj) for obj in _load("base", "sandboxes", name)]
    if values.snapshots:
        found += [("service", obj) for obj in _load("base", "snapshotter", "token.yaml")]
        for name in _SNAPSHOTTER_FILES:
            found += [("snapshotter", obj) for obj in _load("base", "snapshotter", name)]
    return found


def _find(objects: Iterable[KubeObject], kind: str, name: str) -> KubeObject | None:
    for obj in objects:
        if obj["kind"] == kind and obj["metadata"]["name"] == name:
            return obj
    return None


def _get(objects: Iterable[KubeObject], kind: str, name: str) -> KubeObject:
    found = _find(objects, kind, name)
    if found is None:
        raise LookupError(f"the base manifests have no {kind} {name}")
    return found


def _configure_orchestrator(objects: list[KubeObject], values: DeployValues) -> None:
    config = _get(objects, "ConfigMap", "orchard-config")
    for key, value in service_settings(values).items():
        config["data"]["ORCHARD_" + key.upper()] = value

    deployment = _get(objects, "Deployment", ORCHESTRATOR)
    spec = deployment["spec"]
    spec["replicas"] = values.replicas
    pod = spec["template"]
    container = pod["spec"]["containers"][0]
    container["image"] = values.orchestrator_image
    container["imagePullPolicy"] = _pull_policy(values.orchestrator_image)
    # A changed setting rolls the pods (a ConfigMap change alone would not), as does a
    # changed endpoints file (read once, at start).
    configured = dict(config["data"])
    if values.model_endpoints is not None:
        configured[MODEL_ENDPOINTS] = values.model_endpoints
        _configure_model_endpoints(objects, values.model_endpoints)
    checksum = hashlib.sha256(json.dumps(configured, sort_keys=True).encode()).hexdigest()
    pod.setdefault("metadata", {}).setdefault("annotations", {})["orchard.config/sha256"] = checksum
    if values.redis:
        # State in Redis: replicas roll one by one, and the state directory is scratch space.
        spec["strategy"] = {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0}}
        for volume in pod["spec"]["volumes"]:
            if volume["name"] == "state":
                volume.pop("persistentVolumeClaim")
                volume["emptyDir"] = {"sizeLimit": "1Gi"}
        container["env"] = [
            {
                "name": "ORCHARD_" + REDIS_SETTING.upper(),
                "valueFrom": {"secretKeyRef": {"name": REDIS_SECRET, "key": "url"}},
            }
        ]
    if values.replicas > 1:
        pod["spec"]["affinity"] = {
            "podAntiAffinity": {
                "preferredDuringSchedulingIgnoredDuringExecution": [
                    {
                        "weight": 100,
                        "podAffinityTerm": {
                            "topologyKey": "kubernetes.io/hostname",
                            "labelSelector": {"matchLabels": dict(spec["selector"]["matchLabels"])},
                        },
                    }
                ]
            }
        }


def _configure_model_endpoints(objects: list[KubeObject], endpoints: str) -> None:
    """The endpoints file in its ConfigMap, mounted with the optional keys Secret."""
    _get(objects, "ConfigMap", MODEL_ENDPOINTS)["data"] = {MODEL_ENDPOINTS_FILE: endpoints}
    pod = _get(objects, "Deployment", ORCHESTRATOR)["spec"]["template"]["spec"]
    pod["volumes"] += [
        {"name": "model-endpoints", "configMap": {"name": MODEL_ENDPOINTS}},
        _secret_volume("model-keys", MODEL_KEYS_SECRET, optional=True),
    ]
    pod["containers"][0]["volumeMounts"] += [
        {"name": "model-endpoints", "mountPath": MODEL_ENDPOINTS_DIR, "readOnly": True},
        {"name": "model-keys", "mountPath": MODEL_KEYS_DIR, "readOnly": True},
    ]


def _configure(objects: list[KubeObject], values: DeployValues) -> None:
    _configure_orchestrator(objects, values)
    secret = _get(objects, "Secret", BOOTSTRAP_SECRET)
    secret.pop("stringData", None)
    secret.update(_secret_data({"api-key": values.api_key}))
    if values.redis:
        redis_secret = _get(objects, "Secret", REDIS_SECRET)
        redis_secret.pop("stringData", None)
        redis_secret.update(
            _secret_data({"password": values.redis_password, "url": redis_url(values)})
        )
        redis = _get(objects, "Deployment", REDIS)["spec"]["template"]["spec"]["containers"][0]
        redis["imagePullPolicy"] = _pull_policy(redis["image"])
    if values.load_balancer:
        public = _get(objects, "Service", "orchard-public")
        public["spec"]["loadBalancerSourceRanges"] = list(values.load_balancer_source_ranges)
    for binding in objects:
        if binding["kind"] == "RoleBinding" and binding["metadata"]["name"] == ORCHESTRATOR:
            binding["subjects"][0]["namespace"] = values.namespace
    nodes_role = nodes_role_name(values.namespace)
    _get(objects, "ClusterRole", NODES_ROLE)["metadata"]["name"] = nodes_role
    nodes_binding = _get(objects, "ClusterRoleBinding", NODES_ROLE)
    nodes_binding["metadata"]["name"] = nodes_role
    nodes_binding["roleRef"]["name"] = nodes_role
    nodes_binding["subjects"][0]["namespace"] = values.namespace
    agent = _get(objects, "NetworkPolicy", "orchard-agent-ingress")
    rule = agent["spec"]["ingress"][0]
    rule["from"][0]["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"] = (
        values.namespace
    )
    rule["ports"][0]["port"] = values.agent_port


def nodes_role_name(namespace: str) -> str:
    """The ClusterRole (and its binding) letting a deployment's orchestrator list nodes."""
    return f"{NODES_ROLE}-{namespace}"


def _secret_volume(name: str, secret: str, *, optional: bool = False) -> KubeObject:
    source: KubeObject = {"secretName": secret, "defaultMode": 0o440}
    if optional:
        source["optional"] = True
    return {"name": name, "secret": source}


def _configure_snapshots(objects: list[KubeObject], values: DeployValues) -> None:
    """The snapshotter DaemonSet, its token (in both namespaces) and the orchestrator's
    mounts of the token and of the optional registry credentials."""
    for secret in objects:
        if secret["kind"] == "Secret" and secret["metadata"]["name"] == SNAPSHOTTER_SECRET:
            secret.pop("stringData", None)
            secret.update(_secret_data({"token": values.snapshotter_token}))
    pod = _get(objects, "DaemonSet", SNAPSHOTTER)["spec"]["template"]
    container = pod["spec"]["containers"][0]
    container["image"] = values.orchestrator_image
    container["imagePullPolicy"] = _pull_policy(values.orchestrator_image)
    for variable in container["env"]:
        if variable["name"] == "ORCHARD_SNAPSHOTTER_TARGET_PREFIX":
            variable["value"] = f"{values.snapshot_repository}:"
    if values.registry_plain_http and values.snapshot_repository:
        registry = values.snapshot_repository.split("/", 1)[0]
        container["env"].append({"name": "ORCHARD_SNAPSHOTTER_PLAIN_HTTP", "value": registry})
    # The upperdirs mountinfo names are under containerd's root: mounted at the same path.
    for volume in pod["spec"]["volumes"]:
        if volume["name"] == "containerd":
            volume["hostPath"]["path"] = values.containerd_root
    for mount in container["volumeMounts"]:
        if mount["name"] == "containerd":
            mount["mountPath"] = values.containerd_root
    pod["spec"]["tolerations"] += [dict(t) for t in values.snapshotter_tolerations]
    policy = _get(objects, "NetworkPolicy", "orchard-snapshotter-ingress")
    peer = policy["spec"]["ingress"][0]["from"][0]
    peer["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"] = values.namespace

    orchestrator = _get(objects, "Deployment", ORCHESTRATOR)["spec"]["template"]["spec"]
    orchestrator["volumes"] += [
        _secret_volume("snapshotter-token", SNAPSHOTTER_SECRET),
        _secret_volume("registry", REGISTRY_SECRET, optional=True),
    ]
    orchestrator["containers"][0]["volumeMounts"] += [
        {"name": "snapshotter-token", "mountPath": SNAPSHOTTER_TOKEN_DIR, "readOnly": True},
        {"name": "registry", "mountPath": REGISTRY_CONFIG_DIR, "readOnly": True},
    ]


def _label(obj: KubeObject, values: DeployValues) -> None:
    labels = {**COMMON_LABELS, INSTANCE_LABEL: values.name}
    obj["metadata"]["labels"] = {**obj["metadata"].get("labels", {}), **labels}
    template = obj.get("spec", {}).get("template")
    if obj["kind"] in ("Deployment", "DaemonSet") and template is not None:
        template["metadata"]["labels"] = {**template["metadata"]["labels"], **labels}


def _place(objects: list[KubeObject], values: DeployValues) -> None:
    """The profile's node selector and tolerations on the orchestrator's and Redis's pods,
    beside what the overlay put there."""
    for name in (ORCHESTRATOR, REDIS):
        deployment = _find(objects, "Deployment", name)
        if deployment is None:
            continue
        pod = deployment["spec"]["template"]["spec"]
        if values.node_selector:
            pod["nodeSelector"] = {**pod.get("nodeSelector", {}), **values.node_selector}
        if values.tolerations:
            pod["tolerations"] = [*pod.get("tolerations", []), *map(dict, values.tolerations)]


def _overlay(objects: list[KubeObject], overlay: Overlay) -> None:
    for patch in overlay_patches(overlay):
        target = _find(objects, patch["kind"], patch["metadata"]["name"])
        if target is None:  # an optional object this deployment does not use
            continue
        body = {key: value for key, value in patch.items() if key != "kind"}
        body["metadata"] = {k: v for k, v in patch["metadata"].items() if k != "name"}
        objects[objects.index(target)] = merge_patch(target, body)


def render(values: DeployValues) -> list[KubeObject]:
    """The deployment's objects in apply order. Without ``values.api_key`` (and the Redis
    password) the Secrets' values are masked: such a render is for reading, not applying."""
    placed = _objects(values)
    objects: list[KubeObject] = []
    namespaces = {
        "service": values.namespace,
        "sandboxes": values.sandbox_namespace,
        "snapshotter": values.snapshotter_namespace,
    }
    for role, obj in placed:
        namespace = namespaces[role]
        if obj["kind"] == "Namespace":
            obj["metadata"]["name"] = namespace
        elif obj["kind"] not in CLUSTER_KINDS:  # name, namespace, the rest: as kubectl shows
            name = obj["metadata"].pop("name")
            obj["metadata"] = {"name": name, "namespace": namespace, **obj["metadata"]}
        objects.append(obj)
    _configure(objects, values)
    if values.snapshots:
        _configure_snapshots(objects, values)
    for obj in objects:
        _label(obj, values)
    _overlay(objects, values.overlay)
    _place(objects, values)
    objects.sort(key=lambda obj: KIND_ORDER.index(obj["kind"]))
    return objects


def to_yaml(objects: Iterable[KubeObject]) -> str:
    """A multi-document YAML stream ``kubectl apply -f -`` reads."""
    return yaml.safe_dump_all(list(objects), sort_keys=False, explicit_start=True)
