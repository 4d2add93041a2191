"""A small stateful fake of the Kubernetes API, over real HTTP, for `orchard deploy`.

It serves what the deploy code uses, as the API server does: server-side apply (``PATCH`` with
``application/apply-patch+yaml``, ``fieldManager``, ``force``, ``dryRun=All``), ``GET`` of
objects and of pod lists by label selector, and ``DELETE`` (namespaces terminate for a few
polls, then disappear with everything in them; other objects go at once). Two controllers
are simulated: a Deployment becomes available a few ``GET``s after its spec changes, and a
LoadBalancer Service gets an address. Requests need the bearer token of the kubeconfig
:meth:`FakeKube.kubeconfig` writes. Not simulated: field ownership between several
managers, admission, validation.
"""

from __future__ import annotations

import base64
import copy
import itertools
import json
import re
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import yaml

TOKEN = "fake-token"
_OBJECT = re.compile(
    r"^/(?:api/v1|apis/(?P<group>[^/]+)/(?P<version>[^/]+))"
    r"(?:/namespaces/(?P<namespace>[^/]+))?/(?P<plural>[^/]+)(?:/(?P<name>[^/]+))?$"
)


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, str]
    content_type: str | None
    body: Any


@dataclass
class FakeKube:
    """The cluster's state, readable and changeable by tests (hold ``lock`` while changing)."""

    objects: dict[str, dict[str, Any]] = field(default_factory=dict)  # by object path
    requests: list[Request] = field(default_factory=list)
    rollout_polls: int = 2  # GETs of a changed Deployment before it is available
    load_balancer_address: str | None = "203.0.113.10"
    load_balancer_polls: int = 2  # GETs of a new LoadBalancer Service before it has an address
    delete_polls: int = 1  # GETs of a deleted namespace while it terminates
    forbidden: set[str] = field(default_factory=set)  # paths that answer 403
    lock: threading.Lock = field(default_factory=threading.Lock)
    _versions: Iterator[int] = field(default_factory=lambda: itertools.count(1))
    _pending: dict[str, int] = field(default_factory=dict)
    url: str = ""

    def kubeconfig(self, path: Path, *, token: str = TOKEN) -> Path:
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "fake", "user": {"token": token}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
            "current-context": "fake",
        }
        path.write_text(yaml.safe_dump(config))
        return path

    def get(self, path: str) -> dict[str, Any] | None:
        with self.lock:
            return copy.deepcopy(self.objects.get(path))

    def kinds(self) -> list[str]:
        with self.lock:
            return [f"{obj['kind']}/{obj['metadata']['name']}" for obj in self.objects.values()]

    # --- the API ---------------------------------------------------------------------------

    def handle(self, request: Request) -> tuple[int, dict[str, Any]]:
        with self.lock:
            self.requests.append(request)
            if request.path in self.forbidden:
                return _status(403, "Forbidden", f"{request.method} {request.path} is forbidden")
            match = _OBJECT.match(request.path)
            if match is None:
                return _status(404, "NotFound", f"no route {request.path}")
            if match["name"] is None:
                if request.method != "GET":
                    return _status(405, "MethodNotAllowed", request.method)
                return 200, self._list(request, match["namespace"], match["plural"])
            if request.method == "GET":
                return self._get(request.path)
            if request.method == "PATCH":
                return self._apply(request, match["namespace"], match["plural"])
            if request.method == "DELETE":
                return self._delete(request.path, match["plural"])
            return _status(405, "MethodNotAllowed", request.method)

    def _list(self, request: Request, namespace: str | None, plural: str) -> dict[str, Any]:
        selector = dict(
            part.split("=", 1) for part in request.query.get("labelSelector", "").split(",") if part
        )
        items = []
        for path, obj in self.objects.items():
            if f"/{plural}/" not in path:
                continue
            if namespace is not None and obj["metadata"].get("namespace") != namespace:
                continue
            labels = obj["metadata"].get("labels", {})
            if all(labels.get(key) == value for key, value in selector.items()):
                items.append(copy.deepcopy(obj))
        return {"kind": "List", "apiVersion": "v1", "items": items}

    def _get(self, path: str) -> tuple[int, dict[str, Any]]:
        obj = self.objects.get(path)
        if obj is None:
            return _status(404, "NotFound", f"{path} not found")
        if path in self._pending:
            self._pending[path] -= 1
            if self._pending[path] <= 0:
                del self._pending[path]
                self._finish(path, obj)
        return 200, copy.deepcopy(obj)

    def _finish(self, path: str, obj: dict[str, Any]) -> None:
        """What a controller would have done by now."""
        if obj["kind"] == "Namespace":
            prefix = path.replace("/api/v1/namespaces/", "/namespaces/") + "/"
            for other in [p for p in self.objects if prefix in p]:
                del self.objects[other]
            del self.objects[path]
        elif obj["kind"] == "Deployment":
            replicas = obj["spec"].get("replicas", 1)
            obj["status"] = {
                "observedGeneration": obj["metadata"]["generation"],
                "replicas": replicas,
                "updatedReplicas": replicas,
                "readyReplicas": replicas,
                "availableReplicas": replicas,
            }
        elif obj["kind"] == "Service" and self.load_balancer_address:
            obj["status"] = {"loadBalancer": {"ingress": [{"ip": self.load_balancer_address}]}}

    def _apply(
        self, request: Request, namespace: str | None, plural: str
    ) -> tuple[int, dict[str, Any]]:
        if request.content_type != "application/apply-patch+yaml":
            return _status(415, "UnsupportedMediaType", f"{request.content_type} is not apply")
        if not request.query.get("fieldManager"):
            return _status(400, "BadRequest", "fieldManager is required for apply")
        if namespace is not None and f"/api/v1/namespaces/{namespace}" not in self.objects:
            return _status(404, "NotFound", f'namespaces "{namespace}" not found')
        body = copy.deepcopy(request.body)
        if body["metadata"]["name"] != request.path.rsplit("/", 1)[1]:
            return _status(400, "BadRequest", "the name in the body does not match the URL")
        if body["kind"] == "Secret" and "stringData" in body:
            data = body.setdefault("data", {})
            for key, value in body.pop("stringData").items():
                data[key] = base64.b64encode(value.encode()).decode()
        if body["kind"] == "Namespace":  # the API server sets this label on every namespace
            labels = body["metadata"].setdefault("labels", {})
            labels["kubernetes.io/metadata.name"] = body["metadata"]["name"]
        existing = self.objects.get(request.path)
        spec_changed = existing is None or _content(existing) != _content(body)
        metadata = body["metadata"]
        if existing is None:
            metadata["uid"] = str(uuid.uuid4())
            metadata["creationTimestamp"] = "2024-01-01T00:00:00Z"
            metadata["generation"] = 1
            metadata["resourceVersion"] = str(next(self._versions))
        else:
            old = existing["metadata"]
            for key in ("uid", "creationTimestamp", "generation", "resourceVersion"):
                metadata[key] = old[key]
            if spec_changed:
                metadata["generation"] = old["generation"] + 1
                metadata["resourceVersion"] = str(next(self._versions))
            if "status" in existing:
                body["status"] = existing["status"]
        metadata["managedFields"] = [
            {"manager": request.query["fieldManager"], "operation": "Apply"}
        ]
        if body["kind"] == "Namespace":
            body["status"] = {"phase": "Active"}
        if request.query.get("dryRun") == "All":
            return 200, body
        self.objects[request.path] = body
        if spec_changed and body["kind"] == "Deployment":
            self._pending[request.path] = self.rollout_polls
            body["status"] = {
                "observedGeneration": metadata["generation"],
                "replicas": body["spec"].get("replicas", 1),
                "updatedReplicas": 0,
                "availableReplicas": 0,
            }
        if spec_changed and body["kind"] == "Service" and body["spec"]["type"] == "LoadBalancer":
            self._pending[request.path] = self.load_balancer_polls
        return (201 if existing is None else 200), copy.deepcopy(body)

    def _delete(self, path: str, plural: str) -> tuple[int, dict[str, Any]]:
        obj = self.objects.get(path)
        if obj is None:
            return _status(404, "NotFound", f"{path} not found")
        if plural != "namespaces":  # other objects go at once (no finalizers here)
            del self.objects[path]
            return 200, copy.deepcopy(obj)
        obj["metadata"]["deletionTimestamp"] = "2024-01-01T00:00:00Z"
        obj["status"] = {"phase": "Terminating"}
        self._pending[path] = self.delete_polls
        if self.delete_polls <= 0:
            self._finish(path, obj)
        return 200, copy.deepcopy(obj)


