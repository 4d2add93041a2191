"""A lean HTTP/1.1 client on asyncio streams: keep-alive connections to one origin, the
request written in one go, the answer's head and body read with every part bounded.

Shared by the orchestrator's agent client (:mod:`orchard_env.agent.peer`, whose other end is
hostile) and the model gateway's upstreams (:mod:`orchard_env.orchestrator.gateway.upstream`).
A general-purpose client costs milliseconds per call in Python; this costs tenths of one.

Bounds: the head (status line and headers) at most :data:`MAX_HEAD` bytes and
:data:`MAX_HEADERS` lines; a chunk-size line at most :data:`MAX_HEAD` bytes; a body is handed
over in pieces of at most :data:`READ_CHUNK` bytes as they arrive, never buffered whole, so
the caller's own limits on a body hold whatever size is announced. Whatever is not HTTP/1.1
raises :class:`BadAnswer`; a connection that ends before the answer does raises
:class:`Closed` (a :class:`ConnectionError`); a timeout raises :class:`TimeoutError`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterable, Awaitable, Callable

MAX_HEAD = 64 * 1024
"""Largest answer head, and the stream limit connections must be opened with."""
MAX_HEADERS = 100
MAX_TRAILERS = 32
READ_CHUNK = 64 * 1024
_HEX = frozenset(b"0123456789abcdefABCDEF")
_TOKEN = frozenset("!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")

Stream = tuple[asyncio.StreamReader, asyncio.StreamWriter]
Connect = Callable[[], Awaitable[Stream]]
"""Opens a new connection to the origin (with ``limit=MAX_HEAD`` on its reader)."""


class BadAnswer(Exception):
    """The other end sent something that is not an HTTP/1.1 answer, or broke its framing."""


class Closed(ConnectionError):
    """The connection ended before the answer did."""


class NoAnswer(Closed):
    """The connection ended (or failed) before a single byte of the answer: a kept-alive one
    the other end had closed, which a request may be sent again on a new one for."""


def request_head(
    method: str, target: str, host: str, headers: list[tuple[str, str]], length: int | None
) -> bytes:
    """A request's head; ``length``: its body's Content-Length, None for a chunked body."""
    head = f"{method} {target} HTTP/1.1\r\nhost: {host}\r\n"
    for name, value in headers:
        head += f"{name}: {value}\r\n"
    if length is None:
        head += "transfer-encoding: chunked\r\n"
    elif length or method in ("POST", "PUT", "PATCH"):
        head += f"content-length: {length}\r\n"
    return head.encode("latin-1", "replace") + b"\r\n"


def _digits(text: str) -> bool:
    return text.isascii() and text.isdigit()


async def read_head(reader: asyncio.StreamReader, method: str) -> Response:
    """The answer's status line and headers (the body still on the wire)."""
    try:
        raw = await reader.readuntil(b"\r\n\r\n")
    except asyncio.LimitOverrunError:
        raise BadAnswer(f"an answer head over {MAX_HEAD} bytes") from None
    except asyncio.IncompleteReadError as exc:
        if exc.partial:
            raise Closed("the connection closed in the middle of the answer's head") from None
        raise NoAnswer("the connection closed before an answer") from None
    lines = raw[:-4].decode("latin-1").split("\r\n")
    version, _, rest = lines[0].partition(" ")
    code, sep, _ = rest.partition(" ")
    if (
        version not in ("HTTP/1.1", "HTTP/1.0")
        or len(code) != 3
        or not _digits(code)
        or not (sep or rest == code)
        or not 100 <= int(code) <= 599
    ):
        raise BadAnswer(f"not an HTTP/1.1 status line: {lines[0][:80]!r}")
    if len(lines) > MAX_HEADERS + 1:
        raise BadAnswer(f"an answer with over {MAX_HEADERS} headers")
    headers: list[tuple[str, str]] = []
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep or not name or not _TOKEN.issuperset(name):
            raise BadAnswer(f"a malformed header line: {line[:80]!r}")
        headers.append((name.lower(), value.strip(" \t")))
    status = int(code)
    response = Response(status, headers, reader)
    encoding = response.header("transfer-encoding")
    lengths = {value for name, value in headers if name == "content-length"}
    if len(lengths) > 1 or not all(_digits(value) and len(value) <= 18 for value in lengths):
        raise BadAnswer(f"a bad content-length: {sorted(lengths)!r:.80}")
    connection = (response.header("connection") or "").lower()
    response.reusable = version == "HTTP/1.1" and "close" not in connection
    if method == "HEAD" or status in (204, 304) or status < 200:
        response.length = 0
    elif encoding is not None:
        # RFC 9112 6.3: chunked if it is the last coding (a Content-Length beside it is
        # ignored, and the connection not reused), else the body runs to the connection's end.
        response.chunked = encoding.lower().rsplit(",", 1)[-1].strip() == "chunked"
        response.reusable = response.reusable and response.chunked and not lengths
    elif lengths:
        response.length = int(lengths.pop())
    else:
        response.reusable = False
    response.done = response.length == 0
    return response


