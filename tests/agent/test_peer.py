"""The agent client against what an impostor at the agent's socket can send: every reply is
bounded and proven, and nothing but a socket in the agent's own directory is connected to.

The impostors here answer with a valid head proof (``KEY`` is known to them), as a relay
between the orchestrator and the real agent could: what they change after it must still be
caught."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import itertools
import os
import socket
from collections.abc import AsyncIterator, Callable, Iterable
from pathlib import Path

import pytest

from orchard_env import errors, http1
from orchard_env.agent import peer
from orchard_env.agent.client import AgentClient
from orchard_env.agent.daemon import proof
from tests.agent.conftest import collect

MiB = 1024 * 1024
EXIT = (
    b'{"t":"x","exit_code":0,"signal":null,"timed_out":false,"cancelled":false,'
    b'"truncated":false,"error":null,"duration":0.1}\n'
)
KEY = "relayed-key-0123456789"


def output_line(data: bytes) -> bytes:
    return b'{"t":"o","d":"' + base64.b64encode(data) + b'"}\n'


def head(nonce: str, status: int, body: str, *headers: bytes) -> bytes:
    mac = proof.response_mac(KEY.encode(), nonce, status, body)
    lines = [b"HTTP/1.1 %d X" % status, *headers, b"X-Orchard-Proof: " + mac.encode()]
    return b"\r\n".join(lines) + b"\r\n\r\n"


def chunked(pieces: Iterable[bytes]) -> Callable[[str], Iterable[bytes]]:
    def answer(nonce: str) -> Iterable[bytes]:
        yield head(nonce, 200, proof.STREAM, b"Transfer-Encoding: chunked")
        for piece in pieces:
            yield b"%x\r\n%s\r\n" % (len(piece), piece)
        yield b"0\r\n\r\n"

    return answer


def json_answer(body: bytes) -> Callable[[str], Iterable[bytes]]:
    def answer(nonce: str) -> Iterable[bytes]:
        yield head(nonce, 200, proof.digest(body), b"Content-Length: %d" % len(body)) + body

    return answer


@contextlib.asynccontextmanager
async def impostor(
    path: Path, answer: Callable[[str], Iterable[bytes]]
) -> AsyncIterator[tuple[AgentClient, list[errors.AgentTampered]]]:
    """Answer every request at ``path`` with ``answer(its nonce)``; yield a client of that
    socket and the tamper reports it made."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            request = await reader.readuntil(b"\r\n\r\n")
            nonce = request.lower().split(b"x-orchard-nonce: ", 1)[-1].split(b"\r\n", 1)[0]
            for piece in answer(nonce.decode()):
                writer.write(piece)
                await writer.drain()
        writer.close()

    reports: list[errors.AgentTampered] = []
    server = await asyncio.start_unix_server(handle, str(path))
    try:
        async with AgentClient(token=KEY, uds=str(path), on_tampered=reports.append) as client:
            yield client, reports
    finally:
        server.close()


async def test_a_line_over_the_bound_is_tampering(tmp_path: Path) -> None:
    endless = (b'{"t":"o","d":"' + b"QUFB" * 16384 for _ in range(10_000))  # 640 MiB, no newline
    async with impostor(tmp_path / "agent.sock", chunked(endless)) as (client, reports):
        with pytest.raises(errors.AgentTampered) as raised:
            await collect(client.exec("j", "true"))
    assert raised.value.message.endswith(f"the agent sent a line over {MiB} bytes")
    assert reports == [raised.value]


async def test_output_over_the_jobs_cap_is_tampering(tmp_path: Path) -> None:
    lines = [output_line(b"x" * 60_000) for _ in range(5)] + [EXIT]
    async with impostor(tmp_path / "agent.sock", chunked(lines)) as (client, _):
        with pytest.raises(errors.AgentTampered) as raised:
            await collect(client.exec("j", "true", max_output_bytes=100_000))
    assert raised.value.message.endswith(
        "the agent sent more stdout than the job's cap of 100000 bytes"
    )


