"""A fake OCI registry over real HTTP on 127.0.0.1, enough for the snapshotter and Podman.

Implements the distribution API endpoints push and pull use: ``GET /v2/``, blobs (HEAD, GET,
POST upload sessions with cross-repository ``mount``, PATCH chunks, PUT to finish), manifests
(HEAD, GET, PUT by tag or digest, DELETE by digest), behind a token challenge: every ``/v2/``
request needs ``Authorization: Bearer <token>``, which ``GET /token`` hands out for Basic
``user:password`` credentials (a 401 with ``WWW-Authenticate: Bearer realm=...`` otherwise).
Digests are checked like a real registry does.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import secrets
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

USER = "snap"
PASSWORD = "s3cret"


@dataclass
class RegistryState:
    blobs: dict[str, bytes] = field(default_factory=dict)
    # (repository, tag or digest) -> (body, media type)
    manifests: dict[tuple[str, str], tuple[bytes, str]] = field(default_factory=dict)
    repo_blobs: set[tuple[str, str]] = field(default_factory=set)
    uploads: dict[str, bytearray] = field(default_factory=dict)
    tokens: set[str] = field(default_factory=set)
    allow_mount: bool = True
    allow_delete: bool = True
    mounts: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


_BLOB = re.compile(r"^/v2/(?P<repo>.+)/blobs/(?P<digest>sha256:[0-9a-f]{64})$")
_UPLOADS = re.compile(r"^/v2/(?P<repo>.+)/blobs/uploads/(?P<uuid>[0-9a-f]*)$")
_MANIFEST = re.compile(r"^/v2/(?P<repo>.+)/manifests/(?P<ref>[^/]+)$")


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


class _Handler(BaseHTTPRequestHandler):
    server: FakeRegistry
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:
        return

    # -- plumbing ------------------------------------------------------------------------
    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = bytearray()
            while True:
                size = int(self.rfile.readline().strip().split(b";")[0], 16)
                if size == 0:
                    self.rfile.readline()
                    return bytes(out)
                out += self.rfile.read(size)
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Docker-Distribution-API-Version", "registry/2.0")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _error(self, status: int, code: str, message: str) -> None:
        body = json.dumps({"errors": [{"code": code, "message": message}]}).encode()
        self._send(status, body, {"Content-Type": "application/json"})

    def _authorised(self) -> bool:
        header = self.headers.get("Authorization", "")
        if header.startswith("Bearer ") and header[7:] in self.server.state.tokens:
            return True
        self._error(401, "UNAUTHORIZED", "authentication required")
        return False

    def _challenge_headers(self) -> dict[str, str]:
        host, port = self.server.server_address[:2]
        return {"WWW-Authenticate": f'Bearer realm="http://{host}:{port}/token",service="fake"'}

    def send_response(self, code: int, message: str | None = None) -> None:
        super().send_response(code, message)
        if code == 401:
            for key, value in self._challenge_headers().items():
                self.send_header(key, value)

    # -- dispatch ------------------------------------------------------------------------
    def _dispatch(self) -> None:
        url = urlsplit(self.path)
        query = {k: v[0] for k, v in parse_qs(url.query).items()}
        path = url.path
        if path == "/token":
            self._token()
            return
        if not path.startswith("/v2/"):
            self._error(404, "NOT_FOUND", path)
            return
        if not self._authorised():
            return
        state = self.server.state
        if path == "/v2/":
            self._send(200, b"{}", {"Content-Type": "application/json"})
            return
        with state.lock:
            if m := _UPLOADS.match(path):
                self._uploads(m["repo"], m["uuid"], query)
            elif m := _BLOB.match(path):
                self._blob(m["repo"], m["digest"])
            elif m := _MANIFEST.match(path):
                self._manifest(m["repo"], m["ref"])
            else:
                self._error(404, "NOT_FOUND", path)

    do_GET = do_HEAD = do_POST = do_PUT = do_PATCH = do_DELETE = _dispatch

    def _token(self) -> None:
        header = self.headers.get("Authorization", "")
        expected = base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
        if header != f"Basic {expected}":
            self._error(401, "UNAUTHORIZED", "bad credentials")
            return
        token = secrets.token_hex(16)
        self.server.state.tokens.add(token)
        self._send(200, json.dumps({"token": token}).encode(), {"Content-Type": "application/json"})

    def _blob(self, repo: str, digest: str) -> None:
        state = self.server.state
        if self.command not in ("GET", "HEAD"):
            self._error(405, "UNSUPPORTED", self.command)
        elif (repo, digest) not in state.repo_blobs:
            self._error(404, "BLOB_UNKNOWN", digest)
        else:
            data = state.blobs[digest]
            headers = {"Docker-Content-Digest": digest, "Content-Type": "application/octet-stream"}
            self.send_response(200)
            for key, value in headers.items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command == "GET":
                self.wfile.write(data)

    def _uploads(self, repo: str, uuid: str, query: dict[str, str]) -> None:
        state = self.server.state
        location = f"/v2/{repo}/blobs/uploads/"
        if self.command == "POST" and not uuid:
            self._body()
            mount, source = query.get("mount"), query.get("from")
            if mount and source and state.allow_mount and (source, mount) in state.repo_blobs:
                state.repo_blobs.add((repo, mount))
                state.mounts += 1
                self._send(201, headers={"Location": f"/v2/{repo}/blobs/{mount}"})
                return
            new = secrets.token_hex(8)
            state.uploads[new] = bytearray()
            self._send(202, headers={"Location": location + new, "Range": "0-0"})
            return
        if uuid not in state.uploads:
            self._error(404, "BLOB_UPLOAD_UNKNOWN", uuid)
            return
        state.uploads[uuid] += self._body()
        if self.command == "PATCH":
            end = max(len(state.uploads[uuid]) - 1, 0)
            self._send(202, headers={"Location": location + uuid, "Range": f"0-{end}"})
            return
        if self.command != "PUT":
            self._error(405, "UNSUPPORTED", self.command)
            return
        data = bytes(state.uploads.pop(uuid))
        digest = query.get("digest", "")
        if _digest(data) != digest:
            self._error(400, "DIGEST_INVALID", f"{digest} does not match the upload")
            return
        state.blobs[digest] = data
        state.repo_blobs.add((repo, digest))
        self._send(
            201, headers={"Location": f"/v2/{repo}/blobs/{digest}", "Docker-Content-Digest": digest}
        )

    def _manifest(self, repo: str, ref: str) -> None:
        state = self.server.state
        if self.command == "PUT":
            body = self._body()
            media_type = self.headers.get("Content-Type", "")
            manifest = json.loads(body)
            missing = [
                d["digest"]
                for d in [manifest.get("config", {}), *manifest.get("layers", [])]
                if d and (repo, d["digest"]) not in state.repo_blobs
            ]
            if missing:
                self._error(400, "MANIFEST_BLOB_UNKNOWN", ", ".join(missing))
                return
            digest = _digest(body)
            state.manifests[(repo, ref)] = (body, media_type)
            state.manifests[(repo, digest)] = (body, media_type)
            self._send(
                201,
                headers={
                    "Docker-Content-Digest": digest,
                    "Location": f"/v2/{repo}/manifests/{digest}",
                },
            )
            return
        if self.command == "DELETE":
            if not state.allow_delete:
                self._error(405, "UNSUPPORTED", "deletes are disabled")
                return
            if not ref.startswith("sha256:"):
                self._error(400, "UNSUPPORTED", "delete by digest")
                return
            gone = [
                key
                for key, value in state.manifests.items()
                if key[0] == repo and _digest(value[0]) == ref
            ]
            for key in gone:
                del state.manifests[key]
            self._send(202 if gone else 404)
            return
        found = state.manifests.get((repo, ref))
        if found is None:
            self._error(404, "MANIFEST_UNKNOWN", f"{repo}:{ref}")
            return
        body, media_type = found
        headers = {"Content-Type": media_type, "Docker-Content-Digest": _digest(body)}
        self.send_response(200)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command == "GET":
            self.wfile.write(body)


class FakeRegistry(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.state = RegistryState()
        self._thread = threading.Thread(target=self.serve_forever, args=(0.05,), daemon=True)

    @property
    def host(self) -> str:
        host, port = self.server_address[:2]
        return f"{host}:{port}"

    def start(self) -> FakeRegistry:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.shutdown()
        self.server_close()
        self._thread.join()
