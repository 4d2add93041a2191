"""The agent client against what an impostor at the agent's socket can send: every reply is
bounded, and nothing but a socket in the agent's own directory is ever connected to."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import socket
from collections.abc import AsyncIterator, Callable, Iterable
from pathlib import Path

import pytest

from orchard_env import errors
from orchard_env.agent import peer
from orchard_env.agent.client import AgentClient
from tests.agent.conftest import collect

MiB = 1024 * 1024
EXIT = (
    b'{"t":"x","exit_code":0,"signal":null,"timed_out":false,"cancelled":false,'
    b'"truncated":false,"error":null,"duration":0.1}\n'
)
JSON_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"


def output_line(data: bytes) -> bytes:
    return b'{"t":"o","d":"' + base64.b64encode(data) + b'"}\n'


def chunked(pieces: Iterable[bytes]) -> Iterable[bytes]:
    yield b"HTTP/1.1 200 OK\r\nContent-Type: application/x-ndjson\r\n"
    yield b"Transfer-Encoding: chunked\r\n\r\n"
    for piece in pieces:
        yield b"%x\r\n%s\r\n" % (len(piece), piece)
    yield b"0\r\n\r\n"


@contextlib.asynccontextmanager
async def impostor(
    path: Path, answer: Callable[[], Iterable[bytes]]
) -> AsyncIterator[tuple[AgentClient, list[errors.AgentTampered]]]:
    """Answer every request at ``path`` with ``answer()``; yield a client of that socket and
    the tamper reports it made."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            await reader.readuntil(b"\r\n\r\n")
            for piece in answer():
                writer.write(piece)
                await writer.drain()
        writer.close()

    reports: list[errors.AgentTampered] = []
    server = await asyncio.start_unix_server(handle, str(path))
    try:
        async with AgentClient(token="t", uds=str(path), on_tampered=reports.append) as client:
            yield client, reports
    finally:
        server.close()


async def test_a_line_over_the_bound_is_tampering(tmp_path: Path) -> None:
    endless = (b'{"t":"o","d":"' + b"QUFB" * 16384 for _ in range(10_000))  # 640 MiB, no newline
    async with impostor(tmp_path / "agent.sock", lambda: chunked(endless)) as (client, reports):
        with pytest.raises(errors.AgentTampered) as raised:
            await collect(client.exec("j", "true"))
    assert raised.value.message.endswith(f"the agent sent a line over {MiB} bytes")
    assert reports == [raised.value]


async def test_output_over_the_jobs_cap_is_tampering(tmp_path: Path) -> None:
    lines = [output_line(b"x" * 60_000) for _ in range(5)] + [EXIT]
    async with impostor(tmp_path / "agent.sock", lambda: chunked(lines)) as (client, _):
        with pytest.raises(errors.AgentTampered) as raised:
            await collect(client.exec("j", "true", max_output_bytes=100_000))
    assert raised.value.message.endswith(
        "the agent sent more stdout than the job's cap of 100000 bytes"
    )


async def test_a_stream_over_its_byte_bound_is_tampering(tmp_path: Path) -> None:
    empty = [b'{"t":"o","d":""}\n' * 4096 for _ in range(100)]  # no output, many bytes
    async with impostor(tmp_path / "agent.sock", lambda: chunked(empty)) as (client, _):
        with pytest.raises(errors.AgentTampered) as raised:
            await collect(client.exec("j", "true", max_output_bytes=1000))
    limit = peer.stream_bytes_limit(1000)
    assert raised.value.message.endswith(f"the agent sent a job stream over {limit} bytes")


@pytest.mark.parametrize(
    "line",
    [b"not json", b'{"t":"z"}', b'{"t":"o","d":"%%%"}', b'{"t":"x"}', b"[1]"],
)
async def test_a_bad_event_is_tampering(tmp_path: Path, line: bytes) -> None:
    async with impostor(tmp_path / "agent.sock", lambda: chunked([line + b"\n"])) as (client, _):
        with pytest.raises(errors.AgentTampered) as raised:
            await collect(client.exec("j", "true"))
    assert "the agent sent a bad job event: " in raised.value.message


