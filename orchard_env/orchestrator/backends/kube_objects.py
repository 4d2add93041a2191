"""The Kubernetes objects the backend makes for a sandbox: its pod, the Secret holding its
agent key, and (for a sandbox with network) its egress NetworkPolicy; and the labels and names
that tie them together (the manifests' NetworkPolicies match these labels).

Pure functions of the settings and the sandbox's spec: nothing here talks to the API server.
"""

from __future__ import annotations

import base64
import hashlib
import ipaddress
from typing import Any

from orchard_env import errors
from orchard_env.agent.bundle import BUNDLE_MOUNT, launch_argv, launch_env
from orchard_env.config import ServiceSettings
from orchard_env.orchestrator.backends.base import SANDBOX_CAPABILITIES, SandboxSpec
from orchard_env.orchestrator.backends.kube_tools import add_tools
from orchard_env.protocol import LABEL_VALUE_RE

LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_INSTANCE = "orchard.instance"
LABEL_SANDBOX_ID = "orchard.sandbox-id"
LABEL_OWNER = "orchard.owner"
LABEL_NETWORK = "orchard.network"  # "open" on sandboxes with network
USER_LABEL_PREFIX = "orchard.label/"  # + the user's label key (a DNS-subdomain prefix)
ANNOTATION_RECORD = "orchard.record"
ANNOTATION_AGENT_SECRET = "orchard.agent-secret"  # noqa: S105 - the Secret's name, not a secret
MANAGED_BY = "orchard"