def _content(obj: dict[str, Any]) -> Any:
    metadata = {
        k: v
        for k, v in obj["metadata"].items()
        if k not in ("uid", "creationTimestamp", "generation", "resourceVersion", "managedFields")
    }
    return {**{k: v for k, v in obj.items() if k != "status"}, "metadata": metadata}


def _status(code: int, reason: str, message: str) -> tuple[int, dict[str, Any]]:
    return code, {
        "kind": "Status",
        "apiVersion": "v1",
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


class _Handler(BaseHTTPRequestHandler):
    fake: FakeKube

    def _serve(self) -> None:
        if self.headers.get("Authorization") != f"Bearer {TOKEN}":
            self._send(*_status(401, "Unauthorized", "Unauthorized"))
            return
        split = urlsplit(self.path)
        query = {key: values[-1] for key, values in parse_qs(split.query).items()}
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        request = Request(
            method=self.command,
            path=unquote(split.path),
            query=query,
            content_type=self.headers.get("Content-Type"),
            body=yaml.safe_load(raw) if raw else None,  # JSON is YAML
        )
        self._send(*self.fake.handle(request))

    def _send(self, code: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_PATCH = do_DELETE = do_POST = do_PUT = _serve

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        return


@dataclass
class RunningFake:
    fake: FakeKube
    server: ThreadingHTTPServer
    thread: threading.Thread

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


def start_fake(fake: FakeKube | None = None) -> RunningFake:
    fake = fake or FakeKube()
    handler = type("Handler", (_Handler,), {"fake": fake})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    fake.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.02}, name="kube-fake", daemon=True
    )
    thread.start()
    return RunningFake(fake, server, thread)
