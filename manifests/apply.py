"""Server-side apply of rendered objects, and waiting for what they start.

Every object is applied with ``PATCH`` as ``application/apply-patch+yaml``, field manager
``orchard`` and ``force=true`` (Orchard owns the fields it sets): applying the same objects
again changes nothing, so a deploy is safe to re-run. Requests go through the ``kubernetes``
client's :class:`ApiClient` (its kubeconfig, TLS and token refresh), not its typed APIs, so
one code path serves every kind.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import quote

from manifests import DEPLOY_MANAGER
from manifests.render import KubeObject
from orchard_env.errors import (
    BackendUnavailable,
    ConfigError,
    Conflict,
    InvalidRequest,
    OrchardError,
    PermissionDenied,
    Timeout,
)
from provision.base import Progress

Action = Literal["created", "configured", "unchanged", "unchecked"]

_PLURALS = {
    "Namespace": "namespaces",
    "ServiceAccount": "serviceaccounts",
    "ConfigMap": "configmaps",
    "Secret": "secrets",
    "PersistentVolumeClaim": "persistentvolumeclaims",
    "Service": "services",
    "Pod": "pods",
    "Deployment": "deployments",
    "DaemonSet": "daemonsets",
    "ClusterRole": "clusterroles",
    "ClusterRoleBinding": "clusterrolebindings",
    "Role": "roles",
    "RoleBinding": "rolebindings",
    "NetworkPolicy": "networkpolicies",
    "PodDisruptionBudget": "poddisruptionbudgets",
}
_CLUSTER_SCOPED = frozenset({"Namespace", "ClusterRole", "ClusterRoleBinding"})
# Fields the server changes on every write or owns: not what a deploy sets.
_VOLATILE_METADATA = ("resourceVersion", "managedFields", "generation", "creationTimestamp", "uid")
REQUEST_TIMEOUT = (10, 60)  # connect, read (seconds)


def collection_path(api_version: str, kind: str, namespace: str | None) -> str:
    prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    plural = _PLURALS[kind]
    if kind in _CLUSTER_SCOPED or namespace is None:
        return f"{prefix}/{plural}"
    return f"{prefix}/namespaces/{quote(namespace)}/{plural}"


def object_path(obj: KubeObject) -> str:
    metadata = obj["metadata"]
    base = collection_path(obj["apiVersion"], obj["kind"], metadata.get("namespace"))
    return f"{base}/{quote(metadata['name'])}"


def display_name(obj: KubeObject) -> str:
    """``kind.group/name``, as kubectl prints it (``deployment.apps/orchard-orchestrator``)."""
    group = obj["apiVersion"].rpartition("/")[0]
    kind = obj["kind"].lower() + (f".{group}" if group else "")
    return f"{kind}/{obj['metadata']['name']}"


def _status_message(body: bytes) -> str:
    try:
        status = json.loads(body)
    except ValueError:
        return body.decode(errors="replace").strip()[:300]
    if isinstance(status, dict) and status.get("message"):
        return str(status["message"])
    return json.dumps(status)[:300]


class KubeApi:
    """JSON requests to the Kubernetes API through a ``kubernetes.client.ApiClient``."""

    def __init__(self, client: Any) -> None:
        if not hasattr(client, "param_serialize"):
            from kubernetes import __version__ as version

            raise ConfigError(
                f"the kubernetes Python client {version} is too old for Orchard",
                hint="upgrade it: pip install --upgrade kubernetes",
            )
        self.client = client

    @property
    def host(self) -> str:
        return str(self.client.configuration.host)

    def request(
        self,
        method: str,
        path: str,
        *,
        query: Sequence[tuple[str, str]] = (),
        body: KubeObject | None = None,
        content_type: str = "application/json",
    ) -> KubeObject | None:
        """The decoded response; ``None`` for a 404 (a GET or DELETE of what does not exist).
        Other failures raise :class:`OrchardError` subclasses naming the server's reason."""
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = content_type
        try:
            request = self.client.param_serialize(
                method=method,
                resource_path=path,
                query_params=list(query),
                header_params=headers,
                body=body,
                auth_settings=["BearerToken"],
            )
            response = self.client.call_api(*request, _request_timeout=REQUEST_TIMEOUT)
            data: bytes = response.read()
        except (HTTPError, OSError, ApiException) as exc:
            reason = getattr(exc, "reason", None) or exc
            raise BackendUnavailable(
                f"cannot reach the Kubernetes API at {self.host}: {reason}",
                hint="check the kubeconfig context (`kubectl cluster-info` uses the same one)",
            ) from exc
        status = int(response.status)
        if status == 404:
            return None
        if status >= 400:
            raise _error(status, method, path, _status_message(data))
        decoded: KubeObject = json.loads(data) if data else {}
        return decoded

    def get(self, path: str, query: Sequence[tuple[str, str]] = ()) -> KubeObject | None:
        return self.request("GET", path, query=query)

    def apply(self, obj: KubeObject, *, dry_run: bool = False) -> KubeObject:
        query = [("fieldManager", DEPLOY_MANAGER), ("force", "true")]
        if dry_run:
            query.append(("dryRun", "All"))
        result = self.request(
            "PATCH",
            object_path(obj),
            query=query,
            body=obj,
            content_type="application/apply-patch+yaml",
        )
        if result is None:  # the object's namespace does not exist
            raise InvalidRequest(
                f"cannot apply {display_name(obj)}: namespace "
                f"{obj['metadata'].get('namespace')} does not exist"
            )
        return result

    def delete(self, path: str) -> KubeObject | None:
        return self.request("DELETE", path, query=[("propagationPolicy", "Background")])