WORKDIR_ENV = "ORCHARD_AGENT_WORKDIR"
TOKEN_KEY = "token"  # noqa: S105 - the key in the Secret's data
MAIN_CONTAINER = "sandbox"
INIT_CONTAINER = "agent-injector"
BUNDLE_VOLUME = "orchard-agent"
BUNDLE_VOLUME_SIZE = "512Mi"  # the bundle is about 75 MB
INIT_MEMORY = 256 * 1024**2  # the copy's memory (capped at the sandbox's own)
# What a sandbox asks the scheduler for in disk: the limit is settings.ephemeral_storage, but
# requesting all of it would cap a node at a few sandboxes whatever their CPU and memory.
EPHEMERAL_STORAGE_REQUEST = 1024**3
# The agent bundle is built for x86_64 (the agent-injector image); the pods are pinned to
# amd64 nodes so the loader in the command line always matches the bundle.
SANDBOX_MACHINE = "x86_64"
SANDBOX_NODE_ARCH = "amd64"
NODE_SELECTOR = {"workload": "sandbox", "kubernetes.io/arch": SANDBOX_NODE_ARCH}
TOLERATIONS = (
    {"key": "workload", "operator": "Equal", "value": "sandbox", "effect": "NoSchedule"},
    {
        "key": "kubernetes.azure.com/scalesetpriority",
        "operator": "Equal",
        "value": "spot",
        "effect": "NoSchedule",
    },
)
DNS_PORTS = ({"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53})
TERMINATION_GRACE_SECONDS = 10

Pod = dict[str, Any]


def pod_name(sandbox_id: str) -> str:
    return sandbox_id


SECRET_PREFIX = "orchard-agent-"  # noqa: S105 - a name prefix
POLICY_PREFIX = "orchard-egress-"


def dependent_names(spec: SandboxSpec) -> tuple[str, str]:
    """The names of a sandbox's token Secret and egress policy: ``orchard-agent-<id>-<x>`` and
    ``orchard-egress-<id>-<x>``, ``<x>`` from a hash of its token. Unique per pod, so the
    kubelet can never read a Secret left over from an earlier pod of the same id (deleted
    behind the orchestrator's back, its dependents not garbage-collected yet)."""
    suffix = hashlib.sha256(spec.agent_token.encode()).hexdigest()[:10]
    return (
        f"{SECRET_PREFIX}{spec.sandbox_id}-{suffix}",
        f"{POLICY_PREFIX}{spec.sandbox_id}-{suffix}",
    )


def pod_dependents(pod: Pod) -> tuple[str, str] | None:
    """The names of the Secret and policy of a pod made by :func:`pod_manifest`."""
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    secret = str(annotations.get(ANNOTATION_AGENT_SECRET) or "")
    if not secret.startswith(SECRET_PREFIX):
        return None
    return secret, POLICY_PREFIX + secret.removeprefix(SECRET_PREFIX)


def instance_selector(instance: str) -> str:
    """The label selector of every pod an orchestrator instance owns."""
    return f"{LABEL_MANAGED_BY}={MANAGED_BY},{LABEL_INSTANCE}={instance}"


# --- manifests -------------------------------------------------------------------------------


def _quantity_cpu(cores: float) -> str:
    return f"{round(cores * 1000)}m"


def _owner_reference(pod: Pod) -> dict[str, Any]:
    """Makes an object a dependent of the sandbox's pod: deleted with it by the garbage
    collector (no blockOwnerDeletion, which would need update rights on the pod)."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "name": pod["metadata"]["name"],
        "uid": pod["metadata"]["uid"],
    }


def _labels(settings: ServiceSettings, spec: SandboxSpec) -> dict[str, str]:
    labels = {
        LABEL_MANAGED_BY: MANAGED_BY,
        LABEL_INSTANCE: settings.instance,
        LABEL_SANDBOX_ID: spec.sandbox_id,
    }
    if spec.owner is not None and LABEL_VALUE_RE.match(spec.owner):
        labels[LABEL_OWNER] = spec.owner
    return labels


def pod_manifest(settings: ServiceSettings, spec: SandboxSpec) -> Pod:
    """The pod of one sandbox (see the module docstring for what each part is for)."""
    agent_image = settings.agent_image
    if agent_image is None:
        raise no_agent_image()
    labels = _labels(settings, spec)
    if not spec.block_network:
        labels[LABEL_NETWORK] = "open"
    labels.update({USER_LABEL_PREFIX + key: value for key, value in spec.labels.items()})
    annotations = {ANNOTATION_AGENT_SECRET: dependent_names(spec)[0]}
    if spec.record_annotation is not None:
        annotations[ANNOTATION_RECORD] = spec.record_annotation
    # spec.env reaches the commands through the agent's enrollment, not the agent.
    env = {**launch_env(BUNDLE_MOUNT), WORKDIR_ENV: spec.workdir}
    cpu = _quantity_cpu(spec.cpu)
    disk = settings.ephemeral_storage if spec.disk_bytes is None else spec.disk_bytes
    main_resources = {
        "requests": {
            "cpu": cpu,
            "memory": str(spec.memory_bytes),
            "ephemeral-storage": str(min(EPHEMERAL_STORAGE_REQUEST, disk)),
        },
        "limits": {
            "cpu": cpu,
            "memory": str(spec.memory_bytes),
            "ephemeral-storage": str(disk),
        },
    }
    # requests = limits for the init container too (Guaranteed QoS needs every container to),
    # never above the sandbox's own, so it does not raise what the pod asks the scheduler for.
    init_limits = {"cpu": cpu, "memory": str(min(INIT_MEMORY, spec.memory_bytes))}
    bundle_mount = {"name": BUNDLE_VOLUME, "mountPath": BUNDLE_MOUNT}
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": TERMINATION_GRACE_SECONDS,
        "nodeSelector": dict(NODE_SELECTOR),
        "tolerations": [dict(toleration) for toleration in TOLERATIONS],
        "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
        "initContainers": [
            {
                "name": INIT_CONTAINER,
                "image": agent_image,
                "imagePullPolicy": "IfNotPresent",
                "args": [BUNDLE_MOUNT],
                "volumeMounts": [bundle_mount],
                "resources": {"requests": init_limits, "limits": dict(init_limits)},
                "terminationMessagePolicy": "FallbackToLogsOnError",
                # The injector copies files and needs nothing else (its tar keeps no owners).
                "securityContext": {
                    "allowPrivilegeEscalation": False,
                    "readOnlyRootFilesystem": True,
                    "runAsNonRoot": True,
                    "runAsUser": 65534,
                    "runAsGroup": 65534,
                    "capabilities": {"drop": ["ALL"]},
                },
            }
        ],
        "containers": [
            {
                "name": MAIN_CONTAINER,
                "image": spec.image,
                # Stated, not Kubernetes' default (Always for :latest or no tag: a registry
                # round trip at every create, and none starts while the registry is away).
                "imagePullPolicy": settings.image_pull_policy,
                "command": launch_argv(
                    BUNDLE_MOUNT, f"tcp:0.0.0.0:{settings.agent_port}", SANDBOX_MACHINE
                ),
                "args": [],
                "workingDir": spec.workdir,
                "env": [{"name": name, "value": value} for name, value in env.items()],
                "ports": [{"name": "agent", "containerPort": settings.agent_port}],
                # Kubernetes' view only; the orchestrator itself checks the agent's /health.
                "readinessProbe": {"tcpSocket": {"port": settings.agent_port}, "periodSeconds": 5},
                "resources": main_resources,
                "volumeMounts": [{**bundle_mount, "readOnly": True}],
                "terminationMessagePolicy": "FallbackToLogsOnError",
                "securityContext": {
                    "allowPrivilegeEscalation": False,  # no-new-privileges
                    "capabilities": {"drop": ["ALL"], "add": list(SANDBOX_CAPABILITIES)},
                },
            }
        ],
        "volumes": [{"name": BUNDLE_VOLUME, "emptyDir": {"sizeLimit": BUNDLE_VOLUME_SIZE}}],
    }
    add_tools(pod_spec, settings, spec.tools, pod_spec["initContainers"][0])
    if spec.ttl_seconds:
        # The orchestrator ends the sandbox at its TTL; the deadline (counted from the pod's
        # start, so never earlier) only acts when it could not, e.g. while it was down.
        pod_spec["activeDeadlineSeconds"] = spec.ttl_seconds + max(
            60, 2 * settings.reap_interval_seconds
        )
    if settings.runtime_class:
        pod_spec["runtimeClassName"] = settings.runtime_class
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": pod_name(spec.sandbox_id),
            "namespace": settings.k8s_namespace,
            "labels": labels,
            "annotations": annotations,
        },
        "spec": pod_spec,
    }


def token_secret(settings: ServiceSettings, spec: SandboxSpec, pod: Pod) -> dict[str, Any]:
    """The Secret holding the agent token of the sandbox whose (created) pod is ``pod``."""
    token = base64.b64encode(spec.agent_token.encode()).decode()
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": dependent_names(spec)[0],
            "namespace": settings.k8s_namespace,
            "labels": _labels(settings, spec),
            "ownerReferences": [_owner_reference(pod)],
        },
        "type": "Opaque",
        "immutable": True,
        "data": {TOKEN_KEY: token},
    }


def egress_policy(settings: ServiceSettings, spec: SandboxSpec, pod: Pod) -> dict[str, Any]:
    """The NetworkPolicy that lets a sandbox with network reach the internet (everything but
    ``settings.egress_except``) and DNS. IPv6 is opened only when ``egress_except`` names an
    IPv6 range (otherwise nothing would keep the cluster's IPv6 ranges out)."""
    excepts = [ipaddress.ip_network(cidr) for cidr in settings.egress_except]
    blocks = []
    for version, everything in ((4, "0.0.0.0/0"), (6, "::/0")):
        kept_out = [str(network) for network in excepts if network.version == version]
        if version == 4 or kept_out:
            block: dict[str, Any] = {"cidr": everything}
            if kept_out:
                block["except"] = kept_out
            blocks.append({"ipBlock": block})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {
            "name": dependent_names(spec)[1],
            "namespace": settings.k8s_namespace,
            "labels": _labels(settings, spec),
            "ownerReferences": [_owner_reference(pod)],
        },
        "spec": {
            "podSelector": {
                "matchLabels": {
                    LABEL_INSTANCE: settings.instance,
                    LABEL_SANDBOX_ID: spec.sandbox_id,
                }
            },
            "policyTypes": ["Egress"],
            "egress": [
                {"to": blocks},
                {
                    "to": [
                        {
                            "namespaceSelector": {
                                "matchLabels": {"kubernetes.io/metadata.name": "kube-system"}
                            },
                            "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}},
                        }
                    ],
                    "ports": [dict(port) for port in DNS_PORTS],
                },
            ],
        },
    }


def no_agent_image() -> errors.ConfigError:
    return errors.ConfigError(
        "the kubernetes backend needs the agent-injector image, and agent_image is not set",
        hint="set ORCHARD_AGENT_IMAGE (`orchard images build` and `orchard images push` make "
        "it; `orchard deploy` sets it for the orchestrator it deploys)",
    )
