"""exec: one run per call, polling when the server's wait ran out, check=True."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime

import pytest

from orchard_env import errors
from orchard_env.sdk import ExecResult, JobResult, Sandbox, SandboxClient
from tests.sdk.conftest import FakeTime
from tests.sdk.fakes import FakeService, Ran


@pytest.fixture
def sandbox(client: SandboxClient) -> Sandbox:
    return client.create_sandbox("python:3.11-slim")


def _posts(service: FakeService, sandbox: Sandbox) -> list[dict[str, object]]:
    return [
        json.loads(r.content) for r in service.seen("POST", f"/sandboxes/{sandbox.sandbox_id}/exec")
    ]


def test_exec_result(sandbox: Sandbox, service: FakeService) -> None:
    result = sandbox.exec("echo hello", cwd="/tmp", env={"A": "1"}, login_shell=True)
    assert isinstance(result, ExecResult) and JobResult is ExecResult
    assert (result.stdout, result.exit_code, result.returncode) == ("hello\n", 0, 0)
    assert result.succeeded and result.is_complete and not result.failed
    # Epoch seconds on the wire (upstream's type), an aware datetime in Python.
    assert result.created_at == datetime(2026, 1, 1, tzinfo=UTC)
    (body,) = _posts(service, sandbox)
    assert re.fullmatch(r"[0-9a-f]{32}", str(body.pop("job_id")))
    assert body == {
        "command": "echo hello",
        "timeout_seconds": 300,
        "cwd": "/tmp",
        "env": {"A": "1"},
        "login_shell": True,
        "wait": True,
    }


def test_exec_http_timeout_covers_the_command(sandbox: Sandbox, service: FakeService) -> None:
    sandbox.exec(["sleep", "1"], timeout=90)
    (request,) = service.seen("POST", f"/sandboxes/{sandbox.sandbox_id}/exec")
    assert request.extensions["timeout"]["read"] == 150
    assert json.loads(request.content)["command"] == ["sleep", "1"]


def test_failed_command(sandbox: Sandbox) -> None:
    result = sandbox.exec("exit 3")
    assert result.failed and result.is_complete and not result.succeeded
    assert result.exit_code == 3 and result.status == "failed"


def test_running_job_is_long_polled_until_done(
    sandbox: Sandbox, service: FakeService, fake_time: FakeTime
) -> None:
    service.running_views = 2  # the POST's answer and the first long-poll say "running"
    result = sandbox.exec("echo late", timeout=30, poll_interval=0.25)
    assert result.stdout == "late\n"
    waits = service.seen("GET", f"/jobs/{result.job_id}/wait")
    assert [w.url.params["timeout"] for w in waits] == ["90", "90"]
    assert fake_time.sleeps == [0.25]  # only between the early (fake: immediate) answers
    assert service.executions == 1


def test_job_that_never_finishes_times_out(
    sandbox: Sandbox, service: FakeService, fake_time: FakeTime
) -> None:
    service.running_views = 10**6
    service.on_wait = fake_time.advance
    with pytest.raises(errors.Timeout) as caught:
        sandbox.exec("sleep 999", timeout=10, job_id="stuck")
    assert isinstance(caught.value, TimeoutError)
    assert str(caught.value) == (
        "job stuck ('sleep 999') is still running 70s after it was submitted with a 10s timeout"
    )


def test_wait_false_returns_at_once(sandbox: Sandbox, service: FakeService) -> None:
    service.running_views = 5
    result = sandbox.exec("echo bg", wait=False)
    assert result.status == "queued" and not result.is_complete and not result.failed
    (body,) = _posts(service, sandbox)
    assert body["wait"] is False
    assert not service.seen("GET", f"/jobs/{result.job_id}/wait")
    assert sandbox.get_job(result.job_id).status == "running"
    service.jobs[result.job_id]["_views_left"] = 0
    client = sandbox._client
    assert client.wait_job(result.job_id, timeout=5).stdout == "bg\n"


def test_cancel_job(sandbox: Sandbox, service: FakeService) -> None:
    service.running_views = 5
    job = sandbox.exec("echo x", wait=False)
    cancelled = sandbox._client.cancel_job(job.job_id)
    assert (cancelled.status, cancelled.cancelled, cancelled.failed) == ("failed", True, True)
    with pytest.raises(errors.CommandFailed, match=r"\(job \w+\) was cancelled: cancelled$"):
        cancelled.check_returncode()
    finished = sandbox.exec("echo y")
    assert sandbox._client.cancel_job(finished.job_id).status == "succeeded"  # too late


def test_check_raises_with_code_command_and_stderr(sandbox: Sandbox, service: FakeService) -> None:
    service.runner = lambda command: Ran(
        exit_code=2, stderr="".join(f"line {i}\n" for i in range(30))
    )
    with pytest.raises(errors.CommandFailed) as caught:
        sandbox.exec("make test", check=True, job_id="j1")
    message = str(caught.value)
    assert message.startswith(
        "command 'make test' (job j1) exited with code 2\nstderr (last lines):\n"
    )
    assert message.endswith("line 29") and "line 9\n" not in message


def test_check_says_timed_out(sandbox: Sandbox, service: FakeService) -> None:
    service.runner = lambda command: Ran(
        exit_code=-9, status="failed", timed_out=True, error="killed after the timeout"
    )
    with pytest.raises(errors.CommandFailed) as caught:
        sandbox.exec("sleep 10", timeout=2, check=True, job_id="j2")
    assert (
        str(caught.value)
        == "command 'sleep 10' (job j2) timed out after 2s: killed after the timeout"
    )


def test_check_passes_quietly(sandbox: Sandbox) -> None:
    assert sandbox.exec("echo fine", check=True).stdout == "fine\n"


def test_check_needs_wait(sandbox: Sandbox) -> None:
    with pytest.raises(errors.InvalidRequest, match="check=True needs wait=True"):
        sandbox.exec("true", wait=False, check=True)


def test_stdin_and_upstream_timeout_none(sandbox: Sandbox, service: FakeService) -> None:
    sandbox.exec("cat", stdin=b"hello", timeout=None)
    (body,) = _posts(service, sandbox)
    assert (body["stdin"], body["timeout_seconds"]) == ("hello", 300)


def test_check_returncode_on_an_unfinished_job(sandbox: Sandbox) -> None:
    job = sandbox.exec("echo x", wait=False)
    with pytest.raises(errors.InvalidRequest, match="has not finished"):
        job.check_returncode()
