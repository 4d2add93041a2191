"""`orchard deploy` and `orchard undeploy`: an Orchard service on a Kubernetes cluster.

A deploy renders the profile's objects, server-side applies them (idempotent: re-running it
changes only what changed) and waits for the rollout. Its first admin API key is generated
here, stored only in the ``orchard-bootstrap-key`` Secret (the orchestrator imports it at
start) and kept on every later deploy; the key travels back in :class:`DeployResult` so the
CLI can write a context, and is never logged or printed.
"""

from __future__ import annotations

import base64
import binascii
import os
import secrets
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from manifests import (
    BOOTSTRAP_SECRET,
    BOOTSTRAP_SECRET_KEY,
    COMMON_LABELS,
    INSTANCE_LABEL,
    ORCHESTRATOR,
    ORCHESTRATOR_LABEL,
    PUBLIC_SERVICE,
    REDIS,
    REDIS_SECRET,
    SERVICE,
    SNAPSHOTTER_SECRET,
    snapshotter_namespace,
)
from manifests.apply import (
    Applied,
    KubeApi,
    apply,
    collection_path,
    wait_deleted,
    wait_load_balancer,
    wait_rollout,
)
from manifests.render import DeployValues, nodes_role_name, render, values_from_profile
from orchard_env.errors import BackendUnavailable, ConfigError
from provision.base import Progress
from provision.profile import DeploymentProfile

LOCAL_PORT = 8000
MANAGED_BY = "app.kubernetes.io/managed-by"


@dataclass(frozen=True)
class DeployResult:
    endpoint: str  # the URL clients use (for a port-forward: the local end)
    api_key: str | None  # the admin key, to put in a CLI context; never print it
    namespace: str
    applied: tuple[Applied, ...] = ()
    key_created: bool = False  # a new key was generated (else the existing one was kept)
    port_forward: str | None = None  # the command that makes `endpoint` reachable, if needed


def new_api_key() -> str:
    """A key in the orchestrator's format (``ork_<key id>_<secret>``)."""
    return f"ork_{secrets.token_hex(5)}_{secrets.token_urlsafe(32)}"


def port_forward_command(
    namespace: str,
    *,
    kubeconfig: str | Path | None = None,
    context: str | None = None,
    local_port: int = LOCAL_PORT,
) -> str:
    """The kubectl command that serves the in-cluster orchestrator on 127.0.0.1:``local_port``."""
    argv = ["kubectl", "-n", namespace, "port-forward", f"svc/{SERVICE}", f"{local_port}:80"]
    if kubeconfig:
        argv += ["--kubeconfig", str(kubeconfig)]
    if context:
        argv += ["--context", context]
    return shlex.join(argv)


def connect(kubeconfig: str | Path | None = None, context: str | None = None) -> Any:
    """A ``kubernetes.client.ApiClient`` for ``context`` of ``kubeconfig`` (default:
    ``KUBECONFIG``, then ``~/.kube/config``; its current context)."""
    from kubernetes import config as kube_config
    from kubernetes.config.config_exception import ConfigException

    if kubeconfig:
        path = str(Path(kubeconfig).expanduser())
        if not Path(path).is_file():
            raise ConfigError(
                f"kubeconfig {path} does not exist",
                hint="pass --kubeconfig, set kubeconfig.path in the profile, or set KUBECONFIG",
            )
    else:  # read now: the client reads KUBECONFIG once, when it is first imported
        path = os.environ.get("KUBECONFIG") or str(Path.home() / ".kube" / "config")
    try:
        return kube_config.new_client_from_config(  # type: ignore[no-untyped-call]
            config_file=path, context=context, persist_config=False
        )
    except ConfigException as exc:
        raise ConfigError(
            f"cannot use kubeconfig {path}: {exc}",
            hint="`kubectl config get-contexts` lists the contexts; pick one with --kube-context",
        ) from exc


def _cluster(profile: DeploymentProfile, kubeconfig: str | Path | None, context: str | None) -> Any:
    return connect(kubeconfig or profile.kubeconfig.path, context or profile.kubeconfig.context)


def _check_namespaces(api: KubeApi, values: DeployValues) -> list[str]:
    """The deployment's namespaces that exist. Refuses a namespace Orchard did not create
    (or that another deployment owns): a deploy would relabel it, an undeploy delete it."""
    existing = []
    for namespace in (values.namespace, values.sandbox_namespace, values.snapshotter_namespace):
        found = api.get(collection_path("v1", "Namespace", None) + f"/{namespace}")
        if found is None:
            continue
        labels = found.get("metadata", {}).get("labels", {})
        if labels.get(MANAGED_BY) != COMMON_LABELS[MANAGED_BY]:
            raise ConfigError(
                f"namespace {namespace} exists and was not created by orchard deploy",
                hint="choose other namespaces in the profile (service.namespace, "
                "service.sandbox_namespace)",
            )
        owner = labels.get(INSTANCE_LABEL)
        if owner != values.name:
            raise ConfigError(
                f"namespace {namespace} belongs to the Orchard deployment {owner!r}, "
                f"not {values.name!r}",
                hint="use that deployment's profile, or choose other namespaces",
            )
        existing.append(namespace)
    return existing


def _secret_values(api: KubeApi, namespace: str, name: str) -> dict[str, str]:
    found = api.get(collection_path("v1", "Secret", namespace) + f"/{name}") or {}
    values = {}
    for key, encoded in (found.get("data") or {}).items():
        try:
            values[key] = base64.b64decode(encoded, validate=True).decode()
        except (binascii.Error, UnicodeDecodeError):
            continue
    return values


