"""What the sync and async clients share that is not I/O: settings, retries, errors.

The two clients differ only in how they send a request and how they sleep. Every algorithm
(the retry policy, error mapping, create/exec/wait) is written once, as a *flow*: a
generator that yields :class:`Send` and :class:`Sleep` steps and is sent back the
:class:`httpx.Response` (or has the transport's exception thrown in). ``SandboxClient``
drives a flow with blocking calls, ``AsyncSandboxClient`` with ``await``; neither contains
any of the logic itself.
"""

from __future__ import annotations

import email.utils
import enum
import logging
import math
import os
import random
import secrets
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Generator, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypeVar, cast
from urllib.parse import quote

import httpx
from pydantic import BaseModel, ValidationError

from orchard_env import __version__, errors
from orchard_env.contexts import client_settings
from orchard_env.protocol import check_sandbox_id, validation_text

logger = logging.getLogger("orchard_env.sdk")

_T = TypeVar("_T")
_M = TypeVar("_M", bound=BaseModel)

RequestBody = bytes | Iterator[bytes] | AsyncIterator[bytes]

CONNECT_TIMEOUT = 10.0
"""Seconds to wait for a TCP connection (the read timeout is the client's ``timeout``)."""

CLEANUP_TIMEOUT = 10.0
"""Seconds each delete may take when cleaning up (close, failed create, interpreter exit)."""


class Retry(enum.Enum):
    """When a request may be sent again after a failure."""

    SAFE = "safe"
    """Idempotent: retry on any connection failure or timeout, and on 503."""
    UNSENT_ONLY = "unsent_only"
    """Not idempotent: retry only when the request provably never reached the server."""


# Failures that happen before a single byte of the request left: always safe to retry.
_UNSENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with full jitter; ``retries`` is how many times to try again."""

    retries: int = 3
    base: float = 0.5
    cap: float = 8.0
    max_retry_after: float = 30.0

    def backoff(self, attempt: int, rng: random.Random) -> float:
        """Seconds to sleep before retry number ``attempt + 1`` (full jitter)."""
        return rng.uniform(0.0, min(self.cap, self.base * 2**attempt))

    def retry_after(self, response: httpx.Response) -> float | None:
        """The server's ``Retry-After`` (seconds or an HTTP date), capped; None if absent."""
        value = response.headers.get("Retry-After")
        if value is None:
            return None
        try:
            seconds = float(value)
        except ValueError:
            try:
                when = email.utils.parsedate_to_datetime(value)
            except (TypeError, ValueError):
                return None
            seconds = (when - datetime.now(UTC)).total_seconds()
        return min(max(seconds, 0.0), self.max_retry_after)


# --- flow steps ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Sleep:
    seconds: float


@dataclass
class Send:
    """One HTTP request, as a flow asks the client to send it.

    ``content`` makes a fresh body for every attempt (a streamed file is re-opened on retry).
    ``timeout`` overrides the read timeout (long-polls and waiting execs). With ``stream``
    the body of a successful response is left unread for the caller; error bodies are
    always read.
    """

    method: str
    path: str
    params: list[tuple[str, str]] = field(default_factory=list)
    json: Any = None
    content: Callable[[], RequestBody] | None = None
    headers: dict[str, str] = field(default_factory=dict)
    timeout: float | None = None
    stream: bool = False
    retry: Retry = Retry.SAFE
    max_retries: int | None = None

    def __post_init__(self) -> None:
        # The same id on every retry of this request, so server logs tie them together.
        self.headers.setdefault("X-Request-ID", uuid.uuid4().hex)


Step = Send | Sleep
Flow = Generator[Step, object, _T]


@dataclass(frozen=True)
class Outcome:
    response: httpx.Response
    maybe_sent_before: bool
    """An earlier attempt failed after its request may have reached the server."""


# --- settings shared by both clients ------------------------------------------------------