async def test_a_stream_over_its_byte_bound_is_tampering(tmp_path: Path) -> None:
    empty = [b'{"t":"o","d":""}\n' * 4096 for _ in range(100)]  # no output, many bytes
    async with impostor(tmp_path / "agent.sock", chunked(empty)) as (client, _):
        with pytest.raises(errors.AgentTampered) as raised:
            await collect(client.exec("j", "true", max_output_bytes=1000))
    limit = peer.stream_bytes_limit(1000)
    assert raised.value.message.endswith(f"the agent sent a job stream over {limit} bytes")


@pytest.mark.parametrize(
    "line",
    [b"not json", b'{"t":"z"}', b'{"t":"o","d":"%%%"}', b'{"t":"x"}', b"[1]"],
)
async def test_a_bad_event_is_tampering(tmp_path: Path, line: bytes) -> None:
    async with impostor(tmp_path / "agent.sock", chunked([line + b"\n"])) as (client, _):
        with pytest.raises(errors.AgentTampered) as raised:
            await collect(client.exec("j", "true"))
    assert "the agent sent a bad job event: " in raised.value.message


async def test_a_stream_changed_after_its_proven_head_is_tampering(tmp_path: Path) -> None:
    """A relay that passes the real agent's head and swaps the stream for a success."""
    lines = [output_line(b"all tests passed\n"), EXIT, b'{"t":"p","mac":"' + b"0" * 64 + b'"}\n']
    async with impostor(tmp_path / "agent.sock", chunked(lines)) as (client, _):
        with pytest.raises(errors.AgentTampered) as raised:
            await collect(client.exec("j", "true"))
    assert raised.value.message.endswith(
        "the job stream's proof does not hold: "
        "something other than the sandbox's agent sent it or changed it"
    )
    async with impostor(tmp_path / "other.sock", chunked(lines[:2])) as (client, _):
        with pytest.raises(errors.AgentTampered) as raised:
            await collect(client.exec("j", "true"))
    assert raised.value.message.endswith("the job stream ended without the agent's proof")


async def test_an_answer_without_the_keys_proof_is_tampering(tmp_path: Path) -> None:
    """An impostor that does not know the key (the real attack: nothing in the sandbox can
    read it) cannot prove anything, whatever it answers."""
    stream = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    body = output_line(b"all tests passed\n") + EXIT
    forged = stream + b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    async with impostor(tmp_path / "agent.sock", lambda _nonce: [forged]) as (client, reports):
        with pytest.raises(errors.AgentTampered) as raised:
            await collect(client.exec("j", "exit 3"))
        with pytest.raises(errors.AgentTampered):
            await client.health()
    assert raised.value.message.endswith(
        "its answer carries no valid proof of the sandbox's key: "
        "something other than the sandbox's agent answered"
    )
    assert len(reports) == 2


async def test_a_json_reply_over_the_bound_is_tampering(tmp_path: Path) -> None:
    size = peer.MAX_JSON_BYTES + 1

    def answer(nonce: str) -> Iterable[bytes]:
        yield head(nonce, 200, "unknowable", b"Content-Length: %d" % size)
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

    def answer(nonce: str) -> Iterable[bytes]:
        yield head(nonce, 400, proof.digest(body), b"Content-Length: %d" % len(body)) + body

    async with impostor(tmp_path / "agent.sock", answer) as (client, _):
        with pytest.raises(errors.AgentTampered) as raised:
            await client.mkdir("/x")
    limit = peer.MAX_ERROR_BYTES
    assert raised.value.message.endswith(f"the agent sent an error over {limit} bytes")


async def test_a_download_longer_than_announced_is_cut_off(tmp_path: Path) -> None:
    def answer(nonce: str) -> Iterable[bytes]:
        yield (
            head(nonce, 200, proof.RAW, b"Transfer-Encoding: chunked") + b"5\r\nhello\r\n0\r\n\r\n"
        )

    async with impostor(tmp_path / "agent.sock", answer) as (client, _):
        with pytest.raises(errors.AgentTampered) as raised:
            await client.open_file("/f")
    assert raised.value.message.endswith("the agent sent a file without a valid size ('')")


async def test_a_reply_that_is_not_json_is_tampering(tmp_path: Path) -> None:
    async with impostor(tmp_path / "agent.sock", json_answer(b"hello")) as (client, _):
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