def _with_secrets(api: KubeApi, values: DeployValues) -> tuple[DeployValues, bool]:
    """``values`` with the deployment's secrets: the ones in the cluster if it has them,
    else new ones. Returns whether the API key is new."""
    from orchard_env.orchestrator.keys import KEY_RE

    stored = _secret_values(api, values.namespace, BOOTSTRAP_SECRET).get(BOOTSTRAP_SECRET_KEY)
    key_created = stored is None or KEY_RE.match(stored) is None
    api_key = new_api_key() if key_created or stored is None else stored
    password = None
    if values.redis:
        password = _secret_values(api, values.namespace, REDIS_SECRET).get("password")
        password = password or secrets.token_urlsafe(32)
    snapshotter_token = None
    if values.snapshots:
        stored_token = _secret_values(api, values.namespace, SNAPSHOTTER_SECRET).get("token")
        snapshotter_token = stored_token or secrets.token_urlsafe(32)
    return (
        replace(
            values,
            api_key=api_key,
            redis_password=password,
            snapshotter_token=snapshotter_token,
        ),
        key_created,
    )


def dry_run(
    profile: DeploymentProfile,
    refs: Mapping[str, str],
    *,
    kubeconfig: str | Path | None = None,
    context: str | None = None,
    progress: Progress = lambda message: None,
) -> list[Applied]:
    """Server-side dry run of a deploy: the cluster validates and admits every object and
    says what would change; nothing is stored, no key is made. Without a usable kubeconfig or
    a reachable cluster it raises :class:`BackendUnavailable`."""
    values = values_from_profile(profile, refs)
    try:
        client = _cluster(profile, kubeconfig, context)
    except ConfigError as exc:
        raise BackendUnavailable(f"no cluster to ask: {exc.message}", hint=exc.hint) from exc
    try:
        api = KubeApi(client)
        _check_namespaces(api, values)
        values, _ = _with_secrets(api, values)
        return apply(render(values), api_client=client, dry_run=True, progress=progress)
    finally:
        client.close()


def deploy(
    profile: DeploymentProfile,
    refs: Mapping[str, str],
    *,
    kubeconfig: str | Path | None = None,
    context: str | None = None,
    progress: Progress = lambda message: None,
    timeout: float = 300,
    interval: float = 2,
) -> DeployResult:
    """Deploy (or update) the profile's Orchard service with the images in ``refs`` (keys
    ``orchestrator`` and ``agent-injector``) and wait until it serves."""
    values = values_from_profile(profile, refs)
    client = _cluster(profile, kubeconfig, context)
    try:
        api = KubeApi(client)
        progress(f"connected to {api.host}")
        _check_namespaces(api, values)
        values, key_created = _with_secrets(api, values)
        applied = apply(render(values), api_client=client, progress=progress)
        waits = [(REDIS, f"app.kubernetes.io/name={REDIS}")] if values.redis else []
        waits.append((ORCHESTRATOR, "=".join(ORCHESTRATOR_LABEL)))
        for name, selector in waits:
            wait_rollout(
                client,
                values.namespace,
                name,
                selector=selector,
                timeout=timeout,
                interval=interval,
                progress=progress,
            )
        port_forward = None
        if values.load_balancer:
            address = wait_load_balancer(
                client,
                values.namespace,
                PUBLIC_SERVICE,
                timeout=timeout,
                interval=interval,
                progress=progress,
            )
            endpoint = f"http://{address}"
        else:
            endpoint = f"http://127.0.0.1:{LOCAL_PORT}"
            port_forward = port_forward_command(
                values.namespace,
                kubeconfig=kubeconfig or profile.kubeconfig.path,
                context=context or profile.kubeconfig.context,
            )
    finally:
        client.close()
    return DeployResult(
        endpoint=endpoint,
        api_key=values.api_key,
        namespace=values.namespace,
        applied=tuple(applied),
        key_created=key_created,
        port_forward=port_forward,
    )


def undeploy(
    profile: DeploymentProfile,
    *,
    kubeconfig: str | Path | None = None,
    context: str | None = None,
    progress: Progress = lambda message: None,
    timeout: float = 600,
    interval: float = 3,
) -> list[str]:
    """Delete the deployment's namespaces: the service, its state and every sandbox. Returns
    the namespaces deleted (none if already gone). Refuses namespaces Orchard did not create."""
    service = profile.service
    values = DeployValues(
        orchestrator_image="",
        agent_image="",
        name=profile.name,
        namespace=service.namespace,
        sandbox_namespace=service.sandbox_namespace,
        snapshotter_namespace=snapshotter_namespace(service.namespace),
    )
    client = _cluster(profile, kubeconfig, context)
    try:
        api = KubeApi(client)
        existing = _check_namespaces(api, values)
        # Sandboxes first, so none outlives the orchestrator that would clean it up.
        paths = [
            collection_path("v1", "Namespace", None) + f"/{namespace}"
            for namespace in sorted(existing, key=lambda ns: ns != values.sandbox_namespace)
        ]
        for path in paths:
            progress(f"deleting namespace {path.rsplit('/', 1)[-1]}")
            api.delete(path)
        wait_deleted(client, paths, timeout=timeout, interval=interval, progress=progress)
        # The cluster-scoped objects outlive the namespaces: delete them too (only ours).
        role = nodes_role_name(values.namespace)
        for kind in ("ClusterRoleBinding", "ClusterRole"):
            path = collection_path("rbac.authorization.k8s.io/v1", kind, None) + f"/{role}"
            found = api.get(path)
            labels = (found or {}).get("metadata", {}).get("labels", {})
            if labels.get(MANAGED_BY) == COMMON_LABELS[MANAGED_BY]:
                progress(f"deleting {kind.lower()} {role}")
                api.delete(path)
    finally:
        client.close()
    return [path.rsplit("/", 1)[-1] for path in paths]