class Response:
    """An answer: its status and headers, then its body from :meth:`body` (once)."""

    __slots__ = ("_home", "chunked", "done", "headers", "length", "reader", "reusable", "status")

    def __init__(
        self, status: int, headers: list[tuple[str, str]], reader: asyncio.StreamReader
    ) -> None:
        self.status = status
        self.headers = headers
        """Names lower-cased, in order."""
        self.reader = reader
        self.length: int | None = None
        """The body's Content-Length; None for a chunked one or one to the connection's end."""
        self.chunked = False
        self.reusable = False
        """The connection can take the next request once the body was read whole."""
        self.done = False
        self._home: tuple[Connections, asyncio.StreamWriter] | None = None

    def header(self, name: str) -> str | None:
        """The first value of a header (``name`` lower-case)."""
        for key, value in self.headers:
            if key == name:
                return value
        return None

    async def body(self, read_timeout: float | None = None) -> AsyncGenerator[bytes, None]:
        """The body's bytes as they arrive, chunked framing removed; ``read_timeout`` bounds
        each wait for more (TimeoutError)."""
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(None) as deadline:

            def arm() -> None:
                if read_timeout is not None:
                    deadline.reschedule(loop.time() + read_timeout)

            if self.length is None and not self.chunked:
                while True:
                    arm()
                    data = await self.reader.read(READ_CHUNK)
                    deadline.reschedule(None)
                    if not data:
                        break  # a body that runs to the connection's end
                    yield data
            else:
                left = self.length or 0
                while True:
                    if self.chunked:
                        arm()
                        left = await self._chunk_size()
                        if not left:
                            await self._trailers()
                            break
                    while left:
                        arm()
                        data = await self._piece(left)
                        left -= len(data)
                        deadline.reschedule(None)
                        yield data
                    if not self.chunked:
                        break
                    arm()
                    if (end := await self._piece(2, exactly=True)) != b"\r\n":
                        raise BadAnswer(f"a chunk not ended by CRLF but by {end!r}")
        self.done = True

    async def _piece(self, left: int, exactly: bool = False) -> bytes:
        try:
            if exactly:
                return await self.reader.readexactly(left)
            if data := await self.reader.read(min(left, READ_CHUNK)):
                return data
        except asyncio.IncompleteReadError:
            pass
        raise Closed("the connection closed in the middle of the answer's body")

    async def _line(self, what: str) -> bytes:
        try:
            line = await self.reader.readuntil(b"\r\n")
        except asyncio.LimitOverrunError:
            raise BadAnswer(f"{what} over {MAX_HEAD} bytes") from None
        except asyncio.IncompleteReadError:
            raise Closed("the connection closed in the middle of the answer's body") from None
        return line[:-2]

    async def _chunk_size(self) -> int:
        line = await self._line("a chunk-size line")
        text = line.split(b";", 1)[0].strip(b" \t")
        if not text or len(text) > 15 or not _HEX.issuperset(text):
            raise BadAnswer(f"a malformed chunk size {line[:20]!r}")
        return int(text, 16)

    async def _trailers(self) -> None:
        for _ in range(MAX_TRAILERS + 1):
            if not await self._line("a trailer line"):
                return
        raise BadAnswer(f"an answer with over {MAX_TRAILERS} trailers")

    def close(self) -> None:
        """Give the connection back if the body was read whole on a keep-alive one, else
        close it."""
        if self._home is None:
            return
        home, writer = self._home
        self._home = None
        if self.done and self.reusable:
            home.release(self.reader, writer)
        else:
            writer.close()