async def test_events_after_the_exit_are_tampering(tmp_path: Path) -> None:
    lines = [EXIT, output_line(b"forged")]
    async with impostor(tmp_path / "agent.sock", lambda: chunked(lines)) as (client, _):
        with pytest.raises(errors.AgentTampered) as raised:
            await collect(client.exec("j", "true"))
    assert raised.value.message.endswith("the agent sent events after the exit event")


async def test_a_json_reply_over_the_bound_is_tampering(tmp_path: Path) -> None:
    size = peer.MAX_JSON_BYTES + 1

    def answer() -> Iterable[bytes]:
        yield JSON_HEAD + b"Content-Length: %d\r\n\r\n" % size
        for _ in range(size // MiB + 1):
            yield b" " * MiB

    async with impostor(tmp_path / "agent.sock", answer) as (client, _):
        with pytest.raises(errors.AgentTampered) as raised:
            await client.list_dir("/")
    assert raised.value.message.endswith(
        f"the agent sent a JSON reply over {peer.MAX_JSON_BYTES} bytes"
    )


async def test_an_error_reply_over_the_bound_is_tampering(tmp_path: Path) -> None:
    body = b'{"code":"invalid_request","message":"' + b"x" * peer.MAX_ERROR_BYTES + b'"}'
    head = b"HTTP/1.1 400 Bad Request\r\nContent-Length: %d\r\n\r\n" % len(body)
    async with impostor(tmp_path / "agent.sock", lambda: [head, body]) as (client, _):
        with pytest.raises(errors.AgentTampered) as raised:
            await client.mkdir("/x")
    limit = peer.MAX_ERROR_BYTES
    assert raised.value.message.endswith(f"the agent sent an error over {limit} bytes")


async def test_a_download_longer_than_announced_is_cut_off(tmp_path: Path) -> None:
    answer = [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"]
    async with impostor(tmp_path / "agent.sock", lambda: answer) as (client, _):
        with pytest.raises(errors.AgentTampered) as raised:
            await client.open_file("/f")
    assert raised.value.message.endswith("the agent sent a file without a valid size ('')")


async def test_a_reply_that_is_not_json_is_tampering(tmp_path: Path) -> None:
    answer = [JSON_HEAD + b"Content-Length: 5\r\n\r\nhello"]
    async with impostor(tmp_path / "agent.sock", lambda: answer) as (client, _):
        with pytest.raises(errors.AgentTampered) as raised:
            await client.health()
    assert raised.value.message.endswith("the agent sent a reply that is not JSON: b'hello'")


@pytest.mark.parametrize("plant", ["symlink", "file", "fifo"])
async def test_only_a_socket_in_the_agents_directory_is_connected_to(
    tmp_path: Path, plant: str
) -> None:
    host = socket.socket(socket.AF_UNIX)
    host.bind(str(tmp_path / "host.sock"))
    host.listen(1)
    host.setblocking(False)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    planted = run_dir / "agent.sock"
    if plant == "symlink":
        planted.symlink_to(tmp_path / "host.sock")
    elif plant == "file":
        planted.write_text("x")
    else:
        os.mkfifo(planted)
    reports: list[errors.AgentTampered] = []
    async with AgentClient(token="t", uds=str(planted), on_tampered=reports.append) as client:
        with pytest.raises(errors.AgentTampered) as raised:
            await client.health()
        with pytest.raises(errors.AgentTampered):
            await client.open_pty()
    kind = {"symlink": "a symlink", "file": "a regular file", "fifo": "not a socket"}[plant]
    assert raised.value.message == (
        f"agent at {planted}: {planted} is {kind}, not the agent's socket: "
        "something in the sandbox replaced it"
    )
    assert len(reports) == 2
    with pytest.raises(BlockingIOError):
        host.accept()  # nothing ever connected to the host's socket
    host.close()


async def test_a_missing_socket_is_unavailable_and_the_probe_says_why(tmp_path: Path) -> None:
    async with AgentClient(token="t", uds=str(tmp_path / "agent.sock")) as client:
        with pytest.raises(errors.AgentUnavailable):
            await client.health()
        assert await client.probe(5) == f"no agent socket at {tmp_path / 'agent.sock'}"
