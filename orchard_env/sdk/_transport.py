"""The clients' transports: httpx's requests and responses carried by lean HTTP/1.1
connections, kept alive per origin, TLS verified as httpx verifies it, and every failure
raised as the httpx error the SDK's retries know.

- :class:`LeanTransport` (the async client) uses :mod:`orchard_env.http1`'s connections.
  httpcore's pool walks every connection for each request it places, so with a hundred
  sandboxes' commands in flight from one ``AsyncSandboxClient`` (a training driver's normal
  state) the client spent 15 to 20 ms of CPU per request there; here an idle connection is
  taken from a list, and a request costs the same however many are in flight.
- :class:`LeanSyncTransport` (the sync client) uses the standard library's
  :mod:`http.client`: a third of httpcore's CPU per request, which an exec waits for.

Used unless the caller passes a transport of their own or the environment names a proxy
(httpx's own transport honours ``HTTP(S)_PROXY``; these do not).
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import http.client
import socket
import ssl
import urllib.request
from collections.abc import AsyncIterator, Iterator

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


def _tls() -> ssl.SSLContext:
    return httpx.create_ssl_context()


def _origin(request: httpx.Request) -> Origin:
    url = request.url
    if url.scheme not in ("http", "https"):
        raise httpx.UnsupportedProtocol(f"{url.scheme!r} URLs are not served", request=request)
    return url.scheme, url.host, url.port or (443 if url.scheme == "https" else 80)


class LeanTransport(httpx.AsyncBaseTransport):
    """HTTP/1.1 over kept-alive connections per origin, TLS as httpx verifies it."""

    def __init__(self) -> None:
        self._origins: dict[Origin, http1.Connections] = {}
        self._tls: ssl.SSLContext | None = None

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        origin = _origin(request)
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
            self._tls = _tls()
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


class LeanSyncTransport(httpx.BaseTransport):
    """HTTP/1.1 over kept-alive :class:`http.client.HTTPConnection` s per origin (safe to
    share between threads: a connection is taken from, and given back to, a deque)."""

    def __init__(self) -> None:
        self._idle: dict[Origin, collections.deque[http.client.HTTPConnection]] = {}
        self._tls: ssl.SSLContext | None = None

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        origin = _origin(request)
        timeouts = request.extensions.get("timeout", {})
        idle = self._idle.setdefault(origin, collections.deque())
        body: bytes | Iterator[bytes]
        try:
            body = request.content
        except httpx.RequestNotRead:
            body = iter(request.stream)  # type: ignore[arg-type]
        while True:
            try:
                conn, reused = idle.pop(), True
            except IndexError:
                conn, reused = self._connect(origin, timeouts.get("connect"), request), False
            conn.sock.settimeout(timeouts.get("read"))
            try:
                answer = self._send(conn, request, body)
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError) as exc:
                conn.close()
                if reused and isinstance(body, bytes):
                    continue  # a kept-alive connection the server had closed: send it again
                raise httpx.RemoteProtocolError(
                    f"the server closed the connection without an answer ({exc})",
                    request=request,
                ) from exc
            except BaseException as exc:
                conn.close()
                _raise_mapped(exc, request, "sending the request")
                raise
            return httpx.Response(
                answer.status,
                headers=answer.getheaders(),
                stream=_SyncBody(answer, conn, idle, request),
                extensions={"http_version": b"HTTP/1.1"},
            )

    @staticmethod
    def _send(
        conn: http.client.HTTPConnection, request: httpx.Request, body: bytes | Iterator[bytes]
    ) -> http.client.HTTPResponse:
        conn.putrequest(
            request.method,
            request.url.raw_path.decode("ascii"),
            skip_host=True,
            skip_accept_encoding=True,
        )
        for name, value in request.headers.raw:
            conn.putheader(name.decode("latin-1"), value.decode("latin-1"))
        if isinstance(body, bytes):
            conn.endheaders(body or None)
        else:  # framed as httpx's headers say: chunked, or a Content-Length it knew
            conn.endheaders(body, encode_chunked="transfer-encoding" in request.headers)
        return conn.getresponse()

    def _connect(
        self, origin: Origin, timeout: float | None, request: httpx.Request
    ) -> http.client.HTTPConnection:
        scheme, host, port = origin
        conn: http.client.HTTPConnection
        if scheme == "https":
            if self._tls is None:
                self._tls = _tls()
            conn = http.client.HTTPSConnection(host, port, timeout=timeout, context=self._tls)
        else:
            conn = http.client.HTTPConnection(host, port, timeout=timeout)
        try:
            conn.connect()
        except TimeoutError:
            conn.close()
            raise httpx.ConnectTimeout(
                f"no connection to {host}:{port} within {timeout} s", request=request
            ) from None
        except (OSError, ssl.SSLError) as exc:
            conn.close()
            raise httpx.ConnectError(str(exc) or type(exc).__name__, request=request) from exc
        conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return conn

    def close(self) -> None:
        idle, self._idle = self._idle, {}
        for connections in idle.values():
            while connections:
                connections.pop().close()


class _SyncBody(httpx.SyncByteStream):
    def __init__(
        self,
        answer: http.client.HTTPResponse,
        conn: http.client.HTTPConnection,
        idle: collections.deque[http.client.HTTPConnection],
        request: httpx.Request,
    ) -> None:
        self._answer = answer
        self._conn: http.client.HTTPConnection | None = conn
        self._idle = idle
        self._request = request

    def __iter__(self) -> Iterator[bytes]:
        try:
            while piece := self._answer.read1(http1.READ_CHUNK):
                yield piece
        except BaseException as exc:
            _raise_mapped(exc, self._request, "reading the answer")
            raise
        if self._answer.length:  # http.client ends a short Content-Length body quietly
            raise httpx.ReadError(
                "reading the answer: the connection closed early", request=self._request
            )

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        answer = self._answer
        whole = answer.isclosed() or answer.length == 0  # a chunked one closes at its end
        answer.close()  # its reader only: the connection keeps the socket
        if whole and not answer.will_close:
            self._idle.append(conn)  # the server keeps it open for the next request
        else:
            conn.close()


def _raise_mapped(exc: BaseException, request: httpx.Request, doing: str) -> None:
    """Raise a failure of :mod:`http.client` or the socket as the httpx error it is."""
    if isinstance(exc, TimeoutError):
        raise httpx.ReadTimeout(f"timed out {doing}", request=request) from exc
    if isinstance(exc, http.client.IncompleteRead):
        raise httpx.ReadError(f"{doing}: the connection closed early", request=request) from exc
    if isinstance(exc, http.client.HTTPException):
        raise httpx.RemoteProtocolError(f"{doing}: {exc!r}", request=request) from exc
    if isinstance(exc, OSError):
        raise httpx.ReadError(f"{doing}: {exc or type(exc).__name__}", request=request) from exc
