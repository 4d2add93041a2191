"""The model gateway's door in the sandbox: a TCP listener on loopback (``127.0.0.1:4000``)
whose every connection is spliced, byte for byte, to the orchestrator's gateway. No HTTP is
parsed here (SSE, keep-alive, chunked bodies pass as they are).

Two ways to the gateway, by the enrollment's ``model`` part:

* ``{listen, socket, files}`` (the local engine): each connection dials the gateway's unix
  socket in the run directory.
* ``{listen, wait, files}`` (Kubernetes, where the pod cannot dial out): the orchestrator
  parks connections here (``POST /model/relay``, signed like every request, answered ``101``
  with the agent's proof). Each harness connection takes one, announces it with
  :data:`PAIRED` (the orchestrator parks another) and is spliced to it; with none free
  within ``wait`` seconds it is answered 503, never left hanging.

Started only for a sandbox enrolled with a ``model`` part: an agent without one never
imports this module. ``files`` are the harness config files (absolute path -> text),
written once at enrollment.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import select
import socket
import threading
import time
from typing import Any

from . import proof
from .http import Conn, HTTPError, Request, invalid, listen_socket, log
from .loop import Loop

CHUNK = 64 * 1024
RELAY_PATH = "/model/relay"
RELAY_PROTOCOL = "orchard-model-relay"
PAIRED = b"+"
"""The agent's first byte on a parked connection: a harness connection took it."""
MAX_WAITING = 256
"""Harness connections waiting for a parked connection at once; more are answered 503."""


def write_files(files: dict[str, str]) -> None:
    for path, text in files.items():
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
        except OSError as exc:
            log(f"cannot write the harness config {path}: {exc}")


def parse(model: Any) -> tuple[str, int, str | None, float, dict[str, str]]:
    """Checked ``(host, port, socket, wait, files)`` of an enrollment's ``model`` (``socket``
    None: parked connections, waited for at most ``wait`` seconds)."""
    if not isinstance(model, dict):
        raise invalid("model must be an object {listen, socket or wait, files}")
    host, _, port = str(model.get("listen", "")).rpartition(":")
    socket_path = model.get("socket")
    wait = model.get("wait", 0)
    files = model.get("files") or {}
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise invalid("model.listen must be HOST:PORT")
    if socket_path is not None and (not isinstance(socket_path, str) or socket_path[:1] != "/"):
        raise invalid("model.socket must be an absolute path")
    if socket_path is None and (
        isinstance(wait, bool) or not isinstance(wait, int | float) or not 0 < wait <= 300
    ):
        raise invalid("model.wait must be a number of seconds in (0, 300] without model.socket")
    if not isinstance(files, dict) or not all(
        isinstance(k, str) and k.startswith("/") and isinstance(v, str) for k, v in files.items()
    ):
        raise invalid("model.files must map absolute paths to text")
    return host, int(port), socket_path, float(wait), files


class _Parked:
    """A connection the orchestrator parked, until a harness connection is spliced to it."""

    def __init__(self, conn: Conn) -> None:
        self.conn = conn
        self.done = threading.Event()

    @property
    def alive(self) -> bool:
        """Neither closed nor readable: a parked connection carries nothing until it is
        paired, so readable means the orchestrator closed it (or broke the protocol)."""
        if self.conn.closed or self.done.is_set():
            return False
        poller = select.poll()  # not select(): descriptors past 1023 are common here
        poller.register(self.conn.sock, select.POLLIN)
        return not poller.poll(0)