class ClientCore:
    """A client's resolved settings and the sandboxes it created (no I/O here)."""

    def __init__(
        self,
        *,
        base_url: str | None,
        timeout: float,
        auto_cleanup: bool,
        api_key: str | None,
        prefix: str | None,
        context: str | None,
        retries: int,
    ) -> None:
        settings = client_settings(base_url, api_key, context)
        if not settings.url.startswith(("http://", "https://")):
            raise errors.ConfigError(
                f"service URL {settings.url!r} must start with http:// or https://",
                hint="pass base_url=, or set ORCHARD_URL / SANDBOX_BASE_URL",
            )
        if timeout <= 0:
            raise errors.InvalidRequest(f"timeout must be positive, got {timeout}")
        if retries < 0:
            raise errors.InvalidRequest(f"retries must be zero or more, got {retries}")
        self.base_url = settings.url
        self.api_key = settings.api_key or None
        self.context = settings.context
        self.prefix = _resolve_prefix(prefix)
        self.timeout = float(timeout)
        self.auto_cleanup = auto_cleanup
        self.retry = RetryPolicy(retries=retries)
        self.clock: Callable[[], float] = time.monotonic
        self.rng = random.Random()
        self.headers = {"User-Agent": f"orchard-sdk/{__version__}"}
        if self.api_key:
            self.headers["X-API-Key"] = self.api_key
        self._created: dict[str, None] = {}
        self._lock = threading.Lock()
        self._on_track: Callable[[str], None] | None = None
        self._on_untrack: Callable[[str], None] | None = None

    def http_timeout(self, read: float | None = None) -> httpx.Timeout:
        total = self.timeout if read is None else read
        return httpx.Timeout(total, connect=min(CONNECT_TIMEOUT, total))

    def new_sandbox_id(self, requested: str | None) -> str | None:
        """Upstream's rule: with a prefix, ids are ``<prefix>-<id or 8 hex>``."""
        if self.prefix is None:
            return requested
        if requested is not None and requested.startswith(f"{self.prefix}-"):
            return requested
        return f"{self.prefix}-{requested or secrets.token_hex(4)}"

    # The sandboxes this client created, deleted by cleanup_all() and (auto_cleanup) close().

    def on_tracking(self, track: Callable[[str], None], untrack: Callable[[str], None]) -> None:
        self._on_track, self._on_untrack = track, untrack

    def track(self, sandbox_id: str) -> None:
        with self._lock:
            self._created[sandbox_id] = None
        if self._on_track is not None:
            self._on_track(sandbox_id)

    def untrack(self, sandbox_id: str) -> None:
        with self._lock:
            self._created.pop(sandbox_id, None)
        if self._on_untrack is not None:
            self._on_untrack(sandbox_id)

    def created(self) -> list[str]:
        with self._lock:
            return list(self._created)


def _resolve_prefix(prefix: str | None) -> str | None:
    source = "prefix="
    if prefix is None:
        prefix, source = os.environ.get("SANDBOX_PREFIX") or None, "SANDBOX_PREFIX"
    if prefix is None:
        return None
    try:
        check_sandbox_id(f"{prefix}-0a1b2c3d")
    except ValueError:
        raise errors.ConfigError(
            f"sandbox id prefix {prefix!r} (from {source}) cannot start a sandbox id",
            hint="use lowercase letters, digits and '-', at most 54 characters",
        ) from None
    return prefix


# --- requests, retries, errors ------------------------------------------------------------


def seg(value: str) -> str:
    """One URL path segment, escaped (ids come from users)."""
    return quote(value, safe="")


