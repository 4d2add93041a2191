"""The async client's transport: httpx's requests and responses carried by the lean HTTP/1.1
connections of :mod:`orchard_env.http1`.

httpcore's connection pool walks every connection for each request it places, so with a
hundred sandboxes' commands in flight from one ``AsyncSandboxClient`` (a training driver's
normal state) the client spent 15 to 20 ms of CPU per request there. Here an idle connection is
taken from a list, and a request costs the same however many are in flight.

Used unless the caller passes a transport of their own or the environment names a proxy
(httpx's own transport honours ``HTTP(S)_PROXY``; this one does not).
"""

from __future__ import annotations

import asyncio
import contextvars
import ssl
import urllib.request
from collections.abc import AsyncIterator

import httpx

from orchard_env import http1

MAX_IDLE = 200  # kept-alive connections per origin
IDLE_EXPIRY = 60.0

Origin = tuple[str, str, int]
# The request a connection is being opened for, and its connect timeout (a pool's connect
# function takes no arguments).
_opening: contextvars.ContextVar[tuple[httpx.Request, float | None]] = contextvars.ContextVar(
    "opening"
)


def proxied() -> bool:
    """Whether the environment names a proxy (then httpx's own transport is used)."""
    return bool(urllib.request.getproxies())


class LeanTransport(httpx.AsyncBaseTransport):
    """HTTP/1.1 over kept-alive connections per origin, TLS as httpx verifies it."""

    def __init__(self) -> None:
        self._origins: dict[Origin, http1.Connections] = {}
        self._tls: ssl.SSLContext | None = None

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        if url.scheme not in ("http", "https"):
            raise httpx.UnsupportedProtocol(f"{url.scheme!r} URLs are not served", request=request)
        origin = (url.scheme, url.host, url.port or (443 if url.scheme == "https" else 80))
        timeouts = request.extensions.get("timeout", {})
        connections = self._origins.get(origin)
        if connections is None:
            connections = self._origins[origin] = http1.Connections(
                lambda: self._connect(origin), max_idle=MAX_IDLE, idle_expiry=IDLE_EXPIRY
            )
        body: bytes | AsyncIterator[bytes]
        try:
            body = request.content
        except httpx.RequestNotRead:
            body = aiter(request.stream)  # type: ignore[arg-type]
        headers = [
            (name.decode("latin-1"), value.decode("latin-1"))
            for name, value in request.headers.raw
            if name.lower() not in (b"host", b"content-length", b"transfer-encoding")
        ]
        head = http1.request_head(
            request.method,
            url.raw_path.decode("ascii"),
            url.netloc.decode("ascii"),
            headers,
            len(body) if isinstance(body, bytes) else None,
        )
        read_timeout = timeouts.get("read")
        _opening.set((request, timeouts.get("connect")))
        with _mapped(request, "sending the request"):
            answer = await connections.request(
                request.method,
                head,
                body,
                timeout=timeouts.get("write"),
                read_timeout=read_timeout,
            )
        return httpx.Response(
            answer.status,
            headers=answer.headers,
            stream=_Body(answer, read_timeout, request),
            extensions={"http_version": b"HTTP/1.1"},
        )

    async def _connect(self, origin: Origin) -> http1.Stream:
        scheme, host, port = origin
        request, timeout = _opening.get()
        if scheme == "https" and self._tls is None:
            self._tls = httpx.create_ssl_context()
        try:
            async with asyncio.timeout(timeout):
                return await asyncio.open_connection(
                    host,
                    port,
                    ssl=self._tls if scheme == "https" else None,
                    limit=http1.MAX_HEAD,
                )
        except TimeoutError:
            raise httpx.ConnectTimeout(
                f"no connection to {host}:{port} within {timeout} s", request=request
            ) from None
        except (OSError, ssl.SSLError) as exc:
            raise httpx.ConnectError(str(exc) or type(exc).__name__, request=request) from exc

    async def aclose(self) -> None:
        origins, self._origins = self._origins, {}
        for connections in origins.values():
            await connections.close()


class _Body(httpx.AsyncByteStream):
    def __init__(
        self, answer: http1.Response, read_timeout: float | None, request: httpx.Request
    ) -> None:
        self._answer = answer
        self._read_timeout = read_timeout
        self._request = request

    async def __aiter__(self) -> AsyncIterator[bytes]:
        with _mapped(self._request, "reading the answer"):
            async for piece in self._answer.body(self._read_timeout):
                yield piece

    async def aclose(self) -> None:
        self._answer.close()


class _mapped:
    """Raise http1's failures as the httpx exceptions the SDK's retries know."""

    def __init__(self, request: httpx.Request, doing: str) -> None:
        self._request = request
        self._doing = doing

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, _tb: object
    ) -> None:
        if exc is None or isinstance(exc, httpx.TransportError):
            return
        request, doing = self._request, self._doing
        if isinstance(exc, TimeoutError):
            raise httpx.ReadTimeout(f"timed out {doing}", request=request) from exc
        if isinstance(exc, http1.NoAnswer):
            raise httpx.RemoteProtocolError(
                "the server closed the connection without an answer", request=request
            ) from exc
        if isinstance(exc, http1.BadAnswer):
            raise httpx.RemoteProtocolError(str(exc), request=request) from exc
        if isinstance(exc, OSError):
            raise httpx.ReadError(f"{doing}: {exc or type(exc).__name__}", request=request) from exc
