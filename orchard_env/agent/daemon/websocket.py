"""A text-message WebSocket (RFC 6455, server side) over an upgraded agent connection."""

from __future__ import annotations

import base64
import json
import struct
import threading
from typing import Any

from . import proof
from .http import Conn, Request, invalid

WS_MAX_MESSAGE = 16 * 1024 * 1024
WS_GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"


def accept(req: Request) -> WebSocket:
    """Answer the upgrade of ``req`` with 101 and return the WebSocket on its connection."""
    import hashlib  # only for the handshake

    key = req.headers.get("sec-websocket-key")
    if req.headers.get("upgrade", "").lower() != "websocket" or not key:
        raise invalid(f"GET {req.path} needs a WebSocket upgrade (Upgrade: websocket)")
    if req.headers.get("sec-websocket-version") != "13":
        raise invalid("unsupported WebSocket version (need 13)")
    digest = hashlib.sha1((key + WS_GUID).encode()).digest()  # noqa: S324 - RFC 6455
    req.keep_alive = False
    req.conn.write(
        req.head(
            101,
            [
                ("Upgrade", "websocket"),
                ("Connection", "Upgrade"),
                ("Sec-WebSocket-Accept", base64.b64encode(digest).decode()),
            ],
            proof.UPGRADE,
        )
    )
    return WebSocket(req.conn)


class WebSocketClosed(Exception):
    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


def unmask(payload: bytes, mask: bytes) -> bytes:
    size = len(payload)
    if not size:
        return payload
    key = (mask * (size // 4 + 1))[:size]
    return (int.from_bytes(payload, "little") ^ int.from_bytes(key, "little")).to_bytes(
        size, "little"
    )


class WebSocket:
    """Text-message WebSocket over an upgraded connection: ping/pong and close handled here.
    One thread receives; any thread may send."""

    def __init__(self, conn: Conn) -> None:
        self.conn = conn
        self.lock = threading.Lock()
        self.closing = False  # a close frame was sent

    def _send(self, opcode: int, payload: bytes) -> None:
        size = len(payload)
        if size < 126:
            head = struct.pack("!BB", 0x80 | opcode, size)
        elif size < 65536:
            head = struct.pack("!BBH", 0x80 | opcode, 126, size)
        else:
            head = struct.pack("!BBQ", 0x80 | opcode, 127, size)
        with self.lock:
            self.conn.write(head, payload)

    def send_json(self, message: dict[str, Any]) -> None:
        if not self.closing:
            self._send(0x1, json.dumps(message, separators=(",", ":")).encode())

    def _frame(self) -> tuple[bool, int, bytes]:
        first, second = self.conn.readexactly(2)
        size = second & 0x7F
        if size == 126:
            (size,) = struct.unpack("!H", self.conn.readexactly(2))
        elif size == 127:
            (size,) = struct.unpack("!Q", self.conn.readexactly(8))
        if size > WS_MAX_MESSAGE:
            raise WebSocketClosed(1009)
        if not second & 0x80:
            raise WebSocketClosed(1002)  # client frames must be masked
        mask = self.conn.readexactly(4)
        payload = unmask(self.conn.readexactly(size), mask)
        return bool(first & 0x80), first & 0x0F, payload

    def recv(self) -> str | None:
        """The next text message; None once the peer closed (or the connection dropped)."""
        parts: list[bytes] = []
        total = 0
        try:
            while True:
                fin, opcode, payload = self._frame()
                if opcode == 0x8:
                    if not self.closing:
                        self.closing = True
                        self._send(0x8, payload[:2])
                    return None
                if opcode == 0x9:
                    self._send(0xA, payload)
                    continue
                if opcode == 0xA:
                    continue
                if opcode in (0x1, 0x2):
                    parts = [payload]
                    total = len(payload)
                elif opcode == 0x0 and parts:
                    parts.append(payload)
                    total += len(payload)
                else:
                    raise WebSocketClosed(1002)
                if total > WS_MAX_MESSAGE:
                    raise WebSocketClosed(1009)
                if fin:
                    return b"".join(parts).decode("utf-8", "replace")
        except WebSocketClosed as exc:
            self.close(exc.code)
            return None
        except TimeoutError:
            raise  # the caller's deadline (a socket timeout), not the peer's doing
        except OSError:
            return None  # the connection broke (ConnectionError included)

    def send_close(self, code: int, reason: str = "") -> bool:
        """Send a close frame (once: False if one was sent already); the peer answers with
        its own, which :meth:`recv` reads."""
        if self.closing:
            return False
        self.closing = True
        self._send(0x8, struct.pack("!H", code) + reason.encode()[:120])
        return True

    def close(self, code: int, reason: str = "") -> None:
        """Send a close frame and wait briefly for the peer's (no other thread receiving)."""
        try:
            if self.send_close(code, reason):
                self.conn.sock.settimeout(2.0)
                self._until_close()
        except (OSError, WebSocketClosed):
            pass  # TimeoutError and ConnectionError included

    def _until_close(self) -> None:
        while self._frame()[1] != 0x8:
            pass
