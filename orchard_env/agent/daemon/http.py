"""HTTP/1.1 for the agent: connections (blocking, one thread each), request parsing (bodies
streamed), responses, and the error type every route raises (answered as ``{"code",
"message"}`` JSON)."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import socket
import stat
import sys
from collections.abc import Iterator
from typing import Any

from . import proof

FILE_CHUNK = 256 * 1024
HEX_DIGITS = frozenset("0123456789abcdefABCDEF")
MAX_HEADER_BYTES = 64 * 1024
MAX_JSON_BODY = 64 * 1024 * 1024
REASONS = {
    101: "Switching Protocols",
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    404: "Not Found",
    405: "Method Not Allowed",
    409: "Conflict",
    413: "Payload Too Large",
    500: "Internal Server Error",
}


def log(message: str) -> None:
    sys.stderr.write(f"orchard-agent[{os.getpid()}]: {message}\n")
    sys.stderr.flush()


class HTTPError(Exception):
    """An error answered as ``{"code", "message"}`` JSON with ``status``."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message


def invalid(message: str) -> HTTPError:
    return HTTPError(400, "invalid_request", message)


def file_not_found(path: str) -> HTTPError:
    return HTTPError(404, "file_not_found", f"{path} does not exist")


def os_error(exc: OSError, path: str, action: str) -> HTTPError:
    """Map a filesystem error to the agent's error codes with a message naming the path."""
    if isinstance(exc, FileNotFoundError):
        return file_not_found(path)
    if isinstance(exc, PermissionError):
        return invalid(f"permission denied {action} {path}")
    if isinstance(exc, NotADirectoryError):
        return invalid(f"{action} {path} failed: a parent is not a directory")
    return invalid(f"{action} {path} failed: {exc.strerror or exc}")


class IncompleteRead(ConnectionError):
    """The peer closed the connection before what was being read was complete."""

    def __init__(self, partial: bytes) -> None:
        super().__init__(f"connection closed after {len(partial)} bytes")
        self.partial = partial


class Conn:
    """One blocking connection, read through a buffer (at most ``limit`` bytes are buffered
    while looking for a separator) and written whole."""

    def __init__(self, sock: socket.socket, limit: int = MAX_HEADER_BYTES) -> None:
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            # Answers go out in pieces (a head, then chunks): with Nagle's algorithm each
            # piece after the first would wait for the peer's delayed ACK (40 ms).
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self.limit = limit
        self.buffer = bytearray()
        self.eof = False
        self.closed = False

    def _fill(self) -> bool:
        """Read more into the buffer; False at end of stream."""
        if self.eof:
            return False
        data = self.sock.recv(FILE_CHUNK)
        if not data:
            self.eof = True
            return False
        self.buffer += data
        return True

    def readuntil(self, separator: bytes) -> bytes:
        """Up to and including ``separator``; :class:`IncompleteRead` at end of stream, and
        :class:`HTTPError` 400 when it is not within ``limit`` bytes."""
        start = 0
        while True:
            found = self.buffer.find(separator, start)
            if found >= 0:
                return self._take(found + len(separator))
            if len(self.buffer) > self.limit:
                raise invalid(f"request head is over {self.limit} bytes")
            start = max(len(self.buffer) - len(separator) + 1, 0)
            if not self._fill():
                partial = bytes(self.buffer)
                self.buffer.clear()
                raise IncompleteRead(partial)

    def read(self, size: int) -> bytes:
        """Up to ``size`` bytes (what is buffered first); empty at end of stream."""
        if not self.buffer and not self._fill():
            return b""
        return self._take(size)

    def readexactly(self, size: int) -> bytes:
        while len(self.buffer) < size:
            if not self._fill():
                partial = bytes(self.buffer)
                self.buffer.clear()
                raise IncompleteRead(partial)
        return self._take(size)

    def _take(self, size: int) -> bytes:
        """The first ``size`` bytes of the buffer (fewer if it holds fewer), removed from it."""
        data = bytes(self.buffer[:size])
        del self.buffer[:size]
        return data

    def write(self, *parts: bytes) -> None:
        self.sock.sendall(parts[0] if len(parts) == 1 else b"".join(parts))

    def write_eof(self) -> None:
        with contextlib.suppress(OSError):  # gone already
            self.sock.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        """Shut the connection down, then close it: a thread still blocked reading it wakes
        (a bare close would leave it blocked, or reading whatever reuses the descriptor)."""
        if not self.closed:
            self.closed = True
            with contextlib.suppress(OSError):  # the peer is gone already
                self.sock.shutdown(socket.SHUT_RDWR)
            self.sock.close()


