"""One exception tree for Orchard.

Every error carries a stable ``code`` that survives the wire: the orchestrator answers
``{"detail": {"code", "message", "hint"}}`` with ``http_status``, and the SDK raises the class
registered for that code (:func:`error_from_wire`). Library code raises these; only the CLI's
entry point catches them and prints message and hint.
"""

from __future__ import annotations

from typing import Any, ClassVar


class OrchardError(Exception):
    """Base of every error Orchard raises on purpose."""

    code: ClassVar[str] = "internal"
    http_status: ClassVar[int] = 500
    default_hint: ClassVar[str | None] = None

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint if hint is not None else self.default_hint

    def to_wire(self) -> dict[str, Any]:
        detail: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.hint:
            detail["hint"] = self.hint
        return {"detail": detail}

    def __str__(self) -> str:
        return self.message


_BY_CODE: dict[str, type[OrchardError]] = {}


def _register(cls: type[OrchardError]) -> type[OrchardError]:
    if cls.code in _BY_CODE:
        raise RuntimeError(f"duplicate error code {cls.code!r}")
    _BY_CODE[cls.code] = cls
    return cls


_register(OrchardError)


@_register
class InvalidRequest(OrchardError):
    """The request (or a CLI argument) is malformed or out of range."""

    code = "invalid_request"
    http_status = 400


@_register
class ConfigError(InvalidRequest):
    """A configuration value (flag, ORCHARD_* variable, config file, profile) is wrong."""

    code = "config_error"


@_register
class QuotaExceeded(OrchardError):
    """A key's or the service's quota of live sandboxes, CPU or memory would be exceeded."""

    code = "quota_exceeded"
    http_status = 429


@_register
class LimitExceeded(InvalidRequest):
    """A requested size is above a configured cap, or a quota is used up."""

    code = "limit_exceeded"
    http_status = 422


@_register
class PayloadTooLarge(LimitExceeded):
    """A request body is larger than the service accepts."""

    code = "payload_too_large"
    http_status = 413


@_register
class AuthenticationRequired(OrchardError):
    code = "unauthenticated"
    http_status = 401
    default_hint = (
        "send the key in the X-API-Key header (SDK: api_key=, CLI: --api-key or a context)"
    )


@_register
class PermissionDenied(OrchardError):
    code = "forbidden"
    http_status = 403


@_register
class NotFound(OrchardError):
    code = "not_found"
    http_status = 404


@_register
class SandboxNotFound(NotFound):
    code = "sandbox_not_found"


@_register
class JobNotFound(NotFound):
    code = "job_not_found"


@_register
class FileNotFound(NotFound):
    code = "file_not_found"


@_register
class KeyNotFound(NotFound):
    code = "key_not_found"


@_register
class SnapshotNotFound(NotFound):
    code = "snapshot_not_found"


@_register
class PoolNotFound(NotFound):
    code = "pool_not_found"


@_register
class ImageNotFound(OrchardError):
    """The container image does not exist locally and cannot be pulled."""

    code = "image_not_found"
    http_status = 422


@_register
class Conflict(OrchardError):
    code = "conflict"
    http_status = 409


@_register
class SandboxExists(Conflict):
    code = "sandbox_exists"


@_register
class SandboxNotReady(Conflict):
    code = "sandbox_not_ready"


@_register
class Timeout(OrchardError, TimeoutError):
    """A wait ran out. Also Python's ``TimeoutError``, which upstream's SDK raised."""

    code = "timeout"
    http_status = 408


@_register
class Unavailable(OrchardError):
    """Transient: the caller may retry (the SDK does, with backoff)."""

    code = "unavailable"
    http_status = 503


@_register
class BackendUnavailable(Unavailable):
    code = "backend_unavailable"


@_register
class AgentUnavailable(Unavailable):
    code = "agent_unavailable"


@_register
class AgentTampered(OrchardError):
    """A sandbox's agent endpoint answered as the real agent never does: a planted symlink or
    file at its socket, an impostor, or a reply over the protocol's bounds. The sandbox is
    failed with this reason; nothing it sent is believed."""

    code = "agent_tampered"
    http_status = 502


@_register
class EngineNotFound(OrchardError):
    """No container engine socket could be found or reached (client side)."""

    code = "engine_not_found"
    http_status = 503
    default_hint = (
        "install Podman (apt-get install podman runc) and start its API socket with "
        "`podman system service --time=0 unix:///run/podman/podman.sock &`, "
        "or set DOCKER_HOST to a Docker or Podman socket"
    )


@_register
class NotSupported(OrchardError):
    code = "not_supported"
    http_status = 501


@_register
class CommandFailed(OrchardError):
    """A command run with ``check=True`` exited non-zero or timed out."""

    code = "command_failed"
    http_status = 422


@_register
class ServiceUnreachable(OrchardError):
    """The SDK could not reach the orchestrator at all (after its retries)."""

    code = "service_unreachable"
    http_status = 503
    default_hint = "is the service running? `orchard status` shows it; `orchard up` starts it"


def error_class(code: str) -> type[OrchardError]:
    """The exception class for a wire code (unknown codes map to :class:`OrchardError`)."""
    return _BY_CODE.get(code, OrchardError)


def error_from_wire(status: int, body: Any) -> OrchardError:
    """Rebuild the exception a server raised from its HTTP status and JSON body.

    Understands our ``{"detail": {"code", "message", "hint"}}`` shape and FastAPI's plain
    ``{"detail": "..."}`` / validation-list shapes (as upstream Orchard Env answers).
    """
    detail = body.get("detail") if isinstance(body, dict) else None
    if isinstance(detail, dict) and "code" in detail:
        cls = error_class(str(detail["code"]))
        return cls(str(detail.get("message", "")), hint=detail.get("hint"))
    if isinstance(detail, list):  # FastAPI validation errors
        parts = []
        for item in detail:
            loc = ".".join(str(p) for p in item.get("loc", []) if p != "body")
            parts.append(f"{loc}: {item.get('msg', '')}" if loc else str(item.get("msg", "")))
        return InvalidRequest("; ".join(parts) or "invalid request")
    message = str(detail) if detail is not None else f"HTTP {status}"
    for cls in _STATUS_FALLBACK:
        if cls.http_status == status:
            return cls(message)
    return OrchardError(message)


_STATUS_FALLBACK: tuple[type[OrchardError], ...] = (
    InvalidRequest,
    AuthenticationRequired,
    PermissionDenied,
    NotFound,
    Timeout,
    Conflict,
    LimitExceeded,
    Unavailable,
)
