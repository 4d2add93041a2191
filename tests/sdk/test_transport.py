"""The clients' lean transports (async and sync) against small servers of the tests' own:
kept-alive connections, request bodies, failures mapped to the httpx errors the SDK's retries
know, TLS verified as httpx verifies it, and httpx's own transports wherever a proxy is
configured."""

from __future__ import annotations

import asyncio
import ssl
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from orchard_env.sdk import AsyncSandboxClient, SandboxClient
from orchard_env.sdk._transport import LeanSyncTransport, LeanTransport

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


async def echo_one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
    """Answer one request with its request line and body; False at the connection's end."""
    request = await read_request(reader)
    if request is None:
        return False
    line, body = request
    payload = line.encode() + b"\n" + body
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(payload), payload))
    await writer.drain()
    return True


async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Answers every request on the connection."""
    while await echo_one(reader, writer):
        pass


Fetch = Callable[..., Awaitable[httpx.Response]]


@pytest.fixture(params=["async", "sync"])
async def fetch(request: pytest.FixtureRequest) -> AsyncIterator[Fetch]:
    """``await fetch(method, url, **options)`` through an httpx client on a lean transport:
    the async one, or the sync one in a thread (the servers run on this event loop)."""
    if request.param == "async":
        async with httpx.AsyncClient(transport=LeanTransport()) as client:
            yield client.request
        return
    sync = httpx.Client(transport=LeanSyncTransport())

    async def call(method: str, url: str, content: Any = None) -> httpx.Response:
        if hasattr(content, "__aiter__"):  # the sync client takes a plain iterator
            content = iter([piece async for piece in content])
        return await asyncio.to_thread(sync.request, method, url, content=content)

    yield call
    await asyncio.to_thread(sync.close)


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
    serve: Callable[..., Awaitable[Server]], fetch: Fetch
) -> None:
    server = await serve(echo)
    base = f"http://127.0.0.1:{server.port}"

    async def chunks() -> AsyncIterator[bytes]:
        yield b"streamed "
        yield b"body"

    first = await fetch("GET", f"{base}/a?x=1")
    second = await fetch("POST", f"{base}/b", content=b"payload")
    third = await fetch("PUT", f"{base}/c", content=chunks())
    assert first.text == "GET /a?x=1 HTTP/1.1\n"
    assert second.text == "POST /b HTTP/1.1\npayload"
    assert third.text == "PUT /c HTTP/1.1\nstreamed body"
    assert server.connections == 1


async def test_a_kept_alive_connection_the_server_closed_is_replaced(
    serve: Callable[..., Awaitable[Server]], fetch: Fetch
) -> None:
    async def once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await echo_one(reader, writer)  # then closes, though the answer said keep-alive

    server = await serve(once)
    url = f"http://127.0.0.1:{server.port}/again"
    assert (await fetch("GET", url)).text == (await fetch("GET", url)).text
    assert server.connections == 2


async def test_failures_are_the_httpx_errors_the_sdk_retries_on(
    serve: Callable[..., Awaitable[Server]], fetch: Fetch, unused_tcp_port: int
) -> None:
    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly this")
        await writer.drain()

    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"SMTP ready\r\n\r\n")
        await writer.drain()

    with pytest.raises(httpx.ConnectError):  # nothing sent: safe to send again
        await fetch("GET", f"http://127.0.0.1:{unused_tcp_port}/")
    cutter = await serve(cut)
    with pytest.raises(httpx.ReadError, match="reading the answer"):
        await fetch("GET", f"http://127.0.0.1:{cutter.port}/")
    liar = await serve(garbage)
    with pytest.raises(httpx.RemoteProtocolError, match="SMTP"):
        await fetch("GET", f"http://127.0.0.1:{liar.port}/")
    with pytest.raises(httpx.UnsupportedProtocol):
        await fetch("GET", "ftp://127.0.0.1/")


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


@pytest.mark.parametrize("transport", [LeanTransport, LeanSyncTransport])
async def test_tls_is_verified_against_the_trusted_certificates(
    serve: Callable[..., Awaitable[Server]],
    transport: type[LeanTransport | LeanSyncTransport],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cert, key = await asyncio.to_thread(_certificate, tmp_path)
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(cert, key)
    server = await serve(echo, tls)
    url = f"https://127.0.0.1:{server.port}/secure"

    async def get() -> httpx.Response:
        # A new transport each time: the trusted certificates are read at its first TLS use.
        if transport is LeanTransport:
            async with httpx.AsyncClient(transport=LeanTransport()) as client:
                return await client.get(url)
        with httpx.Client(transport=LeanSyncTransport()) as sync:
            return await asyncio.to_thread(sync.get, url)

    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        await get()
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))  # as httpx honours it
    assert (await get()).text == "GET /secure HTTP/1.1\n"


async def test_a_configured_proxy_keeps_httpxs_own_transports(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    url = "http://127.0.0.1:9"
    async with AsyncSandboxClient(url, auto_cleanup=False) as lean:
        assert isinstance(lean._http._transport, LeanTransport)
    with SandboxClient(url, auto_cleanup=False) as lean_sync:
        assert isinstance(lean_sync._http._transport, LeanSyncTransport)
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.internal:3128")
    async with AsyncSandboxClient(url, auto_cleanup=False) as proxied:
        assert isinstance(proxied._http._transport, httpx.AsyncHTTPTransport)
    with SandboxClient(url, auto_cleanup=False) as proxied_sync:
        assert isinstance(proxied_sync._http._transport, httpx.HTTPTransport)
