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

import asyncio
import collections
import contextlib
import json
import os
from dataclasses import dataclass, field
from typing import Any

from . import proof
from .http import HTTPError, Request, invalid, log

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


@dataclass(eq=False)
class _Parked:
    """A connection the orchestrator parked, until a harness connection is spliced to it."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    done: asyncio.Future[None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )

    @property
    def alive(self) -> bool:
        return not self.reader.at_eof() and not self.writer.is_closing()

    def end(self) -> None:
        if not self.done.done():
            self.done.set_result(None)


class Relay:
    """The listener and the connections it is spliced to (see the module's docstring)."""

    def __init__(self, socket_path: str | None, wait: float) -> None:
        self.socket_path = socket_path
        self.wait = wait
        self.server: asyncio.Server | None = None
        self._parked: collections.deque[_Parked] = collections.deque()
        self._waiting: collections.deque[asyncio.Future[_Parked]] = collections.deque()

    async def park(self, req: Request) -> None:
        """``POST /model/relay``: hold this connection for the next harness connection."""
        if self.socket_path is not None:
            message = "this agent relays model calls to its socket, not over parked connections"
            raise HTTPError(409, "conflict", message)
        req.keep_alive = False
        req.writer.write(
            req.head(101, [("Upgrade", RELAY_PROTOCOL), ("Connection", "Upgrade")], proof.UPGRADE)
        )
        await req.writer.drain()
        parked = _Parked(req.reader, req.writer)
        # Parks whose orchestrator went away (it closed them, or restarted) leave here.
        for stale in [p for p in self._parked if not p.alive]:
            self._parked.remove(stale)
            stale.end()
        while self._waiting:
            waiter = self._waiting.popleft()
            if not waiter.done():
                waiter.set_result(parked)
                break
        else:
            self._parked.append(parked)
        try:
            await parked.done
        finally:
            with contextlib.suppress(ValueError):
                self._parked.remove(parked)

    async def _take(self) -> _Parked | None:
        """A live parked connection, waited for at most ``wait`` seconds; None if none came."""
        while self._parked:
            parked = self._parked.popleft()
            if parked.alive:
                return parked
            parked.end()
        waiter: asyncio.Future[_Parked] = asyncio.get_running_loop().create_future()
        self._waiting.append(waiter)
        try:
            async with asyncio.timeout(self.wait):
                parked = await waiter
        except TimeoutError:
            if waiter.done() and not waiter.cancelled():
                return waiter.result()  # handed over just as the wait ran out
            return None
        finally:
            with contextlib.suppress(ValueError):
                self._waiting.remove(waiter)
        return parked if parked.alive else await self._take()

    async def connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A harness connection: spliced to the gateway, or answered with why it cannot be."""
        if self.socket_path is not None:
            try:
                up_reader, up_writer = await asyncio.open_unix_connection(self.socket_path)
            except OSError as exc:
                message = f"the model gateway is not reachable: {exc.strerror}"
                await _refuse(reader, writer, 502, message)
                return
            await _splice(reader, writer, up_reader, up_writer)
            return
        if len(self._waiting) >= MAX_WAITING:
            message = f"{MAX_WAITING} connections wait for the model gateway already"
            await _refuse(reader, writer, 503, message)
            return
        parked = await self._take()
        if parked is None:
            message = (
                f"no connection to the model gateway came free within {self.wait:g} s: too "
                "many model connections are open in this sandbox, or the gateway is unreachable"
            )
            await _refuse(reader, writer, 503, message)
            return
        try:
            parked.writer.write(PAIRED)
            await _splice(reader, writer, parked.reader, parked.writer)
        finally:
            parked.end()


async def start(model: Any) -> Relay:
    host, port, socket_path, wait, files = parse(model)
    write_files(files)
    relay = Relay(socket_path, wait)
    relay.server = await asyncio.start_server(relay.connection, host, port, backlog=1024)
    way = socket_path or "parked connections"
    log(f"model gateway relay on {host}:{port} to {way}")
    return relay


async def _splice(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    up_reader: asyncio.StreamReader,
    up_writer: asyncio.StreamWriter,
) -> None:
    try:
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
    finally:
        up_writer.close()
        writer.close()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(CHUNK):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()  # half-close: the other way may still be answering
    except OSError:
        writer.close()


async def _refuse(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, status: int, message: str
) -> None:
    """Answer ``status`` with ``message`` (OpenAI's error shape, which harnesses show), then
    half-close and swallow what the harness still sends (at most 1 MiB for 1 s): closing
    with its request unread would reset the connection before the answer is read."""
    reason = {502: "Bad Gateway", 503: "Service Unavailable"}[status]
    error = {"message": message, "type": "orchard_gateway_error", "code": status}
    body = json.dumps({"error": error}).encode()
    writer.write(
        b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\nconnection: close\r\n"
        b"content-length: %d\r\n\r\n%b" % (status, reason.encode(), len(body), body)
    )
    with contextlib.suppress(Exception):
        await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
        async with asyncio.timeout(1.0):
            left = 1024 * 1024
            while left > 0 and (data := await reader.read(CHUNK)):
                left -= len(data)
    writer.close()
