"""One model call as it is recorded (``orchard.model_call/v1``): built while the gateway
forwards it, redacted, bounded, then stored with the sandbox's records."""

from __future__ import annotations

import functools
import hashlib
import json
import secrets
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from orchard_env.orchestrator.gateway.assemble import assemble, parse_sse, usage_of

SCHEMA = "orchard.model_call/v1"
MAX_RECORDED_BYTES = 8 * 1024 * 1024  # per body; beyond, the record says truncated
SECRET_HEADERS = frozenset(
    {"authorization", "x-api-key", "api-key", "cookie", "set-cookie", "proxy-authorization"}
)
REDACTED = "<redacted>"


def redact(headers: list[tuple[str, str]]) -> dict[str, str]:
    out: dict[str, str] = {}
    for name, value in headers:
        shown = REDACTED if name in SECRET_HEADERS else value
        out[name] = f"{out[name]}, {shown}" if name in out else shown
    return out


def _parsed(raw: bytes) -> Any:
    if not raw:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return raw[:MAX_RECORDED_BYTES].decode("utf-8", "replace")


@dataclass
class Call:
    sandbox_id: str
    trajectory_id: str
    seq: int
    method: str
    path: str
    api: str
    request_headers: list[tuple[str, str]]
    request_body: bytes
    upstream: str | None = None
    started: float = field(default_factory=time.monotonic)
    started_at: datetime = field(default_factory=lambda: datetime.now(UTC))
    ttfb: float | None = None
    status: int | None = None
    error: str | None = None
    response_headers: list[tuple[str, str]] = field(default_factory=list)
    response_parts: list[bytes] = field(default_factory=list)
    response_size: int = 0

    @functools.cached_property
    def request_json(self) -> Any:
        """The request body parsed (once; the upstream body may be derived from it)."""
        if len(self.request_body) > MAX_RECORDED_BYTES:
            return None  # over the record's bound: kept as its hash and size only
        return _parsed(self.request_body)

    def kind(self, body: Any) -> str:
        """``main``: a call offering tools (the agent's turn); ``aux``: titles, probes."""
        return "main" if isinstance(body, dict) and body.get("tools") else "aux"

    def first_byte(self) -> None:
        if self.ttfb is None:
            self.ttfb = time.monotonic() - self.started

    def keep(self, chunk: bytes) -> None:
        if self.response_size < MAX_RECORDED_BYTES:
            self.response_parts.append(chunk[: MAX_RECORDED_BYTES - self.response_size])
        self.response_size += len(chunk)

    def record(self) -> dict[str, Any]:
        ended = time.monotonic()
        raw = b"".join(self.response_parts)
        content_type = next((v for k, v in self.response_headers if k == "content-type"), "")
        stream = content_type.startswith("text/event-stream")
        events = parse_sse(raw) if stream else None
        body = assemble(self.api, events or []) if stream else _parsed(raw)
        request = self.request_json
        model = request.get("model") if isinstance(request, dict) else None
        headers = dict(self.request_headers)
        return {
            "schema": SCHEMA,
            "call_id": "call-" + secrets.token_hex(8),
            "sandbox_id": self.sandbox_id,
            "trajectory_id": self.trajectory_id,
            "seq": self.seq,
            "kind": self.kind(request),
            "api": self.api,
            "method": self.method,
            "path": self.path,
            "upstream": self.upstream,
            "status": self.status,
            "error": self.error,
            "started_at": self.started_at.isoformat(),
            "ended_at": datetime.now(UTC).isoformat(),
            "latency_ms": round((ended - self.started) * 1000, 3),
            "ttfb_ms": None if self.ttfb is None else round(self.ttfb * 1000, 3),
            "model": model if isinstance(model, str) else None,
            "served_model": body.get("model") if isinstance(body, dict) else None,
            "harness": headers.get("user-agent") or headers.get("originator"),
            "harness_session_id": headers.get("session-id")
            or headers.get("x-claude-code-session-id")
            or headers.get("x-session-id"),
            "request": {
                "headers": redact(self.request_headers),
                "body": request,
                "body_sha256": hashlib.sha256(self.request_body).hexdigest(),
                "bytes": len(self.request_body),
                "truncated": len(self.request_body) > MAX_RECORDED_BYTES,
            },
            "response": {
                "headers": redact(self.response_headers),
                "stream": stream,
                "events": events,
                "body": body,
                "raw": raw.decode("utf-8", "replace") if stream else None,
                "bytes": self.response_size,
                "truncated": self.response_size > MAX_RECORDED_BYTES,
            },
            "usage": usage_of(self.api, body),
        }
