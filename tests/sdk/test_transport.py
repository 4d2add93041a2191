"""The async client's lean transport against small servers of the tests' own: kept-alive
connections, request bodies, failures mapped to the httpx errors the SDK's retries know, TLS
verified as httpx verifies it, and httpx's own transport wherever a proxy is configured."""

from __future__ import annotations

import asyncio
import ssl
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import httpx
import pytest

from orchard_env.sdk import AsyncSandboxClient
from orchard_env.sdk._transport import LeanTransport

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class Server:
    """An HTTP/1.1 server on loopback whose connections are counted."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.port = 0

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.handler(reader, writer)
        finally:
            writer.close()


async def read_request(reader: asyncio.StreamReader) -> tuple[str, bytes] | None:
    """The request line and the body (Content-Length or chunked); None at the end."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return None
    lines = head.decode().split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:] if line)
    if headers.get("transfer-encoding") == "chunked":
        body = b""
        while size := int((await reader.readuntil(b"\r\n"))[:-2], 16):
            body += (await reader.readexactly(size + 2))[:-2]
        await reader.readexactly(2)
    else:
        body = await reader.readexactly(int(headers.get("content-length", "0")))
    return lines[0], body


async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Answers every request on the connection with its request line and body."""
    while (request := await read_request(reader)) is not None:
        line, body = request
        payload = line.encode() + b"\n" + body
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(payload), payload))
        await writer.drain()


@pytest.fixture
async def serve() -> AsyncIterator[Callable[..., Awaitable[Server]]]:
    servers: list[asyncio.Server] = []

    async def start(handler: Handler, tls: ssl.SSLContext | None = None) -> Server:
        server = Server(handler)
        listening = await asyncio.start_server(server._serve, "127.0.0.1", 0, ssl=tls)
        server.port = listening.sockets[0].getsockname()[1]
        servers.append(listening)
        return server

    yield start
    for listening in servers:
        listening.close()


async def test_requests_share_a_kept_alive_connection_and_bodies_arrive_whole(
    serve: Callable[..., Awaitable[Server]],
) -> None:
    server = await serve(echo)

    async def chunks() -> AsyncIterator[bytes]:
        yield b"streamed "
        yield b"body"

    async with httpx.AsyncClient(
        transport=LeanTransport(), base_url=f"http://127.0.0.1:{server.port}"
    ) as client:
        first = await client.get("/a?x=1")
        second = await client.post("/b", content=b"payload")
        third = await client.put("/c", content=chunks())
    assert first.text == "GET /a?x=1 HTTP/1.1\n"
    assert second.text == "POST /b HTTP/1.1\npayload"
    assert third.text == "PUT /c HTTP/1.1\nstreamed body"
    assert server.connections == 1


async def test_failures_are_the_httpx_errors_the_sdk_retries_on(
    serve: Callable[..., Awaitable[Server]], unused_tcp_port: int
) -> None:
    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly this")
        await writer.drain()

    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"SMTP ready\r\n\r\n")
        await writer.drain()

    async with httpx.AsyncClient(transport=LeanTransport()) as client:
        with pytest.raises(httpx.ConnectError):  # nothing sent: safe to send again
            await client.get(f"http://127.0.0.1:{unused_tcp_port}/")
        cutter = await serve(cut)
        with pytest.raises(httpx.ReadError, match="reading the answer"):
            await client.get(f"http://127.0.0.1:{cutter.port}/")
        liar = await serve(garbage)
        with pytest.raises(httpx.RemoteProtocolError, match=r"not an HTTP/1\.1 status line"):
            await client.get(f"http://127.0.0.1:{liar.port}/")
        with pytest.raises(httpx.UnsupportedProtocol):
            await client.get("ftp://127.0.0.1/")


def _certificate(folder: Path) -> tuple[Path, Path]:
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        [
            *("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"),
            *("-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"),
            *("-keyout", str(key), "-out", str(cert)),
        ],
        check=True,
        capture_output=True,
    )
    return cert, key


async def test_tls_is_verified_against_the_trusted_certificates(
    serve: Callable[..., Awaitable[Server]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cert, key = await asyncio.to_thread(_certificate, tmp_path)
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(cert, key)
    server = await serve(echo, tls)
    url = f"https://127.0.0.1:{server.port}/secure"
    async with httpx.AsyncClient(transport=LeanTransport()) as client:
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            await client.get(url)
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))  # as httpx honours it
    async with httpx.AsyncClient(transport=LeanTransport()) as client:
        assert (await client.get(url)).text == "GET /secure HTTP/1.1\n"


async def test_a_configured_proxy_keeps_httpxs_own_transport(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with AsyncSandboxClient("http://127.0.0.1:9", auto_cleanup=False) as lean:
        assert isinstance(lean._http._transport, LeanTransport)
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.internal:3128")
    async with AsyncSandboxClient("http://127.0.0.1:9", auto_cleanup=False) as proxied:
        assert isinstance(proxied._http._transport, httpx.AsyncHTTPTransport)
