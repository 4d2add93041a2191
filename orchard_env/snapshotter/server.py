"""The snapshotter's HTTP API (stdlib ``http.server``, one thread per request).

``GET /healthz`` -> ``{"ok": true}`` (no token). ``POST /snapshot`` with
``Authorization: Bearer <token>`` and ``{"container_id", "base_image", "target"}`` ->
``{"ref", "digest", "size_bytes", "frozen"}``; errors answer the orchestrator's error shape
``{"detail": {"code", "message", "hint"}}`` with the error's HTTP status.

Settings (environment): ``ORCHARD_SNAPSHOTTER_TOKEN_FILE`` (required: the Secret-mounted
token the orchestrator sends), ``ORCHARD_SNAPSHOTTER_PORT`` (9091),
``ORCHARD_SNAPSHOTTER_TARGET_PREFIX`` (required: pushes go only under it, e.g.
``myacr.azurecr.io/orchard/snapshots:``), ``ORCHARD_REGISTRY_CONFIG`` (a docker config JSON with
the registry credentials), ``ORCHARD_SNAPSHOTTER_PLAIN_HTTP`` (comma-separated registries spoken
to over plain HTTP; tests only).
"""

from __future__ import annotations

import hmac
import json
import logging
import os
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from orchard_env import errors
from orchard_env.snapshotter.registry import RegistryClient, load_credentials
from orchard_env.snapshotter.snapshot import take_snapshot

logger = logging.getLogger(__name__)

DEFAULT_PORT = 9091
_MAX_BODY = 64 * 1024


@dataclass(frozen=True)
class SnapshotterSettings:
    token: str
    target_prefix: str
    credentials: dict[str, tuple[str, str]]
    plain_http: frozenset[str] = frozenset()
    host: str = "0.0.0.0"
    port: int = DEFAULT_PORT
    proc: Path = Path("/proc")
    cgroup_root: Path = Path("/sys/fs/cgroup")

    @classmethod
    def from_env(cls, env: dict[str, str]) -> SnapshotterSettings:
        missing = [
            name
            for name in ("ORCHARD_SNAPSHOTTER_TOKEN_FILE", "ORCHARD_SNAPSHOTTER_TARGET_PREFIX")
            if not env.get(name)
        ]
        if missing:
            raise errors.ConfigError(f"the snapshotter needs {', '.join(missing)}")
        token_file = Path(env["ORCHARD_SNAPSHOTTER_TOKEN_FILE"])
        try:
            token = token_file.read_text().strip()
        except OSError as exc:
            raise errors.ConfigError(
                f"cannot read the snapshotter token {token_file}: {exc}"
            ) from exc
        if not token:
            raise errors.ConfigError(f"the snapshotter token file {token_file} is empty")
        config = env.get("ORCHARD_REGISTRY_CONFIG")
        try:
            port = int(env.get("ORCHARD_SNAPSHOTTER_PORT", DEFAULT_PORT))
        except ValueError as exc:
            raise errors.ConfigError("ORCHARD_SNAPSHOTTER_PORT must be a port number") from exc
        return cls(
            token=token,
            target_prefix=env["ORCHARD_SNAPSHOTTER_TARGET_PREFIX"],
            credentials=load_credentials(Path(config) if config else None),
            plain_http=frozenset(
                h.strip()
                for h in env.get("ORCHARD_SNAPSHOTTER_PLAIN_HTTP", "").split(",")
                if h.strip()
            ),
            port=port,
        )


class _Handler(BaseHTTPRequestHandler):
    server: SnapshotterServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:
        logger.info("%s %s", self.address_string(), format % args)

    def _answer(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _fail(self, exc: errors.OrchardError) -> None:
        self._answer(exc.http_status, exc.to_wire())

    def do_GET(self) -> None:
        if self.path == "/healthz":
            self._answer(200, {"ok": True})
        else:
            self._fail(errors.NotFound(f"no such endpoint {self.path}"))

    def do_POST(self) -> None:
        try:
            self._answer(200, self._snapshot())
        except errors.OrchardError as exc:
            self._fail(exc)
        except Exception:
            logger.exception("snapshot failed")
            self._fail(errors.OrchardError("the snapshot failed; the snapshotter's log says why"))

    def _snapshot(self) -> dict[str, Any]:
        if self.path != "/snapshot":
            raise errors.NotFound(f"no such endpoint {self.path}")
        settings = self.server.settings
        sent = self.headers.get("Authorization", "")
        if not hmac.compare_digest(sent.encode(), f"Bearer {settings.token}".encode()):
            raise errors.AuthenticationRequired("a valid snapshotter token is required")
        length = int(self.headers.get("Content-Length") or 0)
        if length > _MAX_BODY:
            raise errors.InvalidRequest("request body too large")
        try:
            body = json.loads(self.rfile.read(length))
            container_id = body["container_id"]
            base_image, target = body["base_image"], body["target"]
        except (ValueError, KeyError, TypeError) as exc:
            raise errors.InvalidRequest(
                "the body must be JSON with container_id, base_image and target"
            ) from exc
        if not all(isinstance(v, str) for v in (container_id, base_image, target)):
            raise errors.InvalidRequest("container_id, base_image and target must be strings")
        if not target.startswith(settings.target_prefix):
            raise errors.PermissionDenied(
                f"target {target!r} is outside {settings.target_prefix!r}, where this "
                "snapshotter may push"
            )
        with RegistryClient(
            credentials=settings.credentials, plain_http=settings.plain_http
        ) as client:
            result = take_snapshot(
                client,
                container_id=container_id,
                base_image=base_image,
                target=target,
                proc=settings.proc,
                cgroup_root=settings.cgroup_root,
            )
        return result.to_json()


class SnapshotterServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, settings: SnapshotterSettings) -> None:
        super().__init__((settings.host, settings.port), _Handler)
        self.settings = settings


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        server = SnapshotterServer(SnapshotterSettings.from_env(dict(os.environ)))
    except errors.OrchardError as exc:
        logger.error("%s", exc.message)
        raise SystemExit(2) from exc
    logger.info("snapshotter listening on %s:%s", *server.server_address[:2])
    server.serve_forever()
