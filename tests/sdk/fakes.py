"""An in-memory Orchard service behind ``httpx.MockTransport``: the SDK's test seam.

It speaks the wire API (paths, JSON shapes, error bodies) for the routes the SDK uses,
keeps every request it saw, and lets a test put ``interceptors`` in front of it to drop,
delay or refuse particular requests. Commands are not run: ``runner`` decides their result.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import httpx

from orchard_env import errors

NOW = datetime(2026, 1, 1, tzinfo=UTC).isoformat()
"""A file's ``modified`` (ISO 8601, as upstream lists files)."""
NOW_EPOCH = datetime(2026, 1, 1, tzinfo=UTC).timestamp()
"""Sandbox and job timestamps travel as epoch seconds."""

Interceptor = Callable[[httpx.Request], httpx.Response | None]


@dataclass
class Ran:
    exit_code: int = 0
    stdout: str = ""
    stderr: str = ""
    status: str | None = None  # default: succeeded / failed from the exit code
    error: str | None = None
    timed_out: bool = False


def default_runner(command: str | list[str]) -> Ran:
    text = command if isinstance(command, str) else " ".join(command)
    if text.startswith("echo "):
        return Ran(stdout=text[5:] + "\n")
    if match := re.fullmatch(r"exit (\d+)", text):
        code = int(match.group(1))
        return Ran(exit_code=code, stderr=f"exiting {code}\n")
    return Ran()


