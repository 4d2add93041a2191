"""HTTP/1.1 to the configured model endpoints, on asyncio streams: keep-alive connections
pooled per origin, TLS for ``https``, bodies read as they arrive (Content-Length, chunked,
or to the end of the connection). A general-purpose client costs milliseconds per call in
Python; this costs tenths of one.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from urllib.parse import urlsplit

CONNECT_TIMEOUT = 5.0
READ_TIMEOUT = 600.0  # a model may think this long before its first byte, or between two
MAX_IDLE = 64  # pooled connections per origin
MAX_HEAD = 64 * 1024
READ_CHUNK = 64 * 1024

Origin = tuple[str, str, int]


class UpstreamError(Exception):
    """The endpoint could not be reached, or answered no HTTP."""


@dataclass
class Response:
    status: int
    headers: list[tuple[str, str]]  # names lower-cased
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    reusable: bool
    length: int | None
    chunked: bool
    done: bool = False
    _pool: Pool | None = field(default=None, repr=False)
    _origin: Origin | None = None

    def header(self, name: str) -> str | None:
        return next((v for k, v in self.headers if k == name), None)

    async def body(self) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive (chunked framing removed); READ_TIMEOUT between
        two reads."""
        read = self.reader
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(None) as deadline:
            if self.chunked:
                while True:
                    deadline.reschedule(loop.time() + READ_TIMEOUT)
                    line = await read.readline()
                    try:
                        size = int(line.split(b";", 1)[0].strip(), 16)
                    except ValueError:
                        raise UpstreamError(f"a malformed chunk size {line[:20]!r}") from None
                    if size == 0:
                        while (await read.readline()) not in (b"\r\n", b"\n", b""):
                            pass
                        break
                    data = await read.readexactly(size + 2)
                    yield data[:size]
            elif self.length is not None:
                left = self.length
                while left > 0:
                    deadline.reschedule(loop.time() + READ_TIMEOUT)
                    data = await read.read(min(left, READ_CHUNK))
                    if not data:
                        raise UpstreamError("the connection closed before the body's end")
                    left -= len(data)
                    yield data
            else:
                while True:
                    deadline.reschedule(loop.time() + READ_TIMEOUT)
                    if not (data := await read.read(READ_CHUNK)):
                        break
                    yield data
        self.done = True

    def close(self) -> None:
        """Back to the pool if the body was read whole on a keep-alive connection."""
        if self.done and self.reusable and self._pool is not None and self._origin is not None:
            self._pool.release(self._origin, self.reader, self.writer)
        else:
            self.writer.close()


class Pool:
    def __init__(self) -> None:
        self._idle: dict[Origin, list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]] = {}
        self._tls = ssl.create_default_context()

    async def request(
        self, method: str, url: str, headers: list[tuple[str, str]], body: bytes
    ) -> Response:
        parts = urlsplit(url)
        scheme = parts.scheme
        host = parts.hostname or ""
        port = parts.port or (443 if scheme == "https" else 80)
        origin = (scheme, host, port)
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        head = f"{method} {target} HTTP/1.1\r\nhost: {parts.netloc}\r\n"
        for name, value in headers:
            head += f"{name}: {value}\r\n"
        if body or method in ("POST", "PUT", "PATCH"):
            head += f"content-length: {len(body)}\r\n"
        data = head.encode("latin-1", "replace") + b"\r\n" + body
        while True:
            reused, reader, writer = await self._connection(origin)
            try:
                writer.write(data)
                await writer.drain()
                return await self._response(reader, writer, origin, method)
            except (OSError, asyncio.IncompleteReadError, UpstreamError) as exc:
                writer.close()
                if reused and _stale(exc):
                    continue  # a pooled connection the endpoint had closed: once more, fresh
                raise UpstreamError(f"{type(exc).__name__}: {exc or 'no answer'}") from exc
            except TimeoutError:
                writer.close()
                raise UpstreamError(f"no answer within {READ_TIMEOUT:g} s") from None

    async def _connection(
        self, origin: Origin
    ) -> tuple[bool, asyncio.StreamReader, asyncio.StreamWriter]:
        idle = self._idle.get(origin) or []
        while idle:
            reader, writer = idle.pop()
            if not writer.is_closing() and not reader.at_eof():
                return True, reader, writer
            writer.close()
        scheme, host, port = origin
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(
                    host,
                    port,
                    ssl=self._tls if scheme == "https" else None,
                    limit=MAX_HEAD,
                ),
                CONNECT_TIMEOUT,
            )
        except TimeoutError:
            raise UpstreamError(f"no connection within {CONNECT_TIMEOUT:g} s") from None
        except (OSError, ssl.SSLError) as exc:
            raise UpstreamError(f"{type(exc).__name__}: {exc}") from exc
        return False, reader, writer

    async def _response(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        origin: Origin,
        method: str,
    ) -> Response:
        try:
            async with asyncio.timeout(READ_TIMEOUT):
                head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.LimitOverrunError:
            raise UpstreamError(f"response headers over {MAX_HEAD} bytes") from None
        lines = head.decode("latin-1").split("\r\n")
        version, _, rest = lines[0].partition(" ")
        status_text = rest.split(" ", 1)[0]
        if not version.startswith("HTTP/1.") or not status_text.isdigit():
            raise UpstreamError(f"not an HTTP answer: {lines[0][:80]!r}")
        headers = []
        for line in lines[1:]:
            if line:
                name, _, value = line.partition(":")
                headers.append((name.strip().lower(), value.strip()))
        status = int(status_text)
        values = dict(headers)
        chunked = "chunked" in values.get("transfer-encoding", "").lower()
        length_text = values.get("content-length")
        length = int(length_text) if length_text and length_text.isdigit() else None
        if method == "HEAD" or status in (204, 304) or 100 <= status < 200:
            length, chunked = 0, False
        keep = "close" not in values.get("connection", "").lower() and version == "HTTP/1.1"
        return Response(
            status=status,
            headers=headers,
            reader=reader,
            writer=writer,
            reusable=keep and (chunked or length is not None),
            length=length,
            chunked=chunked,
            _pool=self,
            _origin=origin,
        )

    def release(
        self, origin: Origin, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        idle = self._idle.setdefault(origin, [])
        if len(idle) >= MAX_IDLE:
            writer.close()
        else:
            idle.append((reader, writer))

    async def close(self) -> None:
        for idle in self._idle.values():
            for _, writer in idle:
                writer.close()
                with contextlib.suppress(Exception):
                    await writer.wait_closed()
        self._idle.clear()


def _stale(exc: BaseException) -> bool:
    return isinstance(exc, ConnectionError | asyncio.IncompleteReadError | BrokenPipeError)
