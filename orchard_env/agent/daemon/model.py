"""The model gateway's door in the sandbox: a TCP listener on loopback (``127.0.0.1:4000``)
whose every connection is spliced, byte for byte, to the orchestrator's gateway socket in the
run directory. No HTTP is parsed here (SSE, keep-alive, chunked bodies pass as they are).

Started only for a sandbox enrolled with a ``model`` part (``{listen, socket, files}``): an
agent without one never imports this module. ``files`` are the harness config files
(absolute path -> text), written once at enrollment.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from typing import Any

from .http import invalid, log

CHUNK = 64 * 1024


def write_files(files: dict[str, str]) -> None:
    for path, text in files.items():
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
        except OSError as exc:
            log(f"cannot write the harness config {path}: {exc}")


def parse(model: Any) -> tuple[str, int, str, dict[str, str]]:
    """Checked ``(host, port, socket, files)`` of an enrollment's ``model``."""
    if not isinstance(model, dict):
        raise invalid("model must be an object {listen, socket, files}")
    host, _, port = str(model.get("listen", "")).rpartition(":")
    socket_path = model.get("socket")
    files = model.get("files") or {}
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise invalid("model.listen must be HOST:PORT")
    if not isinstance(socket_path, str) or not socket_path.startswith("/"):
        raise invalid("model.socket must be an absolute path")
    if not isinstance(files, dict) or not all(
        isinstance(k, str) and k.startswith("/") and isinstance(v, str) for k, v in files.items()
    ):
        raise invalid("model.files must map absolute paths to text")
    return host, int(port), socket_path, files


async def start(model: Any) -> asyncio.Server:
    host, port, socket_path, files = parse(model)
    write_files(files)

    async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_unix_connection(socket_path)
        except OSError as exc:
            writer.write(_unavailable(f"the model gateway is not reachable: {exc.strerror}"))
            with contextlib.suppress(OSError):
                await writer.drain()
            writer.close()
            return
        try:
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        finally:
            up_writer.close()
            writer.close()

    server = await asyncio.start_server(relay, host, port, backlog=1024)
    log(f"model gateway relay on {host}:{port}")
    return server


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(CHUNK):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()  # half-close: the other way may still be answering
    except OSError:
        writer.close()


def _unavailable(message: str) -> bytes:
    body = (f'{{"error": {{"message": "{message}", "type": "orchard_gateway_error"}}}}').encode()
    return (
        b"HTTP/1.1 502 Bad Gateway\r\ncontent-type: application/json\r\n"
        b"connection: close\r\ncontent-length: %d\r\n\r\n%b" % (len(body), body)
    )