def proven_json(nonce: str, body: bytes = b'{"status":"ok"}', *headers: bytes) -> bytes:
    length = b"Content-Length: %d" % len(body)
    return head(nonce, 200, proof.digest(body), length, *headers) + body


def proven_stream(nonce: str, lines: list[bytes]) -> bytes:
    """A whole job stream as the real agent sends it, its proof line last."""
    mac = proof.stream_mac(KEY.encode(), nonce, hashlib.sha256(b"".join(lines)).hexdigest())
    body = b"".join(lines) + b'{"t":"p","mac":"%s"}\n' % mac.encode()
    framing = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    return head(nonce, 200, proof.STREAM, b"Transfer-Encoding: chunked") + framing


@pytest.mark.parametrize(
    "status_line",
    [
        b"HTTP/1.1 2000 OK",
        b"HTTP/2 200 OK",
        b"ICY 200 OK",
        b"HTTP/1.1 20x OK",
        b"HTTP/1.1 \xb2\xb2\xb2",
    ],
)
async def test_a_malformed_status_line_is_tampering(tmp_path: Path, status_line: bytes) -> None:
    answer = [status_line + b"\r\nContent-Length: 2\r\n\r\n{}"]
    async with impostor(tmp_path / "agent.sock", lambda _nonce: answer) as (client, reports):
        with pytest.raises(errors.AgentTampered) as raised:
            await client.health()
    assert "not an HTTP/1.1 status line: " in raised.value.message
    assert reports == [raised.value]


@pytest.mark.parametrize(
    ("headers", "message"),
    [
        ([b"X-Pad: " + b"a" * 1000] * 100, f"an answer head over {http1.MAX_HEAD} bytes"),
        ([b"X-A: b"] * (http1.MAX_HEADERS + 1), f"an answer with over {http1.MAX_HEADERS} headers"),
        ([b"no colon here"], "a malformed header line: 'no colon here'"),
        ([b"Content-Length: 2", b"Content-Length: 3"], "a bad content-length: ['2', '3']"),
        ([b"Content-Length: -2"], "a bad content-length: ['-2']"),
    ],
)
async def test_a_bad_head_is_tampering(tmp_path: Path, headers: list[bytes], message: str) -> None:
    def answer(nonce: str) -> Iterable[bytes]:
        yield b"\r\n".join([b"HTTP/1.1 200 OK", *headers]) + b"\r\n\r\n{}"

    async with impostor(tmp_path / "agent.sock", answer) as (client, _):
        with pytest.raises(errors.AgentTampered) as raised:
            await client.health()
    assert raised.value.message.endswith(message)


@pytest.mark.parametrize(
    ("framing", "message"),
    [
        (b"zz\r\n", "a malformed chunk size b'zz'"),
        (b"-5\r\nhello\r\n", "a malformed chunk size b'-5'"),
        (b"+5\r\nhello\r\n", "a malformed chunk size b'+5'"),
        (b"0x5\r\nhello\r\n", "a malformed chunk size b'0x5'"),
        (b"1 1\r\nx\r\n", "a malformed chunk size b'1 1'"),
        (b"1" * 16 + b"\r\n", "a malformed chunk size b'1111111111111111'"),
        (b"5\r\nhelloXX0\r\n\r\n", "a chunk not ended by CRLF but by b'XX'"),
        (b"5" * (http1.MAX_HEAD + 10), f"a chunk-size line over {http1.MAX_HEAD} bytes"),
        (b"0\r\n" + b"X-T: 1\r\n" * 40, f"an answer with over {http1.MAX_TRAILERS} trailers"),
    ],
)
async def test_chunked_framing_abuse_is_tampering(
    tmp_path: Path, framing: bytes, message: str
) -> None:
    def answer(nonce: str) -> Iterable[bytes]:
        yield head(nonce, 200, proof.STREAM, b"Transfer-Encoding: chunked") + framing

    async with impostor(tmp_path / "agent.sock", answer) as (client, reports):
        with pytest.raises(errors.AgentTampered) as raised:
            await collect(client.exec("j", "true"))
    assert raised.value.message.endswith(message)
    assert reports == [raised.value]


