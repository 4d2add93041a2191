"""AsyncSandboxClient: the same flows, awaited; cancellation and cleanup."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from orchard_env import errors
from orchard_env.sdk import AsyncSandboxClient, ExecResult, _cleanup
from tests.sdk.conftest import FakeTime
from tests.sdk.fakes import FakeService
from tests.sdk.test_retries import fail_first
from tests.sdk.test_stream import _events


async def test_upstream_readme_flow(
    aclient: AsyncSandboxClient, service: FakeService, tmp_path: Path
) -> None:
    local = tmp_path / "local_file.py"
    local.write_bytes(b"print('hi')\n")
    async with await aclient.create_sandbox("python:3.11-slim") as sandbox:
        result = await sandbox.exec("echo 'Hello, World!'")
        assert isinstance(result, ExecResult) and result.stdout == "'Hello, World!'\n"
        await sandbox.upload_file(local, "/workspace/script.py")
        assert await sandbox.download_content("/workspace/script.py") == b"print('hi')\n"
        assert await sandbox.download_file("/workspace/script.py", tmp_path / "back.py") == 12
        assert (tmp_path / "back.py").read_bytes() == b"print('hi')\n"
        (entry,) = await sandbox.list_files("/workspace")
        assert entry["name"] == "script.py"
        assert (await sandbox.apply_patch("--- a/x\n+++ b/x\n")).success
        sandbox_id = sandbox.sandbox_id
    assert service.sandboxes == {}
    assert service.seen("DELETE", f"/sandboxes/{sandbox_id}")


async def test_dropped_exec_keeps_its_job_id(
    aclient: AsyncSandboxClient, service: FakeService
) -> None:
    sandbox = await aclient.create_sandbox("python:3.11-slim")
    service.interceptors.append(
        fail_first(
            "POST", "/exec", httpx.RemoteProtocolError("disconnected"), after_processing=service
        )
    )
    result = await sandbox.exec("echo once")
    posts = service.seen("POST", f"/sandboxes/{sandbox.sandbox_id}/exec")
    assert len({json.loads(p.content)["job_id"] for p in posts}) == 1 and len(posts) == 2
    assert service.executions == 1 and result.stdout == "once\n"


async def test_503_retry_uses_the_async_sleep(
    aclient: AsyncSandboxClient, service: FakeService, fake_time: FakeTime
) -> None:
    busy = httpx.Response(503, headers={"Retry-After": "1.5"})
    service.interceptors.append(fail_first("GET", "/health", response=busy))
    assert (await aclient.health()).status == "healthy"
    assert fake_time.sleeps == [1.5]


async def test_close_deletes_created_sandboxes(service: FakeService) -> None:
    client = AsyncSandboxClient(base_url="http://t", transport=service.async_transport())
    made = {(await client.create_sandbox("python:3.11-slim")).sandbox_id for _ in range(3)}
    assert _cleanup.pending() == {}  # a custom async transport cannot be driven at exit
    await client.close()
    assert {r.url.path.rsplit("/", 1)[1] for r in service.requests if r.method == "DELETE"} == made
    assert service.sandboxes == {}


async def test_exit_registry_tracks_network_clients() -> None:
    client = AsyncSandboxClient(base_url="http://t")
    client._core.track("sb-1")
    (target,) = _cleanup.pending()
    assert (target.base_url, _cleanup.pending()[target]) == ("http://t", ["sb-1"])
    client._core.untrack("sb-1")
    assert _cleanup.pending() == {}
    await client._http.aclose()


async def test_cancelling_create_deletes_the_sandbox(service: FakeService) -> None:
    waiting = asyncio.Event()

    async def handle(request: httpx.Request) -> httpx.Response:
        await request.aread()
        if request.url.path.endswith("/wait"):
            waiting.set()
            await asyncio.Event().wait()  # a long server-side wait
        return service.handle(request)

    async with AsyncSandboxClient(
        base_url="http://t", transport=httpx.MockTransport(handle)
    ) as client:
        task = asyncio.create_task(client.create_sandbox("python:3.11-slim"))
        await waiting.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert service.seen("DELETE", "/sandboxes/sb-00000000")
        assert service.sandboxes == {}


async def test_failed_start_raises_and_deletes(
    aclient: AsyncSandboxClient, service: FakeService
) -> None:
    service.ready_status = "failed"
    service.status_message = "OOMKilled"
    with pytest.raises(errors.SandboxNotReady, match="failed to start: OOMKilled"):
        await aclient.create_sandbox("python:3.11-slim")
    assert service.sandboxes == {}


class _CutAsyncStream(httpx.AsyncByteStream):
    def __init__(self, data: bytes) -> None:
        self._data = data

    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield self._data
        raise httpx.ReadError("connection reset by peer")


async def test_exec_stream_reattaches(aclient: AsyncSandboxClient, service: FakeService) -> None:
    sandbox = await aclient.create_sandbox("python:3.11-slim")
    service.stream_events = _events(("stdout", "abc"), ("stdout", "def"))
    lines = "".join(json.dumps(e) + "\n" for e in service.stream_events[:2])
    service.interceptors.append(
        fail_first(
            "POST",
            "/exec/stream",
            response=httpx.Response(200, stream=_CutAsyncStream(lines.encode())),
        )
    )
    events = [(e.event, e.data) async for e in sandbox.exec_stream("build", job_id="s1")]
    assert events == [("started", None), ("stdout", "abc"), ("stdout", "def"), ("exit", None)]
    out: list[str] = []
    result = await sandbox.exec_streamed("build", stdout=out.append, stderr=out.append)
    assert out == ["abc", "def"] and result.succeeded


async def test_heartbeat_task(aclient: AsyncSandboxClient, service: FakeService) -> None:
    sandbox = await aclient.create_sandbox("python:3.11-slim")
    path = f"/sandboxes/{sandbox.sandbox_id}/heartbeat"
    two_beats = asyncio.Event()

    def count(request: httpx.Request) -> None:
        if len(service.seen("POST", path)) >= 2:
            two_beats.set()

    service.interceptors.append(count)
    sandbox.start_heartbeat(interval=0.001)
    async with asyncio.timeout(5):
        await two_beats.wait()
    task = sandbox._heartbeat_task
    await sandbox.delete()
    assert task is not None and task.done()
    assert sandbox._heartbeat_task is None


async def test_jobs_keys_usage(aclient: AsyncSandboxClient, service: FakeService) -> None:
    sandbox = await aclient.create_sandbox("python:3.11-slim")
    job = await sandbox.exec("echo x", wait=False)
    assert (await sandbox.get_job(job.job_id)).job_id == job.job_id
    assert (await aclient.wait_job(job.job_id, timeout=1)).stdout == "x\n"
    assert (await aclient.cancel_job(job.job_id)).status == "succeeded"  # it had finished
    with pytest.raises(errors.JobNotFound):
        await aclient.get_job("nope")


async def test_download_file_large(
    aclient: AsyncSandboxClient, service: FakeService, tmp_path: Path
) -> None:
    sandbox = await aclient.create_sandbox("python:3.11-slim")
    data = os.urandom(5 * 1024 * 1024 + 3)
    service.files[(sandbox.sandbox_id, "/big")] = data
    assert await sandbox.download_file("/big", tmp_path / "big") == len(data)
    assert (tmp_path / "big").read_bytes() == data
