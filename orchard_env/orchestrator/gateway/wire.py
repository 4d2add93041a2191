"""HTTP/1.1 as the gateway reads it from a sandbox: one request at a time off a keep-alive
connection, every part bounded (line, headers, body), chunked or Content-Length bodies.

Whatever the sandbox sends that is not such a request is a :class:`BadRequest` with a
status and a message for the harness; the connection is then closed.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

MAX_LINE = 16 * 1024
MAX_HEADERS_BYTES = 64 * 1024
MAX_HEADERS = 128
MAX_BODY = 32 * 1024 * 1024
HEAD_TIMEOUT = 60.0  # seconds for a request's headers and body once its first byte came
BODY_TIMEOUT = 120.0
_TOKEN = set("!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")


class BadRequest(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass
class Request:
    method: str
    target: str
    version: str
    headers: list[tuple[str, str]]  # names lower-cased, in order
    body: bytes = b""

    def header(self, name: str) -> str | None:
        for key, value in self.headers:
            if key == name:
                return value
        return None

    @property
    def keep_alive(self) -> bool:
        connection = (self.header("connection") or "").lower()
        if self.version == "HTTP/1.0":
            return "keep-alive" in connection
        return "close" not in connection


async def _line(reader: asyncio.StreamReader, status: int, what: str) -> bytes:
    try:
        return await reader.readline()
    except ValueError:  # the stream's limit: a line longer than MAX_LINE
        raise BadRequest(status, f"{what} is over {MAX_LINE} bytes") from None


async def read_request(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> Request | None:
    """The next request, None at a clean end of the connection (or a keep-alive one idle)."""
    first = await _line(reader, 414, "the request line")
    if not first:
        return None
    try:
        async with asyncio.timeout(HEAD_TIMEOUT + BODY_TIMEOUT):
            return await _read_rest(first, reader, writer)
    except TimeoutError:
        raise BadRequest(408, "the request was not sent in time") from None


async def _read_rest(
    first: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> Request:
    if not first.endswith(b"\n") or len(first) > MAX_LINE:
        raise BadRequest(414, f"the request line is over {MAX_LINE} bytes")
    parts = first.decode("latin-1").strip().split(" ")
    if len(parts) != 3 or not parts[0] or set(parts[0]) - _TOKEN:
        raise BadRequest(400, "not an HTTP request line (METHOD /path HTTP/1.1)")
    method, target, version = parts
    if version not in ("HTTP/1.1", "HTTP/1.0"):
        raise BadRequest(505, f"{version!r}: only HTTP/1.1 is spoken here")
    if method == "CONNECT" or not target.startswith("/"):
        raise BadRequest(400, "the gateway is no proxy: send origin-form targets (/v1/...) only")
    headers: list[tuple[str, str]] = []
    size = 0
    while True:
        line = await _line(reader, 431, "a header line")
        size += len(line)
        if not line.endswith(b"\n") or size > MAX_HEADERS_BYTES or len(headers) >= MAX_HEADERS:
            raise BadRequest(431, f"headers over {MAX_HEADERS_BYTES} bytes or {MAX_HEADERS} lines")
        if line in (b"\r\n", b"\n"):
            break
        name, sep, value = line.decode("latin-1").partition(":")
        if not sep or not name or set(name) - _TOKEN:
            raise BadRequest(400, f"a malformed header line: {line[:80]!r}")
        headers.append((name.lower(), value.strip()))
    request = Request(method, target, version, headers)
    if (request.header("expect") or "").lower() == "100-continue":
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    request.body = await _read_body(request, reader)
    return request


async def _read_body(request: Request, reader: asyncio.StreamReader) -> bytes:
    encoding = (request.header("transfer-encoding") or "").lower()
    length = request.header("content-length")
    if encoding:
        if encoding != "chunked" or length is not None:
            raise BadRequest(400, f"transfer-encoding {encoding!r} is not understood")
        return await _read_chunked(reader)
    if length is None:
        return b""
    if not length.isdigit():
        raise BadRequest(400, f"content-length {length[:40]!r} is not a number")
    if int(length) > MAX_BODY:
        raise BadRequest(413, f"the request body is over {MAX_BODY} bytes")
    return await reader.readexactly(int(length))


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    parts: list[bytes] = []
    total = 0
    while True:
        line = await _line(reader, 400, "a chunk size line")
        size_text = line.split(b";", 1)[0].strip()
        try:
            size = int(size_text, 16)
        except ValueError:
            raise BadRequest(400, f"a malformed chunk size {size_text[:20]!r}") from None
        total += size
        if size < 0 or total > MAX_BODY:
            raise BadRequest(413, f"the request body is over {MAX_BODY} bytes")
        if size == 0:
            while (await _line(reader, 431, "a trailer")) not in (b"\r\n", b"\n", b""):
                pass  # trailers, dropped
            return b"".join(parts)
        data = await reader.readexactly(size + 2)
        parts.append(data[:size])


def status_line(status: int) -> bytes:
    return f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\n".encode()


def error_bytes(status: int, message: str, *, anthropic: bool, close: bool) -> bytes:
    """An error answer in the caller's API shape (OpenAI or Anthropic), so harnesses show it."""
    kind = "orchard_gateway_error"
    if anthropic:
        body = {"type": "error", "error": {"type": kind, "message": message}}
    else:
        body = {"error": {"message": message, "type": kind, "code": status}}
    data = json.dumps(body).encode()
    head = status_line(status) + b"content-type: application/json\r\n"
    head += f"content-length: {len(data)}\r\n".encode()
    if close:
        head += b"connection: close\r\n"
    return head + b"\r\n" + data


_REASONS = {
    200: "OK",
    400: "Bad Request",
    403: "Forbidden",
    404: "Not Found",
    408: "Request Timeout",
    413: "Payload Too Large",
    414: "URI Too Long",
    426: "Upgrade Required",
    431: "Request Header Fields Too Large",
    502: "Bad Gateway",
    503: "Service Unavailable",
    505: "HTTP Version Not Supported",
}