def _error(status: int, method: str, path: str, message: str) -> OrchardError:
    what = f"{method} {path}: {message}"
    if status == 401:
        return PermissionDenied(
            f"the cluster refused the credentials ({what})",
            hint="log in again, or pick another context (--kube-context)",
        )
    if status == 403:
        return PermissionDenied(
            f"the cluster forbids it ({what})",
            hint="deploying needs rights to create namespaces, RBAC objects and workloads "
            "(cluster-admin, or an equivalent role)",
        )
    if status == 409:
        return Conflict(f"conflict: {what}")
    if status in (400, 422):
        return InvalidRequest(f"the cluster rejected it: {what}")
    return BackendUnavailable(f"the Kubernetes API failed ({status}): {what}")


@dataclass(frozen=True)
class Applied:
    """What applying one object did (or, in a dry run, would do)."""

    name: str  # kubectl's kind.group/name
    namespace: str | None
    action: Action

    def __str__(self) -> str:
        where = f" -n {self.namespace}" if self.namespace else ""
        if self.action == "unchecked":
            return f"{self.name}{where} would be created (its namespace does not exist yet)"
        return f"{self.name}{where} {self.action}"


def _comparable(obj: KubeObject) -> KubeObject:
    metadata = {k: v for k, v in obj.get("metadata", {}).items() if k not in _VOLATILE_METADATA}
    return {**{k: v for k, v in obj.items() if k != "status"}, "metadata": metadata}


def apply(
    objects: Iterable[KubeObject],
    *,
    api_client: Any,
    dry_run: bool = False,
    progress: Progress = lambda message: None,
) -> list[Applied]:
    """Server-side apply ``objects`` in order through ``api_client`` (a
    ``kubernetes.client.ApiClient``). ``dry_run`` asks the server to validate and admit each
    one without storing anything (``dryRun=All``); objects in a namespace that would only now
    be created cannot be checked that way and are reported ``unchecked``."""
    api = KubeApi(api_client)
    results: list[Applied] = []
    missing_namespaces: set[str] = set()
    for obj in objects:
        namespace = obj["metadata"].get("namespace")
        if dry_run and namespace in missing_namespaces:
            result = Applied(display_name(obj), namespace, "unchecked")
        else:
            before = api.get(object_path(obj))
            after = api.apply(obj, dry_run=dry_run)
            if before is None:
                action: Action = "created"
                if obj["kind"] == "Namespace":
                    missing_namespaces.add(obj["metadata"]["name"])
            elif _comparable(before) == _comparable(after):
                action = "unchanged"
            else:
                action = "configured"
            result = Applied(display_name(obj), namespace, action)
        results.append(result)
        progress(f"{result}{' (dry run)' if dry_run else ''}")
    return results


# --- waiting ---------------------------------------------------------------------------------


def _poll(
    check: Callable[[], str | None],
    *,
    timeout: float,
    interval: float,
    progress: Progress,
) -> str | None:
    """Call ``check`` until it returns ``None`` (done) or ``timeout`` passes; ``check`` returns
    what is still awaited, which goes to ``progress`` when it changes. The last such text is
    returned if time runs out."""
    deadline = time.monotonic() + timeout
    last = None
    while True:
        waiting = check()
        if waiting is None:
            return None
        if waiting != last:
            progress(waiting)
            last = waiting
        if time.monotonic() >= deadline:
            return waiting
        time.sleep(interval)


