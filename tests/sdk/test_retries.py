"""Retries: what is retried, how long the SDK waits, and that nothing runs twice."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime

import httpx
import pytest

from orchard_env import errors
from orchard_env.sdk import SandboxClient
from orchard_env.sdk._base import RetryPolicy
from tests.sdk.conftest import FakeTime
from tests.sdk.fakes import FakeService


def fail_first(
    method: str,
    path_suffix: str,
    exc: Exception | None = None,
    *,
    times: int = 1,
    after_processing: FakeService | None = None,
    response: httpx.Response | None = None,
) -> Callable[[httpx.Request], httpx.Response | None]:
    """An interceptor failing the first ``times`` matching requests.

    With ``after_processing`` the service handles the request first (it "reached the
    server") and only the answer is lost.
    """
    left = [times]

    def intercept(request: httpx.Request) -> httpx.Response | None:
        if request.method != method or not request.url.path.endswith(path_suffix) or left[0] == 0:
            return None
        left[0] -= 1
        if after_processing is not None:
            after_processing.interceptors.remove(intercept)
            try:
                after_processing._route(request)
            finally:
                after_processing.interceptors.insert(0, intercept)
        if response is not None:
            return response
        assert exc is not None
        raise exc

    return intercept


def _sandbox(client: SandboxClient) -> str:
    return client.create_sandbox("python:3.11-slim").sandbox_id


def test_exec_dropped_after_sending_is_retried_with_the_same_job_id(
    client: SandboxClient, service: FakeService
) -> None:
    sandbox = client.create_sandbox("python:3.11-slim")
    service.interceptors.append(
        fail_first(
            "POST",
            "/exec",
            httpx.RemoteProtocolError("Server disconnected without sending a response."),
            after_processing=service,
        )
    )

    result = sandbox.exec("echo once")

    posts = service.seen("POST", f"/sandboxes/{sandbox.sandbox_id}/exec")
    job_ids = [json.loads(r.content)["job_id"] for r in posts]
    assert len(posts) == 2
    assert job_ids[0] == job_ids[1] == result.job_id
    assert service.executions == 1, "the command ran twice"
    assert result.stdout == "once\n"


def test_exec_read_timeout_retries_the_same_job(
    client: SandboxClient, service: FakeService
) -> None:
    sandbox = client.create_sandbox("python:3.11-slim")
    service.interceptors.append(
        fail_first("POST", "/exec", httpx.ReadTimeout("timed out"), after_processing=service)
    )
    result = sandbox.exec("echo slow", job_id="my-job-1")
    posts = service.seen("POST", f"/sandboxes/{sandbox.sandbox_id}/exec")
    assert [json.loads(r.content)["job_id"] for r in posts] == ["my-job-1", "my-job-1"]
    assert result.job_id == "my-job-1"
    assert service.executions == 1


def test_retries_keep_the_request_id(client: SandboxClient, service: FakeService) -> None:
    service.interceptors.append(fail_first("GET", "/health", httpx.ConnectError("refused")))
    client.health()
    ids = [r.headers["X-Request-ID"] for r in service.seen("GET", "/health")]
    assert len(ids) == 2 and ids[0] == ids[1]


def test_503_waits_for_retry_after(
    client: SandboxClient, service: FakeService, fake_time: FakeTime
) -> None:
    busy = httpx.Response(
        503,
        headers={"Retry-After": "2"},
        json={"detail": {"code": "backend_unavailable", "message": "engine busy"}},
    )
    service.interceptors.append(fail_first("GET", "/health", response=busy, times=2))
    assert client.health().status == "healthy"
    assert fake_time.sleeps == [2.0, 2.0]


def test_retry_after_is_capped(
    client: SandboxClient, service: FakeService, fake_time: FakeTime
) -> None:
    busy = httpx.Response(503, headers={"Retry-After": "3600"})
    service.interceptors.append(fail_first("GET", "/health", response=busy))
    client.health()
    assert fake_time.sleeps == [RetryPolicy().max_retry_after]


def test_retry_after_as_http_date(
    client: SandboxClient, service: FakeService, fake_time: FakeTime
) -> None:
    when = format_datetime(datetime.now(UTC) - timedelta(seconds=5), usegmt=True)
    busy = httpx.Response(503, headers={"Retry-After": when})
    service.interceptors.append(fail_first("GET", "/health", response=busy))
    client.health()
    assert fake_time.sleeps == [0.0]


def test_503_after_the_last_retry_raises_the_server_error(
    make_client: Callable[..., SandboxClient], service: FakeService, fake_time: FakeTime
) -> None:
    client = make_client(retries=2)
    busy = httpx.Response(
        503, json={"detail": {"code": "agent_unavailable", "message": "agent is restarting"}}
    )
    service.interceptors.append(fail_first("GET", "/health", response=busy, times=99))
    with pytest.raises(errors.AgentUnavailable, match="agent is restarting"):
        client.health()
    assert len(service.seen("GET", "/health")) == 3
    assert len(fake_time.sleeps) == 2
    assert all(0 <= s <= 0.5 * 2**i for i, s in enumerate(fake_time.sleeps))


@pytest.mark.parametrize("status", [400, 401, 403, 404, 408, 409, 422, 500, 502])
def test_other_statuses_are_never_retried(
    client: SandboxClient, service: FakeService, fake_time: FakeTime, status: int
) -> None:
    service.interceptors.append(
        fail_first("GET", "/health", response=httpx.Response(status, json={"detail": "no"}))
    )
    with pytest.raises(errors.OrchardError):
        client.health()
    assert len(service.seen("GET", "/health")) == 1
    assert fake_time.sleeps == []


def test_connection_failures_exhaust_retries_then_name_the_url(
    make_client: Callable[..., SandboxClient], service: FakeService, fake_time: FakeTime
) -> None:
    client = make_client(retries=3)
    service.interceptors.append(
        fail_first("GET", "/health", httpx.ConnectError("connection refused"), times=99)
    )
    with pytest.raises(errors.ServiceUnreachable) as caught:
        client.health()
    assert str(caught.value) == (
        "cannot reach the Orchard service at http://orchard.test: GET /health failed "
        "after 4 attempts (ConnectError: connection refused)"
    )
    assert caught.value.hint == errors.ServiceUnreachable.default_hint
    assert len(service.seen("GET", "/health")) == 4
    assert len(fake_time.sleeps) == 3


def test_retries_zero_means_one_attempt(
    make_client: Callable[..., SandboxClient], service: FakeService
) -> None:
    client = make_client(retries=0)
    service.interceptors.append(fail_first("GET", "/health", httpx.ConnectError("refused")))
    with pytest.raises(errors.ServiceUnreachable):
        client.health()
    assert len(service.seen("GET", "/health")) == 1


def test_backoff_is_full_jitter_capped() -> None:
    policy = RetryPolicy()
    rng = random.Random(7)
    for attempt in range(12):
        ceiling = min(8.0, 0.5 * 2**attempt)
        samples = [policy.backoff(attempt, rng) for _ in range(200)]
        assert all(0 <= s <= ceiling for s in samples)
        assert max(samples) > ceiling * 0.8  # the whole range is used, not a fixed delay


def test_create_without_an_id_is_not_retried_once_it_may_have_been_sent(
    client: SandboxClient, service: FakeService
) -> None:
    service.interceptors.append(
        fail_first(
            "POST", "/sandboxes", httpx.ReadError("connection reset"), after_processing=service
        )
    )
    with pytest.raises(errors.ServiceUnreachable) as caught:
        client.create_sandbox("python:3.11-slim")
    assert "not retried because the server may already have acted on it" in str(caught.value)
    assert len(service.seen("POST", "/sandboxes")) == 1


def test_create_without_an_id_is_retried_when_never_sent(
    client: SandboxClient, service: FakeService
) -> None:
    service.interceptors.append(fail_first("POST", "/sandboxes", httpx.ConnectError("refused")))
    sandbox = client.create_sandbox("python:3.11-slim")
    assert list(service.sandboxes) == [sandbox.sandbox_id]
    assert len(service.seen("POST", "/sandboxes")) == 2


def test_create_without_an_id_is_not_retried_on_503(
    client: SandboxClient, service: FakeService
) -> None:
    busy = httpx.Response(
        503, json={"detail": {"code": "backend_unavailable", "message": "engine down"}}
    )
    service.interceptors.append(fail_first("POST", "/sandboxes", response=busy))
    with pytest.raises(errors.BackendUnavailable):
        client.create_sandbox("python:3.11-slim")
    assert len(service.seen("POST", "/sandboxes")) == 1


def test_create_with_a_client_id_retries_and_adopts_its_own_sandbox(
    make_client: Callable[..., SandboxClient], service: FakeService
) -> None:
    client = make_client(prefix="rl")
    service.interceptors.append(
        fail_first("POST", "/sandboxes", httpx.ReadError("reset"), after_processing=service)
    )
    sandbox = client.create_sandbox("python:3.11-slim")
    posts = service.seen("POST", "/sandboxes")
    assert len(posts) == 2
    assert {json.loads(r.content)["sandbox_id"] for r in posts} == {sandbox.sandbox_id}
    assert list(service.sandboxes) == [sandbox.sandbox_id]
    assert sandbox.info.status == "ready"


def test_create_with_a_taken_id_raises_on_the_first_attempt(
    client: SandboxClient, service: FakeService
) -> None:
    client.create_sandbox("python:3.11-slim", sandbox_id="taken")
    with pytest.raises(errors.SandboxExists, match="sandbox taken already exists"):
        client.create_sandbox("python:3.11-slim", sandbox_id="taken")


def test_apply_patch_is_not_resent_after_a_lost_answer(
    client: SandboxClient, service: FakeService
) -> None:
    sandbox = client.create_sandbox("python:3.11-slim")
    service.interceptors.append(
        fail_first("POST", "/apply_patch", httpx.ReadError("reset"), after_processing=service)
    )
    with pytest.raises(errors.ServiceUnreachable):
        sandbox.apply_patch("--- a/x\n+++ b/x\n")
    assert len(service.seen("POST", f"/sandboxes/{sandbox.sandbox_id}/apply_patch")) == 1


def test_delete_and_get_are_retried_after_a_lost_answer(
    client: SandboxClient, service: FakeService
) -> None:
    sandbox_id = _sandbox(client)
    service.interceptors.append(fail_first("GET", f"/sandboxes/{sandbox_id}", httpx.ReadError("x")))
    assert client.get_sandbox(sandbox_id).sandbox_id == sandbox_id
    service.interceptors.append(
        fail_first(
            "DELETE", f"/sandboxes/{sandbox_id}", httpx.ReadError("x"), after_processing=service
        )
    )
    # The first DELETE worked but its answer was lost: the retry's 404 means we deleted it.
    assert client.delete_sandbox(sandbox_id) is True
    assert sandbox_id not in service.sandboxes