def send(core: ClientCore, req: Send) -> Flow[Outcome]:
    """Send ``req``, retrying what is safe to retry; return the final response (any status)."""
    retries = core.retry.retries if req.max_retries is None else req.max_retries
    maybe_sent = False
    attempt = 0
    while True:
        try:
            response = cast(httpx.Response, (yield req))
        except httpx.TransportError as exc:
            unsent = isinstance(exc, _UNSENT)
            if not unsent and req.retry is Retry.UNSENT_ONLY:
                raise _connection_lost(core, req, exc) from exc
            if attempt >= retries:
                raise _unreachable(core, req, exc, attempt + 1) from exc
            maybe_sent = maybe_sent or not unsent
            delay = core.retry.backoff(attempt, core.rng)
            reason = describe(exc)
        else:
            if response.status_code != 503 or req.retry is not Retry.SAFE or attempt >= retries:
                return Outcome(response, maybe_sent)
            after = core.retry.retry_after(response)
            delay = core.retry.backoff(attempt, core.rng) if after is None else after
            reason = "503 Service Unavailable"
        logger.info(
            "%s %s failed (%s); retry %d/%d in %.2fs",
            req.method,
            req.path,
            reason,
            attempt + 1,
            retries,
            delay,
        )
        yield Sleep(delay)
        attempt += 1


def call(core: ClientCore, req: Send) -> Flow[Any]:
    """Send ``req`` and return its JSON body; a non-2xx answer raises the server's error."""
    outcome = yield from send(core, req)
    return json_body(outcome.response)


def json_body(response: httpx.Response) -> Any:
    if response.is_error:
        raise error_from_response(response)
    return response.json() if response.content else None


def error_from_response(response: httpx.Response) -> errors.OrchardError:
    """The exception the server raised, rebuilt from its status and JSON body."""
    try:
        body = response.json()
    except ValueError:
        body = {"detail": response.text.strip() or f"HTTP {response.status_code}"}
    return errors.error_from_wire(response.status_code, body)


def describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _unreachable(
    core: ClientCore, req: Send, exc: httpx.TransportError, attempts: int
) -> errors.OrchardError:
    if isinstance(exc, httpx.UnsupportedProtocol | httpx.InvalidURL):
        return errors.ConfigError(f"bad service URL {core.base_url!r}: {exc}")
    tries = f" after {attempts} attempts" if attempts > 1 else ""
    return errors.ServiceUnreachable(
        f"cannot reach the Orchard service at {core.base_url}: "
        f"{req.method} {req.path} failed{tries} ({describe(exc)})"
    )


def _connection_lost(core: ClientCore, req: Send, exc: httpx.TransportError) -> errors.OrchardError:
    return errors.ServiceUnreachable(
        f"lost the connection to {core.base_url} during {req.method} {req.path} "
        f"({describe(exc)}); not retried because the server may already have acted on it",
        hint="check the current state (e.g. list_sandboxes()) before trying again",
    )


def transport_error(core: ClientCore, what: str, exc: httpx.TransportError) -> errors.OrchardError:
    """A connection lost while reading a streamed body (too late to retry the request)."""
    return errors.ServiceUnreachable(
        f"lost the connection to {core.base_url} while {what} ({describe(exc)})"
    )


def build(model: type[_M], **values: Any) -> _M:
    """Validate a request client-side: the same rules and messages as the server's."""
    try:
        return model(**values)
    except ValidationError as exc:
        raise errors.InvalidRequest(validation_text(exc)) from None


def whole_seconds(seconds: float) -> int:
    """The wire's integer seconds, rounded up (a 0.5 s timeout is 1 s, never 0)."""
    return max(1, math.ceil(seconds))


class ClientView:
    """Where a client talks to, as both clients show it (read from their :class:`ClientCore`)."""

    _core: ClientCore

    @property
    def base_url(self) -> str:
        """The service's URL, as resolved (argument > env > context > default)."""
        return self._core.base_url

    @property
    def api_key(self) -> str | None:
        """The key sent as ``X-API-Key`` (None: no key)."""
        return self._core.api_key

    @property
    def prefix(self) -> str | None:
        """Upstream's id prefix for sandboxes this client creates, if given."""
        return self._core.prefix

    @property
    def context(self) -> str | None:
        """The config-file context the URL or key came from, if one was used."""
        return self._core.context

    @property
    def timeout(self) -> float:
        """Seconds a request may take to answer (long polls ask for more)."""
        return self._core.timeout