async def test_a_huge_announced_chunk_is_read_as_it_comes(tmp_path: Path) -> None:
    """A chunk announced at 1 GiB is read piece by piece: the line bound cuts it off."""

    def answer(nonce: str) -> Iterable[bytes]:
        yield head(nonce, 200, proof.STREAM, b"Transfer-Encoding: chunked")
        yield b"40000000\r\n" + b'{"t":"o","d":"'
        for _ in range(16384):
            yield b"QUFB" * 16384

    async with impostor(tmp_path / "agent.sock", answer) as (client, _):
        with pytest.raises(errors.AgentTampered) as raised:
            await collect(client.exec("j", "true"))
    assert raised.value.message.endswith(f"the agent sent a line over {MiB} bytes")


async def test_a_connection_dropped_mid_answer_is_unavailable_not_tampering(
    tmp_path: Path,
) -> None:
    def answer(nonce: str) -> Iterable[bytes]:
        yield head(nonce, 200, proof.digest(b"x" * 100), b"Content-Length: 100") + b"x" * 10

    async with impostor(tmp_path / "agent.sock", answer) as (client, reports):
        with pytest.raises(errors.AgentUnavailable) as raised:
            await client.health()
    assert "the connection closed in the middle of the answer's body" in raised.value.message
    assert reports == []


@pytest.mark.parametrize("sent", [1, 3], ids=["mid-output", "after-the-exit-before-the-proof"])
async def test_a_job_stream_dropped_mid_answer_is_reattached(tmp_path: Path, sent: int) -> None:
    """The first answer breaks off (after some output, or after the exit event but before
    its proof); the re-attach replays the job from the start, and the caller gets each byte
    once and the exit the proof covers."""
    lines = [output_line(b"hello "), output_line(b"world\n"), EXIT]
    requests: list[bytes] = []

    def answer(nonce: str) -> Iterable[bytes]:
        requests.append(nonce.encode())
        if len(requests) == 1:
            yield head(nonce, 200, proof.STREAM, b"Transfer-Encoding: chunked")
            for line in lines[:sent]:
                yield b"%x\r\n%s\r\n" % (len(line), line)
        else:
            yield proven_stream(nonce, lines)

    async with impostor(tmp_path / "agent.sock", answer) as (client, reports):
        result = await collect(client.exec("j", "true"))
    assert result.stdout == b"hello world\n"
    assert result.exit.exit_code == 0
    assert len(requests) == 2 and reports == []


async def test_an_agent_that_never_answers_times_out(tmp_path: Path) -> None:
    given_up = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # the request, then nothing until the client gives up
        writer.close()
        given_up.set()

    server = await asyncio.start_unix_server(handle, str(tmp_path / "agent.sock"))
    async with server, AgentClient(token=KEY, uds=str(tmp_path / "agent.sock"), timeout=0.05) as c:
        with pytest.raises(errors.AgentUnavailable) as raised:
            await c.health()
        await given_up.wait()  # the client closed the connection it gave up on
    assert "TimeoutError" in raised.value.message


async def test_connections_are_kept_alive_and_a_stale_one_is_replaced(tmp_path: Path) -> None:
    """Answers reuse one connection; one the agent closed while it sat idle is replaced
    without the caller noticing; ``Connection: close`` is honoured."""
    accepted: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(1)
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            for served in itertools.count():
                request = await reader.readuntil(b"\r\n\r\n")
                if len(accepted) == 1 and served == 2:
                    break  # closes with the third request unanswered
                nonce = request.lower().split(b"x-orchard-nonce: ", 1)[-1].split(b"\r\n", 1)[0]
                close = (b"Connection: close",) if len(accepted) == 2 else ()
                writer.write(proven_json(nonce.decode(), b'{"status":"ok"}', *close))
                await writer.drain()
        writer.close()

    server = await asyncio.start_unix_server(handle, str(tmp_path / "agent.sock"))
    async with server, AgentClient(token=KEY, uds=str(tmp_path / "agent.sock")) as client:
        for _ in range(4):
            assert (await client.health())["status"] == "ok"
    assert len(accepted) == 3  # two on the first, one refused there, one after the close