class Connections:
    """Keep-alive connections to one origin: idle ones reused last in, first out (at most
    ``max_idle``, each for at most ``idle_expiry`` seconds), new ones opened by ``connect``."""

    def __init__(self, connect: Connect, *, max_idle: int, idle_expiry: float) -> None:
        self._connect = connect
        self._max_idle = max_idle
        self._expiry = idle_expiry
        self._idle: list[tuple[float, asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def request(
        self,
        method: str,
        head: bytes,
        body: bytes | AsyncIterable[bytes] = b"",
        *,
        timeout: float | None = None,  # noqa: ASYNC109 - the request's, for each phase
        read_timeout: float | None = None,
    ) -> Response:
        """Send a request (``head`` from :func:`request_head`; a streamed ``body`` goes
        chunked) and read its answer's head. ``timeout`` bounds connecting and each write;
        ``read_timeout`` the wait for the head. A kept-alive connection found closed is
        replaced once, when the body can be sent again."""
        while True:
            reused, reader, writer = await self._connection(timeout)
            try:
                if isinstance(body, bytes):
                    writer.write(head + body if body else head)
                    await _drain(writer, timeout)
                else:
                    writer.write(head)
                    async for piece in body:
                        if piece:
                            writer.writelines((b"%x\r\n" % len(piece), piece, b"\r\n"))
                            await _drain(writer, timeout)
                    writer.write(b"0\r\n\r\n")
                    await _drain(writer, timeout)
                async with asyncio.timeout(read_timeout):
                    response = await read_head(reader, method)
            except BaseException as exc:
                writer.close()
                if reused and isinstance(body, bytes) and _stale(exc):
                    continue
                raise
            response._home = (self, writer)
            return response

    async def _connection(self, timeout: float | None) -> tuple[bool, *Stream]:  # noqa: ASYNC109
        now = asyncio.get_running_loop().time()
        while self._idle:
            since, reader, writer = self._idle.pop()
            if now - since < self._expiry and not writer.is_closing() and not reader.at_eof():
                return True, reader, writer
            writer.close()
        async with asyncio.timeout(timeout):
            reader, writer = await self._connect()
        return False, reader, writer

    def release(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(self._idle) >= self._max_idle:
            writer.close()
        else:
            self._idle.append((asyncio.get_running_loop().time(), reader, writer))

    async def close(self) -> None:
        idle, self._idle = self._idle, []
        for _, _, writer in idle:
            writer.close()
        for _, _, writer in idle:
            with contextlib.suppress(Exception):
                await writer.wait_closed()


async def _drain(writer: asyncio.StreamWriter, timeout: float | None) -> None:  # noqa: ASYNC109
    if timeout is None or not writer.transport.get_write_buffer_size():
        await writer.drain()  # returns at once unless the buffer is over its high-water mark
    else:
        async with asyncio.timeout(timeout):
            await writer.drain()


def _stale(exc: BaseException) -> bool:
    """A failure that says a kept-alive connection was closed before it was used."""
    return isinstance(exc, NoAnswer | BrokenPipeError | ConnectionResetError)
