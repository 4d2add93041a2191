"""File routes through AgentClient against the real agent process."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import httpx
import pytest

from orchard_env import errors
from orchard_env.agent.client import AgentClient
from tests.agent.conftest import RunningAgent, signed


async def read_all(agent: AgentClient, path: str) -> bytes:
    return b"".join([chunk async for chunk in agent.read_file(path)])


async def test_binary_round_trip_with_mode(agent: AgentClient, agent_server: RunningAgent) -> None:
    data = bytes(range(256)) * 64
    assert await agent.write_file("deep/er/blob.bin", data, mode=0o600) == len(data)
    target = agent_server.workdir / "deep" / "er" / "blob.bin"
    assert target.read_bytes() == data
    assert target.stat().st_mode & 0o7777 == 0o600
    assert await read_all(agent, "deep/er/blob.bin") == data
    assert await read_all(agent, str(target)) == data
    # no temporary files are left beside the target
    assert [p.name for p in target.parent.iterdir()] == ["blob.bin"]


async def test_overwrite_keeps_the_existing_mode(
    agent: AgentClient, agent_server: RunningAgent
) -> None:
    script = agent_server.workdir / "run.sh"
    script.write_text("old")
    script.chmod(0o751)
    await agent.write_file("run.sh", b"new")
    assert script.read_bytes() == b"new"
    assert script.stat().st_mode & 0o7777 == 0o751
    await agent.write_file("empty", b"")
    assert await read_all(agent, "empty") == b""


async def test_large_file_is_streamed_both_ways(
    agent: AgentClient, agent_server: RunningAgent
) -> None:
    block = os.urandom(1 << 20)
    total = 6 * len(block) + 12345

    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(6):
            yield block
        yield block[:12345]

    assert await agent.write_file("big.bin", chunks()) == total
    assert (agent_server.workdir / "big.bin").stat().st_size == total
    pieces = [chunk async for chunk in agent.read_file("big.bin")]
    assert len(pieces) > 1  # it arrived as a stream, not one buffer
    assert b"".join(pieces) == block * 6 + block[:12345]


async def test_open_file_gives_the_size_before_the_bytes(agent: AgentClient) -> None:
    data = os.urandom(300_000)
    await agent.write_file("sized.bin", data)
    stream = await agent.open_file("sized.bin")
    assert stream.size == len(data)
    assert b"".join([chunk async for chunk in stream]) == data
    given_up = await agent.open_file("sized.bin")
    await given_up.aclose()  # never read: the connection is released, the client goes on
    again = await agent.open_file("sized.bin")
    assert again.size == len(data)
    await again.aclose()
    with pytest.raises(errors.FileNotFound):
        await agent.open_file("nope.txt")


async def test_read_errors(agent: AgentClient, agent_server: RunningAgent) -> None:
    with pytest.raises(errors.FileNotFound) as missing:
        await read_all(agent, "nope.txt")
    assert missing.value.message == f"{agent_server.workdir / 'nope.txt'} does not exist"
    with pytest.raises(errors.InvalidRequest) as directory:
        await read_all(agent, "/tmp")
    assert directory.value.message == "/tmp is a directory"
    with pytest.raises(errors.InvalidRequest):
        await agent.write_file("/tmp", b"x")


async def test_list_dir_uses_lstat_and_sorts(
    agent: AgentClient, agent_server: RunningAgent
) -> None:
    work = agent_server.workdir
    (work / "b.txt").write_bytes(b"12345")
    (work / "a-dir").mkdir()
    (work / "c-link").symlink_to(work / "a-dir")
    os.mkfifo(work / "d-fifo")
    entries = await agent.list_dir(str(work))
    assert [(e.name, e.type) for e in entries] == [
        ("a-dir", "directory"),
        ("b.txt", "file"),
        ("c-link", "symlink"),
        ("d-fifo", "other"),
    ]
    assert entries[1].size == 5
    assert entries[1].modified.tzinfo is not None
    assert abs(entries[1].modified - datetime.now(UTC)) < timedelta(minutes=5)
    assert await agent.list_dir(".") == entries
    with pytest.raises(errors.FileNotFound):
        await agent.list_dir("missing")
    with pytest.raises(errors.InvalidRequest) as not_dir:
        await agent.list_dir("b.txt")
    assert not_dir.value.message == f"{work / 'b.txt'} is not a directory"


async def test_delete_and_mkdir(agent: AgentClient, agent_server: RunningAgent) -> None:
    work = agent_server.workdir
    assert await agent.mkdir("x/y/z") == str(work / "x" / "y" / "z")
    assert await agent.mkdir("x/y/z") == str(work / "x" / "y" / "z")  # parents=True: exist ok
    with pytest.raises(errors.Conflict):
        await agent.mkdir("x/y/z", parents=False)
    with pytest.raises(errors.FileNotFound):
        await agent.mkdir("nothere/child", parents=False)
    await agent.write_file("x/y/file", b"1")
    with pytest.raises(errors.Conflict) as not_empty:
        await agent.delete_path("x")
    assert not_empty.value.message == f"directory {work / 'x'} is not empty (pass recursive=true)"
    assert await agent.delete_path("x/y/file") == str(work / "x" / "y" / "file")
    (work / "link").symlink_to(work / "x")
    await agent.delete_path("link")  # the link goes, not what it points to
    assert (work / "x" / "y" / "z").is_dir()
    assert await agent.delete_path("x", recursive=True) == str(work / "x")
    assert not (work / "x").exists()
    with pytest.raises(errors.FileNotFound):
        await agent.delete_path("x")
    with pytest.raises(errors.InvalidRequest):
        await agent.delete_path("/", recursive=True)


async def test_a_missing_path_parameter_is_named(agent: AgentClient) -> None:
    with pytest.raises(errors.InvalidRequest) as caught:
        await agent.list_dir("")
    assert caught.value.message == "query parameter 'path' is required"


async def test_chunked_upload_from_a_raw_client(agent_server: RunningAgent) -> None:
    async def body() -> AsyncIterator[bytes]:
        yield b"hello "
        yield b"world"

    token = agent_server.token
    transport = httpx.AsyncHTTPTransport(uds=agent_server.socket, verify=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://a") as c:
        target = "/files?path=c.txt&mode=0640"
        headers = signed(token, "PUT", target, None)
        response = await c.put(target, content=body(), headers=headers)
        assert response.status_code == 200
        assert response.json() == {"path": str(agent_server.workdir / "c.txt"), "size": 11}
        target = "/files?path=d.txt&mode=999"
        bad = await c.put(target, content=b"x", headers=signed(token, "PUT", target, b"x"))
        assert bad.status_code == 400
        assert bad.json()["message"] == "mode '999' is not an octal file mode like 0644"
        # the connection is still usable after an error that came before the body was read
        target = "/files?path=c.txt"
        read = await c.get(target, headers=signed(token, "GET", target, b""))
        assert read.content == b"hello world"
        # a body other than the one signed is refused, and nothing is written
        target = "/files?path=e.txt"
        forged = await c.put(target, content=b"forged", headers=signed(token, "PUT", target, b"x"))
        assert forged.status_code == 401
        assert forged.json()["message"] == "the request body is not the one signed"
    assert not (agent_server.workdir / "e.txt").exists()
    assert (agent_server.workdir / "c.txt").stat().st_mode & 0o777 == 0o640
    assert not (agent_server.workdir / "d.txt").is_file()
