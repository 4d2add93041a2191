"""A stateful fake Kubernetes API server over real HTTP, and a fake kubelet for it.

:class:`FakeKubeApi` serves the part of the Kubernetes REST API the backend uses, on
127.0.0.1, to the real ``kubernetes`` client (through a kubeconfig it writes):

* nodes (``GET /api/v1/nodes``, label selectors; tests set :attr:`FakeKubeApi.nodes`), under
  the ClusterRole of that rbac.yaml;
* pods, secrets (``/api/v1``) and networkpolicies (``/apis/networking.k8s.io/v1``) in its
  namespaces: create, get, list (``labelSelector``), delete (``preconditions.uid``), and for
  pods watch streams (chunked JSON lines) from a ``resourceVersion``, with bookmarks when the
  watch's ``timeoutSeconds`` runs out;
* what a real API server checks that the backend could get wrong: a bearer token (401), the
  orchestrator's Role from ``manifests/base/sandboxes/rbac.yaml`` (403 for any other verb),
  the namespace (404), name conflicts (409), object names, label syntax and the object's
  schema (strict ``kubernetes-validate`` for the oldest and newest supported versions: 422);
* the garbage collector's part: deleting a pod deletes the objects it owns.

Deletes are immediate (the backend only deletes with a grace period of 0). Tests change the
world behind the backend's back with :meth:`FakeKubeApi.set_pod_status`,
:meth:`FakeKubeApi.delete`, :meth:`FakeKubeApi.expire_watches` (410 Gone for every watch and
for any resourceVersion seen so far) and :meth:`FakeKubeApi.drop_watches` (connections cut).

:class:`FakeKubelet` plays the scheduler and the kubelet: it schedules each new pod (or
reports it Unschedulable when it asks for more CPU than the node has), "pulls" its images
(:data:`MISSING_IMAGE` fails like a registry without it), and runs the real agent
(``orchard_env.agent.daemon``) as a host process listening on the pod's IP — a distinct
loopback address per pod — and the agent port, so what the backend reports as the agent
endpoint really answers.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import parse_qs, urlsplit

import kubernetes_validate
import yaml

import manifests
from tests.orchestrator.fakes import HOST_AGENT

TOKEN = "fake-cluster-token"
USER = "system:serviceaccount:orchard:orchard-orchestrator"
MISSING_IMAGE = "registry.example/missing:1"
CRASH_IMAGE = "registry.example/crash:1"
NODE = "aks-sandbox-0"
# Validated on every create; tests/orchestrator/backends/test_kubernetes.py covers the rest.
VALIDATE_VERSIONS = (
    manifests.SUPPORTED_KUBERNETES_VERSIONS[0],
    manifests.SUPPORTED_KUBERNETES_VERSIONS[-1],
)
RBAC_FILE = Path(manifests.__file__).parent / "base" / "sandboxes" / "rbac.yaml"
SNAPSHOTTER_RBAC_FILE = Path(manifests.__file__).parent / "base" / "snapshotter" / "rbac.yaml"

KINDS = {
    "pods": ("v1", "Pod"),
    "secrets": ("v1", "Secret"),
    "networkpolicies": ("networking.k8s.io/v1", "NetworkPolicy"),
}
_PATH = re.compile(
    r"^/(?:api/v1|apis/networking\.k8s\.io/v1)/namespaces/(?P<ns>[^/]+)/(?P<resource>[^/]+)"
    r"(?:/(?P<name>[^/]+))?$"
)
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_LABEL_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")

Obj = dict[str, Any]


def role_rules(path: Path = RBAC_FILE, kind: str = "Role") -> dict[str, set[str]]:
    """resource -> verbs, from the Role `orchard deploy` installs (in the sandbox namespace by
    default), or from the ClusterRole beside it (``kind="ClusterRole"``)."""
    rules: dict[str, set[str]] = {}
    for document in yaml.safe_load_all(path.read_text()):
        if document and document.get("kind") == kind:
            for rule in document["rules"]:
                for resource in rule["resources"]:
                    rules.setdefault(resource, set()).update(rule["verbs"])
    return rules


def node(name: str, labels: dict[str, str], capacity: Obj, allocatable: Obj) -> Obj:
    """A Node object as the API server lists it (what a kubelet reports)."""
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": labels, "uid": str(uuid.uuid4())},
        "status": {"capacity": capacity, "allocatable": allocatable},
    }


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _status(code: int, reason: str, message: str) -> Obj:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


def _matches(labels: dict[str, str], selector: str) -> bool:
    """Equality-based label selectors: ``k=v``, ``k==v``, ``k!=v``, ``k``."""
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key) == value:
                return False
        elif "=" in term:
            key, value = term.replace("==", "=").split("=", 1)
            if labels.get(key) != value:
                return False
        elif term not in labels:
            return False
    return True


def _label_problems(labels: dict[str, str]) -> list[str]:
    problems = []
    for key, value in labels.items():
        prefix, _, name = key.rpartition("/")
        if (prefix and not _NAME.match(prefix)) or not _LABEL_NAME.match(name):
            problems.append(f"metadata.labels: Invalid value: {key!r}: invalid label key")
        if not _LABEL_VALUE.match(value):
            problems.append(f"metadata.labels: Invalid value: {value!r}: invalid label value")
    return problems


class ApiError(Exception):
    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.status = _status(code, reason, message)


@dataclass
class _Event:
    resource_version: int
    resource: str
    namespace: str
    type: str
    obj: Obj


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, str]


@dataclass
class FakeKubeApi:
    namespaces: tuple[str, ...] = ("orchard-sandboxes",)
    validate_versions: tuple[str, ...] = VALIDATE_VERSIONS
    requests: list[Request] = field(default_factory=list)
    # resource -> hook run (outside the lock) before an object of it is stored; may raise
    # ApiError, or block to hold the create back.
    before_create: dict[str, Callable[[Obj], None]] = field(default_factory=dict)
    # Called (outside the lock) after each create and delete: (verb, resource, object).
    listeners: list[Callable[[str, str, Obj], None]] = field(default_factory=list)
    # Watch requests wait while it is clear (tests hold reconnections back with it).
    watch_gate: threading.Event = field(default_factory=threading.Event)
    # Namespace -> the rbac.yaml whose Role the orchestrator has there (default: RBAC_FILE's).
    namespace_rbac: dict[str, Path] = field(default_factory=dict)
    # Cluster-scoped Nodes by name (``GET /api/v1/nodes``, under the ClusterRole's rules).
    nodes: dict[str, Obj] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.watch_gate.set()
        self.rules = role_rules()
        self.cluster_rules = role_rules(kind="ClusterRole")
        self.namespace_rules = {ns: role_rules(path) for ns, path in self.namespace_rbac.items()}
        self._objects: dict[tuple[str, str, str], Obj] = {}
        self._events: list[_Event] = []
        self._revision = 1
        self._compacted = 0  # watches from at or below this resourceVersion get 410 Gone
        self._expired = 0  # bumped by expire_watches: open watches end with 410
        self._dropped = 0  # bumped by drop_watches: open watches are cut
        self._closing = False
        self.watches_streaming = 0  # watches that got past their resourceVersion check
        self._changed = threading.Condition()
        self._connections: set[socket.socket] = set()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        )
        self._thread.start()

    # --- for tests --------------------------------------------------------------------------

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def write_kubeconfig(self, path: Path, context: str = "fake") -> Path:
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "orchestrator", "user": {"token": TOKEN}}],
            "contexts": [{"name": context, "context": {"cluster": "fake", "user": "orchestrator"}}],
            "current-context": context,
        }
        path.write_text(yaml.safe_dump(config))
        return path

    def get(self, resource: str, namespace: str, name: str) -> Obj | None:
        with self._changed:
            obj = self._objects.get((resource, namespace, name))
            return copy.deepcopy(obj) if obj is not None else None

    def names(self, resource: str, namespace: str) -> list[str]:
        with self._changed:
            return sorted(n for (r, ns, n) in self._objects if r == resource and ns == namespace)

    def calls(self, method: str, resource: str, *, watch: bool | None = None) -> list[Request]:
        found = [
            r
            for r in self.requests
            if r.method == method and f"/{resource}" in r.path.rsplit("/namespaces/", 1)[-1]
        ]
        if watch is not None:
            found = [r for r in found if (r.query.get("watch") == "true") == watch]
        return found

    def set_pod_status(
        self, namespace: str, name: str, status: Obj, *, node: str | None = None
    ) -> Obj:
        """Replace a pod's status (what the kubelet does), and bind it to ``node`` (what the
        scheduler does), as one MODIFIED event."""
        with self._changed:
            pod = self._objects[("pods", namespace, name)]
            pod["status"] = copy.deepcopy(status)
            if node is not None:
                pod["spec"]["nodeName"] = node
            self._record("pods", namespace, "MODIFIED", pod)
            return copy.deepcopy(pod)

    def create(self, resource: str, namespace: str, obj: Obj) -> Obj:
        """Create an object as another client would (no auth, no validation)."""
        with self._changed:
            return self._store(resource, namespace, copy.deepcopy(obj))

    def delete(self, resource: str, namespace: str, name: str) -> None:
        """Delete an object as another client would (its dependents go too)."""
        deleted = self._delete(resource, namespace, name, None)
        for listener in self.listeners:
            listener("delete", resource, deleted)

    def expire_watches(self) -> None:
        """Compact the history: open watches end with a 410 Gone ERROR event, and a watch
        from any resourceVersion seen so far is refused with one."""
        with self._changed:
            self._compacted = self._revision
            self._expired += 1
            self._changed.notify_all()

    def drop_watches(self) -> None:
        """Cut every open watch connection without ending its stream."""
        with self._changed:
            self._dropped += 1
            self._changed.notify_all()

    def close(self) -> None:
        with self._changed:
            self._closing = True
            self._changed.notify_all()
        self.watch_gate.set()
        self._server.shutdown()
        for connection in list(self._connections):
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)
        self._server.server_close()
        self._thread.join()

    # --- the store (call with the lock held) --------------------------------------------------

    def _record(self, resource: str, namespace: str, kind: str, obj: Obj) -> None:
        self._revision += 1
        obj["metadata"]["resourceVersion"] = str(self._revision)
        self._events.append(_Event(self._revision, resource, namespace, kind, copy.deepcopy(obj)))
        self._changed.notify_all()

    def _store(self, resource: str, namespace: str, obj: Obj) -> Obj:
        metadata = obj.setdefault("metadata", {})
        name = metadata.get("name", "")
        if (resource, namespace, name) in self._objects:
            raise ApiError(409, "AlreadyExists", f'{resource} "{name}" already exists')
        metadata.update(namespace=namespace, uid=str(uuid.uuid4()), creationTimestamp=_now())
        metadata["managedFields"] = [
            {"manager": "orchard", "operation": "Update", "apiVersion": "v1", "time": _now()}
        ]
        if resource == "pods":
            obj["status"] = {"phase": "Pending", "qosClass": "Guaranteed"}
        self._objects[(resource, namespace, name)] = obj
        self._record(resource, namespace, "ADDED", obj)
        return copy.deepcopy(obj)

    def _delete(self, resource: str, namespace: str, name: str, uid: str | None) -> Obj:
        with self._changed:
            obj = self._objects.get((resource, namespace, name))
            if obj is None:
                raise ApiError(404, "NotFound", f'{resource} "{name}" not found')
            if uid is not None and obj["metadata"]["uid"] != uid:
                raise ApiError(
                    409,
                    "Conflict",
                    f'Operation cannot be fulfilled on {resource} "{name}": Precondition '
                    f"failed: UID in precondition: {uid}, UID in object meta: "
                    f"{obj['metadata']['uid']}",
                )
            del self._objects[(resource, namespace, name)]
            obj["metadata"]["deletionTimestamp"] = _now()
            self._record(resource, namespace, "DELETED", obj)
            owner = obj["metadata"]["uid"]
            for key, dependent in list(self._objects.items()):
                references = dependent["metadata"].get("ownerReferences") or []
                if any(ref.get("uid") == owner for ref in references):
                    del self._objects[key]
                    self._record(key[0], key[1], "DELETED", dependent)
            return copy.deepcopy(obj)

    # --- HTTP -------------------------------------------------------------------------------

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            timeout = 60

            def setup(self) -> None:
                super().setup()
                api._connections.add(self.connection)

            def finish(self) -> None:
                api._connections.discard(self.connection)
                with contextlib.suppress(OSError):
                    super().finish()

            def log_message(self, format: str, *args: Any) -> None:
                """Quiet."""

            def do_GET(self) -> None:
                self._serve("GET")

            def do_POST(self) -> None:
                self._serve("POST")

            def do_DELETE(self) -> None:
                self._serve("DELETE")

            def do_PATCH(self) -> None:
                self._serve("PATCH")

            def do_PUT(self) -> None:
                self._serve("PUT")

            def _serve(self, method: str) -> None:
                url = urlsplit(self.path)
                query = {k: v[-1] for k, v in parse_qs(url.query).items()}
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                api.requests.append(Request(method, url.path, query))
                try:
                    if method == "GET" and query.get("watch") in ("true", "1"):
                        api._authorize(self.headers, url.path, "watch")
                        api.watch_gate.wait()
                        api._watch(self, url.path, query)
                    else:
                        code, answer = api._answer(method, url.path, query, body, self.headers)
                        self._send_json(code, answer)
                except ApiError as exc:
                    self._send_json(exc.status["code"], exc.status)

            def _send_json(self, code: int, obj: Obj) -> None:
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        return Handler

    def _authorize(self, headers: Any, path: str, verb: str) -> tuple[str, str, str | None]:
        if headers.get("Authorization") != f"Bearer {TOKEN}":
            raise ApiError(401, "Unauthorized", "Unauthorized")
        match = _PATH.match(path)
        if match is None or match["resource"] not in KINDS:
            raise ApiError(
                404, "NotFound", f"the server could not find the requested resource {path}"
            )
        namespace, resource, name = match["ns"], match["resource"], match["name"]
        if verb not in self.namespace_rules.get(namespace, self.rules).get(resource, set()):
            group = "networking.k8s.io" if resource == "networkpolicies" else ""
            raise ApiError(
                403,
                "Forbidden",
                f'{resource} is forbidden: User "{USER}" cannot {verb} resource "{resource}" '
                f'in API group "{group}" in the namespace "{namespace}"',
            )
        if namespace not in self.namespaces:
            raise ApiError(404, "NotFound", f'namespaces "{namespace}" not found')
        return namespace, resource, name

    def _nodes(self, method: str, query: dict[str, str], headers: Any) -> tuple[int, Obj]:
        if headers.get("Authorization") != f"Bearer {TOKEN}":
            raise ApiError(401, "Unauthorized", "Unauthorized")
        if method != "GET" or "list" not in self.cluster_rules.get("nodes", set()):
            raise ApiError(
                403,
                "Forbidden",
                f'nodes is forbidden: User "{USER}" cannot {method.lower()} resource "nodes" '
                'in API group "" at the cluster scope',
            )
        selector = query.get("labelSelector", "")
        with self._changed:
            items = [
                copy.deepcopy(obj)
                for _, obj in sorted(self.nodes.items())
                if _matches(obj["metadata"].get("labels") or {}, selector)
            ]
            version = str(self._revision)
        return 200, {
            "apiVersion": "v1",
            "kind": "NodeList",
            "metadata": {"resourceVersion": version},
            "items": items,
        }

    def _answer(
        self, method: str, path: str, query: dict[str, str], body: Any, headers: Any
    ) -> tuple[int, Obj]:
        if path == "/api/v1/nodes":
            return self._nodes(method, query, headers)
        match = _PATH.match(path)
        has_name = match is not None and match["name"] is not None
        verb = {
            ("GET", True): "get",
            ("GET", False): "list",
            ("POST", False): "create",
            ("DELETE", True): "delete",
            ("PATCH", True): "patch",
            ("PUT", True): "update",
        }.get((method, has_name), "unsupported")
        namespace, resource, name = self._authorize(headers, path, verb)
        if verb == "create":
            return 201, self._create(resource, namespace, body)
        if verb == "get":
            found = self.get(resource, namespace, name or "")
            if found is None:
                raise ApiError(404, "NotFound", f'{resource} "{name}" not found')
            return 200, found
        if verb == "list":
            selector = query.get("labelSelector", "")
            with self._changed:
                items = [
                    copy.deepcopy(obj)
                    for (r, ns, _), obj in sorted(self._objects.items())
                    if r == resource
                    and ns == namespace
                    and _matches(obj["metadata"].get("labels") or {}, selector)
                ]
                version = str(self._revision)
            api_version, kind = KINDS[resource]
            return 200, {
                "apiVersion": api_version,
                "kind": f"{kind}List",
                "metadata": {"resourceVersion": version},
                "items": items,
            }
        if verb == "delete":
            uid = ((body or {}).get("preconditions") or {}).get("uid")
            deleted = self._delete(resource, namespace, name or "", uid)
            for listener in self.listeners:
                listener("delete", resource, deleted)
            return 200, deleted
        raise ApiError(405, "MethodNotAllowed", f"{method} is not supported by this fake")

    def _create(self, resource: str, namespace: str, body: Any) -> Obj:
        api_version, kind = KINDS[resource]
        if not isinstance(body, dict) or body.get("kind") != kind:
            raise ApiError(400, "BadRequest", f"expected a {kind}")
        if body.get("apiVersion") != api_version:
            raise ApiError(400, "BadRequest", f"{kind} must be apiVersion {api_version}")
        metadata = body.get("metadata") or {}
        name = metadata.get("name") or ""
        problems = [] if _NAME.match(name) and len(name) <= 253 else [f"metadata.name: {name!r}"]
        if metadata.get("namespace") not in (None, namespace):
            problems.append("metadata.namespace: does not match the request's namespace")
        problems += _label_problems(metadata.get("labels") or {})
        for version in self.validate_versions:
            try:
                kubernetes_validate.validate(body, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                problems.append(f"{version}: {exc.message}")
        if problems:
            raise ApiError(422, "Invalid", f'{kind} "{name}" is invalid: ' + "; ".join(problems))
        hook = self.before_create.get(resource)
        if hook is not None:
            hook(body)
        with self._changed:
            created = self._store(resource, namespace, copy.deepcopy(body))
        for listener in self.listeners:
            listener("create", resource, created)
        return created

    def _watch(self, handler: BaseHTTPRequestHandler, path: str, query: dict[str, str]) -> None:
        match = _PATH.match(path)
        assert match is not None and match["resource"] == "pods", "only pods are watched"
        namespace, selector = match["ns"], query.get("labelSelector", "")
        since = int(query.get("resourceVersion") or 0)
        timeout = float(query.get("timeoutSeconds") or 1800)
        bookmarks = query.get("allowWatchBookmarks") == "true"
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Transfer-Encoding", "chunked")
        handler.end_headers()

        def send(event: Obj) -> None:
            data = json.dumps(event).encode() + b"\n"
            handler.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            handler.wfile.flush()

        gone = _status(410, "Expired", f"too old resource version: {since} ({self._compacted})")
        with self._changed:
            expired, dropped = self._expired, self._dropped
            position = next(
                (i for i, e in enumerate(self._events) if e.resource_version > since),
                len(self._events),
            )
            deadline = threading.Event()
            timer = threading.Timer(timeout, self._wake_all, args=(deadline,))
        timer.start()
        try:
            if since < self._compacted:
                send({"type": "ERROR", "object": gone})
                handler.wfile.write(b"0\r\n\r\n")
                return
            with self._changed:
                self.watches_streaming += 1
            while True:
                with self._changed:
                    while (
                        position >= len(self._events)
                        and not self._closing
                        and not deadline.is_set()
                        and self._expired == expired
                        and self._dropped == dropped
                    ):
                        self._changed.wait()
                    pending = self._events[position:]
                    position = len(self._events)
                    state = (self._closing, self._expired != expired, self._dropped != dropped)
                    revision = self._revision
                closing, expiring, dropping = state
                if dropping or closing:
                    handler.close_connection = True
                    with contextlib.suppress(OSError):
                        handler.connection.shutdown(socket.SHUT_RDWR)
                    return
                for event in pending:
                    labels = event.obj["metadata"].get("labels") or {}
                    if (
                        event.resource == "pods"
                        and event.namespace == namespace
                        and _matches(labels, selector)
                    ):
                        send({"type": event.type, "object": event.obj})
                if expiring:
                    send({"type": "ERROR", "object": gone})
                    break
                if deadline.is_set():
                    if bookmarks:
                        send(
                            {
                                "type": "BOOKMARK",
                                "object": {
                                    "kind": "Pod",
                                    "apiVersion": "v1",
                                    "metadata": {"resourceVersion": str(revision)},
                                },
                            }
                        )
                    break
            handler.wfile.write(b"0\r\n\r\n")
        except OSError:
            handler.close_connection = True  # the client went away
        finally:
            timer.cancel()

    def _wake_all(self, flag: threading.Event) -> None:
        with self._changed:
            flag.set()
            self._changed.notify_all()


# --- the kubelet ------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _waiting(name: str, reason: str, message: str | None = None) -> Obj:
    waiting = {"reason": reason} if message is None else {"reason": reason, "message": message}
    return {"name": name, "ready": False, "restartCount": 0, "state": {"waiting": waiting}}


@dataclass
class _Running:
    process: subprocess.Popen[bytes] | None
    root: Path


class PodApi(Protocol):
    """What the FakeKubelet needs of an API server: this fake's, or the real one's
    (:class:`tests.orchestrator.backends.kube_real.NodePods`)."""

    listeners: list[Callable[[str, str, Obj], None]]

    def get(self, resource: str, namespace: str, name: str) -> Obj | None: ...

    def names(self, resource: str, namespace: str) -> list[str]: ...

    def set_pod_status(
        self, namespace: str, name: str, status: Obj, *, node: str | None = None
    ) -> Obj | None: ...


@dataclass
class FakeKubelet:
    """Schedules and "runs" every pod created on ``api`` in ``namespace``, in a thread. On
    the real API server (``kube_real`` tier) the scheduler has bound the pod before the
    FakeKubelet sees it: ``node_cpu`` is then unbounded and the binding is left alone."""

    api: PodApi
    agent_port: int
    node_cpu: float = 8.0
    namespace: str = "orchard-sandboxes"
    missing_images: set[str] = field(default_factory=lambda: {MISSING_IMAGE})
    # Pod name -> fields the runtime reports in its running main container's status
    # (containerID, imageID: what the snapshot tests point at a real container).
    main_status: dict[str, Obj] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._work: queue.Queue[tuple[str, str] | None] = queue.Queue()
        self._running: dict[str, _Running] = {}
        self._lock = threading.Lock()
        self._next_ip = 2
        self.root = Path(tempfile.mkdtemp(prefix="kubelet-"))
        self.api.listeners.append(self._on_change)
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    # --- for tests --------------------------------------------------------------------------

    def grow(self, cpu: float) -> None:
        """A node joins (the cluster autoscaler): pending pods are scheduled again."""
        self.node_cpu += cpu
        for name in self.api.names("pods", self.namespace):
            pod = self.api.get("pods", self.namespace, name)
            if pod is not None and "nodeName" not in pod["spec"]:
                self._work.put(("start", name))

    def terminate(self, name: str, *, exit_code: int = 137, reason: str = "OOMKilled") -> None:
        """The sandbox container dies on its own (its agent process is killed)."""
        with self._lock:
            running = self._running.pop(name, None)
        if running is not None:
            self._stop(running)
        pod = self.api.get("pods", self.namespace, name)
        assert pod is not None
        status = pod["status"]
        status["phase"] = "Failed"
        status["containerStatuses"] = [
            {
                "name": "sandbox",
                "ready": False,
                "restartCount": 0,
                "state": {"terminated": {"exitCode": exit_code, "reason": reason}},
            }
        ]
        self.api.set_pod_status(self.namespace, name, status)

    def agent_root(self, name: str) -> Path:
        return self.root / name

    def close(self) -> None:
        self._work.put(None)
        self._thread.join()
        with self._lock:
            running = list(self._running.values())
            self._running.clear()
        for each in running:
            self._stop(each)
        shutil.rmtree(self.root, ignore_errors=True)

    # --- the loop -----------------------------------------------------------------------------

    def _on_change(self, verb: str, resource: str, obj: Obj) -> None:
        if resource == "pods" and obj["metadata"]["namespace"] == self.namespace:
            self._work.put(("start" if verb == "create" else "stop", obj["metadata"]["name"]))

    def _loop(self) -> None:
        while (item := self._work.get()) is not None:
            action, name = item
            if action == "stop":
                with self._lock:
                    running = self._running.pop(name, None)
                if running is not None:
                    self._stop(running)
                continue
            with contextlib.suppress(KeyError):  # deleted meanwhile
                self._start(name)

    def _status(self, name: str, status: Obj) -> None:
        self.api.set_pod_status(self.namespace, name, status)

    def _start(self, name: str) -> None:
        pod = self.api.get("pods", self.namespace, name)
        if pod is None:
            return
        spec = pod["spec"]
        main = spec["containers"][0]
        init = spec["initContainers"][0]
        cpu = float(main["resources"]["requests"]["cpu"].rstrip("m")) / 1000
        if cpu > self.node_cpu:  # one node: it fits or it does not
            self._status(
                name,
                {
                    "phase": "Pending",
                    "conditions": [
                        {
                            "type": "PodScheduled",
                            "status": "False",
                            "reason": "Unschedulable",
                            "message": "0/1 nodes are available: 1 Insufficient cpu. "
                            "preemption: 0/1 nodes are available: 1 No preemption victims "
                            "found for incoming pod.",
                        }
                    ],
                },
            )
            return
        with self._lock:
            ip = f"127.0.0.{self._next_ip}"
            self._next_ip += 1
        scheduled = {"type": "PodScheduled", "status": "True"}
        base: Obj = {"phase": "Pending", "conditions": [scheduled], "hostIP": "10.224.0.4"}
        self.api.set_pod_status(self.namespace, name, base, node=NODE)
        if init["image"] in self.missing_images or main["image"] in self.missing_images:
            failing = init if init["image"] in self.missing_images else main
            image = failing["image"]
            message = (
                f'Failed to pull image "{image}": rpc error: code = NotFound desc = failed to '
                f'pull and unpack image "{image}": failed to resolve reference "{image}": '
                f"{image}: not found"
            )
            waiting = _waiting(failing["name"], "ErrImagePull", message)
            statuses: Obj = {"initContainerStatuses": [waiting]}
            if failing is main:
                done = {"terminated": {"exitCode": 0, "reason": "Completed"}}
                statuses = {
                    "initContainerStatuses": [
                        {"name": init["name"], "ready": True, "restartCount": 0, "state": done}
                    ],
                    "containerStatuses": [waiting],
                }
            self._status(name, {**base, "podIP": ip, **statuses})
            return
        command = main["command"]
        listen = f"tcp:0.0.0.0:{self.agent_port}"
        if command[-2:] != ["--listen", listen]:
            raise AssertionError(f"the pod's command does not end in --listen {listen}: {command}")
        root = self.agent_root(name)
        (root / "workspace").mkdir(parents=True)
        process = None
        if main["image"] != CRASH_IMAGE:
            env = {e["name"]: e["value"] for e in main["env"] if "value" in e}
            env.update(
                PATH=os.environ.get("PATH", "/usr/bin:/bin"),
                HOME=str(root),
                ORCHARD_AGENT_WORKDIR=str(root / "workspace"),
            )
            process = subprocess.Popen(
                [
                    *HOST_AGENT,
                    "--listen",
                    f"tcp:{ip}:{self.agent_port}",
                ],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        with self._lock:
            self._running[name] = _Running(process, root)
        if self.api.get("pods", self.namespace, name) is None:  # deleted while starting
            with self._lock:
                running = self._running.pop(name, None)
            if running is not None:
                self._stop(running)
            return
        done = {"terminated": {"exitCode": 0, "reason": "Completed"}}
        init_status = {"name": init["name"], "ready": True, "restartCount": 0, "state": done}
        if process is None:
            state = {
                "terminated": {
                    "exitCode": 1,
                    "reason": "Error",
                    "message": "agent: cannot start: exec format error",
                }
            }
            phase = "Failed"
        else:
            state = {"running": {"startedAt": _now()}}
            phase = "Running"
        self._status(
            name,
            {
                **base,
                "phase": phase,
                "podIP": ip,
                "podIPs": [{"ip": ip}],
                "initContainerStatuses": [init_status],
                "containerStatuses": [
                    {
                        "name": main["name"],
                        "ready": False,
                        "restartCount": 0,
                        "state": state,
                        **(self.main_status.get(name, {}) if phase == "Running" else {}),
                    }
                ],
            },
        )

    @staticmethod
    def _stop(running: _Running) -> None:
        process = running.process
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        shutil.rmtree(running.root, ignore_errors=True)


@contextlib.contextmanager
def fake_cluster(
    tmp_path: Path, **api_options: Any
) -> Iterator[tuple[FakeKubeApi, FakeKubelet, Path]]:
    """A fake API server and kubelet, and a kubeconfig for them; all stopped at the end."""
    api = FakeKubeApi(**api_options)
    kubelet = FakeKubelet(api, agent_port=free_port())
    try:
        yield api, kubelet, api.write_kubeconfig(tmp_path / "kubeconfig")
    finally:
        kubelet.close()
        api.close()