def listen_socket(kind: str, address: str, port: int) -> socket.socket:
    """The agent's listening socket (``backlog`` 1024: a burst of connections waits)."""
    if kind == "unix":
        os.makedirs(os.path.dirname(address), exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISSOCK(os.lstat(address).st_mode):
                os.unlink(address)  # left by an earlier agent (anything else: bind fails)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(address)
        # Anyone in the sandbox may connect: every request needs the key's MAC, and every
        # answer proves the agent holds it.
        os.chmod(address, 0o666)  # noqa: S103
    else:
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((address, port))
    sock.listen(1024)
    sock.setblocking(False)
    return sock


def unquote(text: str, plus: bool = False) -> str:
    """Percent-decoding as ``urllib.parse.unquote`` (``+`` as a space with ``plus``, as in a
    query): UTF-8, malformed escapes kept as they are. urllib.parse itself (and ipaddress,
    which it imports) would cost the idle agent half a megabyte."""
    if plus:
        text = text.replace("+", " ")
    if "%" not in text:
        return text
    head, *pieces = text.split("%")
    out = bytearray(head.encode())
    for piece in pieces:
        code = piece[:2]
        if len(code) == 2 and all(c in HEX_DIGITS for c in code):
            out.append(int(code, 16))
            out += piece[2:].encode()
        else:
            out += b"%" + piece.encode()
    return out.decode("utf-8", errors="replace")


def parse_query(query: str) -> dict[str, str]:
    """``a=1&b=`` -> {"a": "1", "b": ""}, as ``dict(parse_qsl(query, keep_blank_values=True))``."""
    pairs = {}
    for field in query.split("&"):
        if field:
            key, _, value = field.partition("=")
            pairs[unquote(key, plus=True)] = unquote(value, plus=True)
    return pairs


class Request:
    """One parsed HTTP/1.1 request on a connection, with its body still on the wire."""

    def __init__(
        self,
        conn: Conn,
        method: str,
        target: str,
        version: str,
        headers: dict[str, str],
    ) -> None:
        self.conn = conn
        self.method = method
        self.version = version
        self.headers = headers
        self.target = target
        # Set once the request is authenticated (see Agent.check_auth): every answer is then
        # proven (proof.PROOF_HEADER), and a body announced by its digest must match it.
        self.key: bytes | None = None
        self.nonce: str | None = None
        self.body_digest: str | None = None
        self._sent: Any = None  # the digest of a job stream's bytes so far
        raw_path, _, query = target.partition("?")
        self.path = unquote(raw_path)
        self.query = parse_query(query)
        connection = headers.get("connection", "").lower()
        self.keep_alive = version == "HTTP/1.1" and "close" not in connection
        self.started = False  # response head sent
        self.chunked_body = "chunked" in headers.get("transfer-encoding", "").lower()
        length = headers.get("content-length")
        if self.chunked_body:
            self.remaining: int | None = None
        else:
            try:
                self.remaining = int(length) if length else 0
            except ValueError:
                raise invalid(f"bad Content-Length {length!r}") from None
            if self.remaining < 0:
                raise invalid(f"bad Content-Length {length!r}")
        self.body_done = not self.chunked_body and self.remaining == 0
        self.has_body = not self.body_done

    # request body

    def body(self) -> Iterator[bytes]:
        """The request body, streamed (Content-Length or chunked)."""
        if self.body_done:
            return
        if "100-continue" in self.headers.get("expect", "").lower() and not self.started:
            self.conn.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        received = hashlib.sha256()
        if self.chunked_body:
            for chunk in self._chunked():
                received.update(chunk)
                yield chunk
        else:
            while self.remaining:
                chunk = self.conn.read(min(self.remaining, FILE_CHUNK))
                if not chunk:
                    raise ConnectionResetError("client closed the connection mid-body")
                self.remaining -= len(chunk)
                received.update(chunk)
                yield chunk
        self.body_done = True
        self.check_body(received.hexdigest())

    def check_body(self, received: str) -> None:
        """The body read is the one the request's MAC covers (unless it is streamed)."""
        expected = self.body_digest
        if expected is not None and expected != proof.UNSIGNED_BODY and expected != received:
            self.keep_alive = False
            raise HTTPError(401, "unauthenticated", "the request body is not the one signed")

    def _chunked(self) -> Iterator[bytes]:
        while True:
            line = self.conn.readuntil(b"\r\n")
            try:
                size = int(line.split(b";", 1)[0].strip(), 16)
            except ValueError:
                raise invalid("bad chunk size in the request body") from None
            if size == 0:
                while self.conn.readuntil(b"\r\n") != b"\r\n":
                    pass  # trailers are ignored
                return
            while size:
                chunk = self.conn.read(min(size, FILE_CHUNK))
                if not chunk:
                    raise ConnectionResetError("client closed the connection mid-body")
                size -= len(chunk)
                yield chunk
            if self.conn.readexactly(2) != b"\r\n":
                raise invalid("bad chunk terminator in the request body")

    def read_body(self, limit: int) -> bytes:
        parts: list[bytes] = []
        total = 0
        for chunk in self.body():
            total += len(chunk)
            if total > limit:
                self.keep_alive = False
                raise HTTPError(413, "invalid_request", f"request body is over {limit} bytes")
            parts.append(chunk)
        return b"".join(parts)

    def json(self) -> dict[str, Any]:
        raw = self.read_body(MAX_JSON_BODY)
        try:
            value = json.loads(raw or b"{}")
        except ValueError as exc:
            raise invalid(f"request body is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise invalid("request body must be a JSON object")
        return value

    def discard_body(self) -> None:
        for _ in self.body():
            pass

    # query parameters

    def arg(self, name: str) -> str:
        value = self.query.get(name)
        if not value:
            raise invalid(f"query parameter {name!r} is required")
        return value

    def flag(self, name: str, default: bool) -> bool:
        value = self.query.get(name)
        if value is None or value == "":
            return default
        lowered = value.lower()
        if lowered in ("1", "true", "yes"):
            return True
        if lowered in ("0", "false", "no"):
            return False
        raise invalid(f"query parameter {name!r} must be true or false, not {value!r}")

    # response

    def head(self, status: int, headers: list[tuple[str, str]], body: str) -> bytes:
        """The response head; proven (over ``body``: its digest, or a proof kind) when the
        request was authenticated."""
        self.started = True
        lines = [f"HTTP/1.1 {status} {REASONS.get(status, 'Unknown')}"]
        lines.extend(f"{name}: {value}" for name, value in headers)
        if self.key is not None and self.nonce is not None:
            mac = proof.response_mac(self.key, self.nonce, status, body)
            lines.append(f"{proof.PROOF_HEADER}: {mac}")
        if status != 101:
            lines.append("Connection: " + ("keep-alive" if self.keep_alive else "close"))
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")

    def send_json(self, status: int, payload: Any) -> None:
        body = json.dumps(payload, separators=(",", ":")).encode()
        head = self.head(
            status,
            [("Content-Type", "application/json"), ("Content-Length", str(len(body)))],
            proof.digest(body),
        )
        self.conn.write(head + body)

    def start_chunked(self, content_type: str) -> None:
        """Start a job stream (its lines proven as a whole by :meth:`end_chunked`)."""
        self._sent = hashlib.sha256()
        self.conn.write(
            self.head(
                200,
                [("Content-Type", content_type), ("Transfer-Encoding", "chunked")],
                proof.STREAM,
            )
        )

    def write_chunk(self, data: bytes) -> None:
        if data:
            self._sent.update(data)
            self.conn.write(b"%x\r\n" % len(data), data, b"\r\n")

    def end_chunked(self) -> None:
        """End a job stream with the proof line over every byte sent before it."""
        if self.key is not None and self.nonce is not None:
            mac = proof.stream_mac(self.key, self.nonce, self._sent.hexdigest())
            line = b'{"t":"p","mac":"%s"}\n' % mac.encode()
            self.conn.write(b"%x\r\n" % len(line), line, b"\r\n0\r\n\r\n")
        else:
            self.conn.write(b"0\r\n\r\n")


def read_request(conn: Conn) -> Request | None:
    """Parse the next request head; None when the client closed the connection cleanly."""
    try:
        raw = conn.readuntil(b"\r\n\r\n")
    except IncompleteRead as exc:
        if exc.partial.strip():
            raise invalid("incomplete request head") from None
        return None
    lines = raw.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise invalid(f"bad request line {lines[0][:200]!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep:
            raise invalid(f"bad header line {line[:200]!r}")
        key = name.strip().lower()
        value = value.strip()
        headers[key] = f"{headers[key]}, {value}" if key in headers else value
    return Request(conn, parts[0], parts[1], parts[2], headers)


def string_map(value: Any, field: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise invalid(f"{field} must be an object of strings")
    return value


def decode_b64(value: Any, field: str) -> bytes:
    if not isinstance(value, str):
        raise invalid(f"{field} must be a base64 string")
    try:
        return base64.b64decode(value, validate=True)
    except ValueError:
        raise invalid(f"{field} is not valid base64") from None


def error_response(exc: HTTPError) -> bytes:
    """A complete response for an error found before a request could be parsed (closes)."""
    body = json.dumps({"code": exc.code, "message": exc.message}).encode()
    return (
        f"HTTP/1.1 {exc.status} {REASONS.get(exc.status, 'Error')}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n".encode()
        + body
    )