def _pod_problems(api: KubeApi, namespace: str, selector: str) -> list[str]:
    """Why the selected pods are not ready, one line each (scheduling, image pulls, crashes)."""
    pods = api.get(collection_path("v1", "Pod", namespace), [("labelSelector", selector)]) or {}
    problems = []
    for pod in pods.get("items", []):
        name = pod["metadata"]["name"]
        status = pod.get("status", {})
        for condition in status.get("conditions", []):
            if condition.get("type") == "PodScheduled" and condition.get("status") == "False":
                problems.append(f"pod {name}: not scheduled: {condition.get('message', '')}")
        statuses = status.get("initContainerStatuses", []) + status.get("containerStatuses", [])
        for container in statuses:
            state = container.get("state", {})
            waiting = state.get("waiting") or {}
            if waiting.get("reason") and waiting["reason"] != "ContainerCreating":
                detail = f": {waiting['message']}" if waiting.get("message") else ""
                problems.append(f"pod {name}: {container['name']} {waiting['reason']}{detail}")
            last = (container.get("lastState") or {}).get("terminated")
            if last and not container.get("ready"):
                problems.append(
                    f"pod {name}: {container['name']} exited {last.get('exitCode')} "
                    f"({last.get('reason', 'error')}), restarted {container.get('restartCount')}x"
                )
    return problems


def _rollout_state(deployment: KubeObject | None, name: str) -> str | None:
    if deployment is None:
        raise InvalidRequest(f"deployment {name} does not exist")
    spec, status = deployment.get("spec", {}), deployment.get("status", {})
    for condition in status.get("conditions", []):
        if condition.get("type") == "Progressing" and (
            condition.get("reason") == "ProgressDeadlineExceeded"
        ):
            raise Timeout(f"deployment {name} is not progressing: {condition.get('message')}")
    generation = deployment.get("metadata", {}).get("generation", 0)
    if status.get("observedGeneration", 0) < generation:
        return f"deployment {name}: waiting for the controller"
    wanted = spec.get("replicas", 1)
    updated = status.get("updatedReplicas", 0)
    available = status.get("availableReplicas", 0)
    total = status.get("replicas", 0)
    if updated < wanted or total > updated or available < updated:
        return f"deployment {name}: {updated}/{wanted} updated, {available} available"
    return None


def wait_rollout(
    api_client: Any,
    namespace: str,
    name: str,
    *,
    selector: str,
    timeout: float = 300,
    interval: float = 2,
    progress: Progress = lambda message: None,
) -> None:
    """Wait until the Deployment's pods all run its current spec and are available (what
    ``kubectl rollout status`` waits for). A timeout says why the pods are not ready."""
    api = KubeApi(api_client)
    path = collection_path("apps/v1", "Deployment", namespace) + f"/{quote(name)}"

    def check() -> str | None:
        state = _rollout_state(api.get(path), name)
        if state is None:
            return None
        return "; ".join([state, *_pod_problems(api, namespace, selector)])

    left = _poll(check, timeout=timeout, interval=interval, progress=progress)
    if left is not None:
        raise Timeout(
            f"deployment {name} in {namespace} did not become ready in {timeout:.0f} s: {left}",
            hint=f"`kubectl -n {namespace} describe pods -l {selector}` shows more",
        )


def wait_load_balancer(
    api_client: Any,
    namespace: str,
    name: str,
    *,
    timeout: float = 300,
    interval: float = 3,
    progress: Progress = lambda message: None,
) -> str:
    """The public address (IP or host name) the cloud gave a LoadBalancer Service."""
    api = KubeApi(api_client)
    path = collection_path("v1", "Service", namespace) + f"/{quote(name)}"
    address: list[str] = []

    def check() -> str | None:
        service = api.get(path) or {}
        for ingress in service.get("status", {}).get("loadBalancer", {}).get("ingress", []):
            found = ingress.get("ip") or ingress.get("hostname")
            if found:
                address.append(found)
                return None
        return f"service {name}: waiting for a load balancer address"

    if _poll(check, timeout=timeout, interval=interval, progress=progress) is not None:
        raise Timeout(
            f"service {name} in {namespace} got no load balancer address in {timeout:.0f} s",
            hint=f"`kubectl -n {namespace} describe service {name}` shows the cloud's events",
        )
    return address[0]


def wait_deleted(
    api_client: Any,
    paths: Sequence[str],
    *,
    timeout: float = 600,
    interval: float = 3,
    progress: Progress = lambda message: None,
) -> None:
    """Wait until every object in ``paths`` is gone (a namespace takes its contents first)."""
    api = KubeApi(api_client)

    def check() -> str | None:
        left = [path.rsplit("/", 1)[-1] for path in paths if api.get(path) is not None]
        return f"waiting for {', '.join(left)} to be deleted" if left else None

    left = _poll(check, timeout=timeout, interval=interval, progress=progress)
    if left is not None:
        raise Timeout(f"{left.removeprefix('waiting for ')}: still there after {timeout:.0f} s")