class Relay:
    """The listener and the connections it is spliced to (see the module's docstring)."""

    def __init__(self, socket_path: str | None, wait: float) -> None:
        self.socket_path = socket_path
        self.wait = wait
        self.lock = threading.Condition()
        self._parked: collections.deque[_Parked] = collections.deque()
        self._waiting = 0  # harness connections waiting for a parked one

    def park(self, req: Request) -> None:
        """``POST /model/relay``: hold this connection for the next harness connection."""
        if self.socket_path is not None:
            message = "this agent relays model calls to its socket, not over parked connections"
            raise HTTPError(409, "conflict", message)
        req.keep_alive = False
        req.conn.write(
            req.head(101, [("Upgrade", RELAY_PROTOCOL), ("Connection", "Upgrade")], proof.UPGRADE)
        )
        parked = _Parked(req.conn)
        with self.lock:
            # Parks whose orchestrator went away (it closed them, or restarted) leave here.
            for stale in [p for p in self._parked if not p.alive]:
                self._parked.remove(stale)
                stale.done.set()
            self._parked.append(parked)
            self.lock.notify()
        parked.done.wait()  # this thread holds the connection until its splice has ended

    def _take(self) -> _Parked | None:
        """A live parked connection, waited for at most ``wait`` seconds; None if none came."""
        deadline = time.monotonic() + self.wait
        with self.lock:
            self._waiting += 1
            try:
                while True:
                    while self._parked:
                        parked = self._parked.popleft()
                        if parked.alive:
                            return parked
                        parked.done.set()
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return None
                    self.lock.wait(left)
            finally:
                self._waiting -= 1

    def connection(self, conn: Conn) -> None:
        """A harness connection: spliced to the gateway, or answered with why it cannot be."""
        try:
            if self.socket_path is not None:
                up = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    up.connect(self.socket_path)
                except OSError as exc:
                    up.close()
                    message = f"the model gateway is not reachable: {exc.strerror}"
                    _refuse(conn, 502, message)
                    return
                _splice(conn, Conn(up))
                return
            if self._waiting >= MAX_WAITING:
                message = f"{MAX_WAITING} connections wait for the model gateway already"
                _refuse(conn, 503, message)
                return
            parked = self._take()
            if parked is None:
                message = (
                    f"no connection to the model gateway came free within {self.wait:g} s: "
                    "too many model connections are open in this sandbox, or the gateway is "
                    "unreachable"
                )
                _refuse(conn, 503, message)
                return
            try:
                parked.conn.write(PAIRED)
                _splice(conn, parked.conn)
            finally:
                parked.done.set()
        except OSError:
            pass  # a connection broke
        finally:
            conn.close()


def start(model: Any, loop: Loop) -> Relay:
    """Listen for harness connections, served on ``loop`` (from any thread: it may not be
    running yet)."""
    host, port, socket_path, wait, files = parse(model)
    write_files(files)
    relay = Relay(socket_path, wait)
    listener = listen_socket("tcp", host, port)
    loop.call_soon(lambda: loop.serve(listener, relay.connection))
    way = socket_path or "parked connections"
    log(f"model gateway relay on {host}:{port} to {way}")
    return relay


def _splice(conn: Conn, up: Conn) -> None:
    """Copy both ways until both have ended (each end half-closed as its side finishes)."""
    upward = threading.Thread(target=_pipe, args=(conn, up), daemon=True)
    upward.start()
    try:
        _pipe(up, conn)
        upward.join()
    finally:
        up.close()


def _pipe(source: Conn, sink: Conn) -> None:
    try:
        while data := source.read(CHUNK):
            sink.write(data)
        sink.write_eof()  # half-close: the other way may still be answering
    except OSError:
        sink.close()  # and so the other way ends too
        source.close()


def _refuse(conn: Conn, status: int, message: str) -> None:
    """Answer ``status`` with ``message`` (OpenAI's error shape, which harnesses show), then
    half-close and swallow what the harness still sends (at most 1 MiB for 1 s): closing
    with its request unread would reset the connection before the answer is read."""
    reason = {502: "Bad Gateway", 503: "Service Unavailable"}[status]
    error = {"message": message, "type": "orchard_gateway_error", "code": status}
    body = json.dumps({"error": error}).encode()
    conn.write(
        b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\nconnection: close\r\n"
        b"content-length: %d\r\n\r\n%b" % (status, reason.encode(), len(body), body)
    )
    conn.write_eof()
    deadline = time.monotonic() + 1.0
    left = 1024 * 1024
    with contextlib.suppress(OSError):
        while left > 0 and (remaining := deadline - time.monotonic()) > 0:
            conn.sock.settimeout(remaining)
            data = conn.read(CHUNK)
            if not data:
                break
            left -= len(data)
