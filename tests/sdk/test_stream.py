"""exec_stream: events as they come, and re-attaching without repeating output."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from orchard_env import errors
from orchard_env.sdk import Sandbox, SandboxClient
from tests.sdk.fakes import NOW_EPOCH, FakeService


@pytest.fixture
def sandbox(client: SandboxClient) -> Sandbox:
    return client.create_sandbox("python:3.11-slim")


def _job(**fields: Any) -> dict[str, Any]:
    return {
        "job_id": "s1",
        "sandbox_id": "sb-00000000",
        "command": "build",
        "status": "succeeded",
        "stdout": "abcdef",
        "stderr": "E",
        "exit_code": 0,
        "created_at": NOW_EPOCH,
        **fields,
    }


def _events(*chunks: tuple[str, str], job: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = [{"event": "started", "job_id": "s1"}]
    events += [{"event": kind, "job_id": "s1", "data": data} for kind, data in chunks]
    events.append({"event": "exit", "job_id": "s1", "job": job or _job()})
    return events


class _CutStream(httpx.SyncByteStream):
    """A response body that delivers ``data`` and then loses the connection."""

    def __init__(self, data: bytes) -> None:
        self._data = data

    def __iter__(self) -> Iterator[bytes]:
        yield self._data
        raise httpx.ReadError("connection reset by peer")


def _cut_first_stream(service: FakeService, lines: int) -> None:
    cut = [True]

    def intercept(request: httpx.Request) -> httpx.Response | None:
        if not request.url.path.endswith("/exec/stream") or not cut[0]:
            return None
        cut[0] = False
        whole = service._route(request).content.decode().splitlines(keepends=True)
        return httpx.Response(200, stream=_CutStream("".join(whole[:lines]).encode()))

    service.interceptors.append(intercept)


def test_events_in_order(sandbox: Sandbox, service: FakeService) -> None:
    service.stream_events = _events(("stdout", "abc"), ("stderr", "E"), ("stdout", "def"))
    events = list(sandbox.exec_stream("build", job_id="s1"))
    assert [(e.event, e.data) for e in events] == [
        ("started", None),
        ("stdout", "abc"),
        ("stderr", "E"),
        ("stdout", "def"),
        ("exit", None),
    ]
    assert events[-1].job is not None and events[-1].job.exit_code == 0


def test_reattach_does_not_repeat_output(sandbox: Sandbox, service: FakeService) -> None:
    # The first connection breaks after "abc"; the replay comes in different chunks.
    first = _events(("stdout", "abc"), ("stdout", "def"), ("stderr", "E"))
    service.stream_events = first
    _cut_first_stream(service, lines=2)
    stream = sandbox.exec_stream("build", job_id="s1")
    assert next(stream).event == "started"
    assert next(stream).data == "abc"
    service.stream_events = _events(("stdout", "ab"), ("stderr", "E"), ("stdout", "cdef"))
    rest = [(e.event, e.data) for e in stream]
    assert rest == [("stderr", "E"), ("stdout", "def"), ("exit", None)]
    posts = service.seen("POST", f"/sandboxes/{sandbox.sandbox_id}/exec/stream")
    assert [json.loads(p.content)["job_id"] for p in posts] == ["s1", "s1"]


def test_stream_that_keeps_breaking_gives_up(make_client: Any, service: FakeService) -> None:
    client: SandboxClient = make_client(retries=2)
    sandbox = client.create_sandbox("python:3.11-slim")
    service.stream_events = _events(("stdout", "abc"))[:-1]  # never an exit event
    with pytest.raises(errors.ServiceUnreachable) as caught:
        list(sandbox.exec_stream("build"))
    assert "(the stream ended early); gave up after 2 reconnects" in str(caught.value)
    assert len(service.seen("POST", f"/sandboxes/{sandbox.sandbox_id}/exec/stream")) == 3


def test_exec_streamed_writes_to_sinks(sandbox: Sandbox, service: FakeService) -> None:
    service.stream_events = _events(
        ("stdout", "abc"),
        ("stderr", "E"),
        ("stdout", "def"),
        job=_job(exit_code=1, status="failed"),
    )
    out, err = io.StringIO(), list[str]()
    result = sandbox.exec_streamed("build", stdout=out, stderr=err.append)
    assert out.getvalue() == "abcdef" and err == ["E"]
    assert result.exit_code == 1 and result.failed
    with pytest.raises(errors.CommandFailed, match="exited with code 1"):
        sandbox.exec_streamed("build", stdout=out, stderr=err.append, check=True)


def test_exec_streamed_defaults_to_this_process(
    sandbox: Sandbox, service: FakeService, capsys: pytest.CaptureFixture[str]
) -> None:
    service.stream_events = _events(("stdout", "to stdout"), ("stderr", "to stderr"))
    sandbox.exec_streamed("build")
    captured = capsys.readouterr()
    assert (captured.out, captured.err) == ("to stdout", "to stderr")


def test_stream_errors_are_the_servers(sandbox: Sandbox, client: SandboxClient) -> None:
    sandbox.delete()
    with pytest.raises(errors.SandboxNotFound):
        list(sandbox.exec_stream("true"))


def test_a_stream_ended_by_the_service_raises_its_error_without_reattaching(
    sandbox: Sandbox, service: FakeService
) -> None:
    message = "the API key 0123456789 was revoked"
    service.stream_events = [
        {"event": "started", "job_id": "s1"},
        {"event": "stdout", "job_id": "s1", "data": "abc"},
        {"event": "error", "job_id": "s1", "code": "forbidden", "message": message},
    ]
    seen = []
    with pytest.raises(errors.PermissionDenied, match=message):
        for event in sandbox.exec_stream("build"):
            seen.append(event.event)
    assert seen == ["started", "stdout"]
    assert len(service.seen("POST", f"/sandboxes/{sandbox.sandbox_id}/exec/stream")) == 1