@dataclass
class FakeService:
    sandboxes: dict[str, dict[str, Any]] = field(default_factory=dict)
    deleted: set[str] = field(default_factory=set)  # tombstones: DELETE again answers 200
    jobs: dict[str, dict[str, Any]] = field(default_factory=dict)
    files: dict[tuple[str, str], bytes] = field(default_factory=dict)
    requests: list[httpx.Request] = field(default_factory=list)
    interceptors: list[Interceptor] = field(default_factory=list)
    runner: Callable[[str | list[str]], Ran] = default_runner
    ready_status: str = "ready"
    status_message: str = ""
    running_views: int = 0  # how many times a new job still looks "running" before it is done
    executions: int = 0
    stream_events: list[dict[str, Any]] | None = None
    on_wait: Callable[[float], None] = lambda seconds: None  # a server-side wait that ran out

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    def async_transport(self) -> httpx.MockTransport:
        async def handle(request: httpx.Request) -> httpx.Response:
            await request.aread()  # async bodies (streamed uploads) must be read here
            return self.handle(request)

        return httpx.MockTransport(handle)

    def seen(self, method: str, path: str) -> list[httpx.Request]:
        return [r for r in self.requests if r.method == method and r.url.path == path]

    # --- dispatch ------------------------------------------------------------------------

    def handle(self, request: httpx.Request) -> httpx.Response:
        request.read()
        self.requests.append(request)
        for intercept in list(self.interceptors):
            answer = intercept(request)
            if answer is not None:
                return answer
        try:
            return self._route(request)
        except errors.OrchardError as exc:
            return httpx.Response(exc.http_status, json=exc.to_wire())

    def _route(self, request: httpx.Request) -> httpx.Response:
        method, path = request.method, request.url.path
        parts = path.strip("/").split("/")
        if (method, path) == ("GET", "/health"):
            return httpx.Response(
                200, json={"status": "healthy", "version": "0.1.0", "backend": "fake"}
            )
        if parts[0] == "sandboxes":
            return self._sandboxes(request, method, parts[1:])
        if parts[0] == "jobs":
            return self._jobs(method, parts[1:], request)
        raise errors.NotFound(f"no route {method} {path}")

    def _sandboxes(self, request: httpx.Request, method: str, rest: list[str]) -> httpx.Response:
        if not rest:
            if method == "POST":
                return self._create(json.loads(request.content))
            labels = [v.split("=", 1) for v in request.url.params.get_list("label")]
            found = [
                sb
                for sb in self.sandboxes.values()
                if all(sb["labels"].get(k) == v for k, v in labels)
            ]
            return httpx.Response(200, json={"sandboxes": found})
        sub = "/".join(rest[1:])
        if method == "DELETE" and not sub and rest[0] in self.deleted:
            body = {"status": "deleted", "sandbox_id": rest[0], "already_deleted": True}
            return httpx.Response(200, json=body)
        sandbox = self._sandbox(rest[0])
        if method == "GET" and not sub:
            return httpx.Response(200, json=sandbox)
        if method == "DELETE" and not sub:
            del self.sandboxes[rest[0]]
            self.deleted.add(rest[0])
            return httpx.Response(200, json={"status": "deleted", "sandbox_id": rest[0]})
        if method == "GET" and sub == "wait":
            if sandbox["status"] == "pending":
                self.on_wait(float(request.url.params["timeout"]))
                raise errors.Timeout(f"sandbox {rest[0]} is not ready yet")
            return httpx.Response(200, json=sandbox)
        if method == "POST" and sub == "exec":
            return httpx.Response(200, json=self._exec(rest[0], json.loads(request.content)))
        if method == "POST" and sub == "exec/stream":
            return self._stream(rest[0], json.loads(request.content))
        if method == "POST" and sub == "heartbeat":
            return httpx.Response(
                200, json={"status": "ok", "sandbox_id": rest[0], "expires_at": None}
            )
        if method == "POST" and sub == "apply_patch":
            body = json.loads(request.content)
            ok = body["patch"].startswith("---")
            return httpx.Response(
                200,
                json={
                    "success": ok,
                    "stdout": "",
                    "stderr": "" if ok else "corrupt patch",
                    "exit_code": 0 if ok else 128,
                },
            )
        if sub == "files/raw":
            path = request.url.params["path"]
            if method == "PUT":
                self.files[(rest[0], path)] = request.content
                return httpx.Response(
                    200, json={"success": True, "path": path, "size": len(request.content)}
                )
            if (rest[0], path) not in self.files:
                raise errors.FileNotFound(f"{path} does not exist")
            return httpx.Response(200, content=self.files[(rest[0], path)])
        if method == "GET" and sub == "files/list":
            prefix = request.url.params["path"].rstrip("/") + "/"
            entries = [
                {"name": p[len(prefix) :], "type": "file", "size": len(data), "modified": NOW}
                for (sid, p), data in self.files.items()
                if sid == rest[0] and p.startswith(prefix)
            ]
            return httpx.Response(200, json={"path": request.url.params["path"], "files": entries})
        if method == "DELETE" and sub == "files":
            self.files.pop((rest[0], request.url.params["path"]), None)
            return httpx.Response(200, json={"deleted": request.url.params["path"]})
        if method == "POST" and sub == "files/mkdir":
            return httpx.Response(200, json={"path": json.loads(request.content)["path"]})
        raise errors.NotFound(f"no route {method} /sandboxes/{'/'.join(rest)}")

    def _sandbox(self, sandbox_id: str) -> dict[str, Any]:
        if sandbox_id not in self.sandboxes:
            raise errors.SandboxNotFound(f"sandbox {sandbox_id} not found")
        return self.sandboxes[sandbox_id]

    def _create(self, body: dict[str, Any]) -> httpx.Response:
        sandbox_id = body.get("sandbox_id") or f"sb-{len(self.sandboxes) + len(self.deleted):08x}"
        if sandbox_id in self.sandboxes:
            raise errors.SandboxExists(f"sandbox {sandbox_id} already exists")
        self.deleted.discard(sandbox_id)  # a deleted id can be used again
        self.sandboxes[sandbox_id] = {
            "sandbox_id": sandbox_id,
            "namespace": "local",
            "image": body["image"],
            "pod_name": sandbox_id,
            "block_network": body.get("block_network", True),
            "cpu": str(body.get("cpu", "1")),
            "memory": str(body.get("memory", "2Gi")),
            "created_at": NOW_EPOCH,
            "ready": self.ready_status == "ready",
            "status": self.ready_status,
            "status_message": self.status_message,
            "timeout": body.get("timeout", 3600),
            "labels": body.get("labels", {}),
        }
        return httpx.Response(
            201, json={**self.sandboxes[sandbox_id], "ready": False, "status": "pending"}
        )

    # --- jobs ----------------------------------------------------------------------------

    def _exec(self, sandbox_id: str, body: dict[str, Any]) -> dict[str, Any]:
        job_id = body["job_id"]
        if job_id in self.jobs:  # the server's dedup: never run a job twice
            return self._view(job_id)
        self.executions += 1
        ran = self.runner(body["command"])
        status = ran.status or ("succeeded" if ran.exit_code == 0 else "failed")
        command = body["command"] if isinstance(body["command"], str) else " ".join(body["command"])
        self.jobs[job_id] = {
            "job_id": job_id,
            "sandbox_id": sandbox_id,
            "command": command,
            "status": status,
            "stdout": ran.stdout,
            "stderr": ran.stderr,
            "exit_code": ran.exit_code,
            "created_at": NOW_EPOCH,
            "error": ran.error,
            "timed_out": ran.timed_out,
            "cancelled": False,
            "_views_left": self.running_views,
        }
        if not body.get("wait"):
            return {**self._public(job_id), "status": "queued", "exit_code": None}
        return self._view(job_id)

    def _public(self, job_id: str) -> dict[str, Any]:
        return {k: v for k, v in self.jobs[job_id].items() if not k.startswith("_")}

    def _view(self, job_id: str) -> dict[str, Any]:
        job = self.jobs[job_id]
        if job["_views_left"] > 0:
            job["_views_left"] -= 1
            return {**self._public(job_id), "status": "running", "exit_code": None, "stdout": ""}
        return self._public(job_id)

    def _jobs(self, method: str, rest: list[str], request: httpx.Request) -> httpx.Response:
        if rest[0] not in self.jobs:
            raise errors.JobNotFound(f"job {rest[0]} not found")
        if method == "POST" and rest[1:] == ["cancel"] and self.jobs[rest[0]]["_views_left"]:
            self.jobs[rest[0]].update(
                status="failed", cancelled=True, error="cancelled", exit_code=-15, _views_left=0
            )
        view = self._view(rest[0])
        if rest[1:] == ["wait"] and view["status"] == "running":
            self.on_wait(float(request.url.params["timeout"]))
        return httpx.Response(200, json=view)

    def _stream(self, sandbox_id: str, body: dict[str, Any]) -> httpx.Response:
        job = self._exec(sandbox_id, {**body, "wait": True})
        events = self.stream_events
        if events is None:
            events = [{"event": "started", "job_id": job["job_id"]}]
            events += [
                {"event": name, "job_id": job["job_id"], "data": job[name]}
                for name in ("stdout", "stderr")
                if job[name]
            ]
            events.append({"event": "exit", "job_id": job["job_id"], "job": job})
        lines = "".join(json.dumps(e) + "\n" for e in events)
        return httpx.Response(
            200, content=lines.encode(), headers={"Content-Type": "application/x-ndjson"}
        )
