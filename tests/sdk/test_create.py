"""create_sandbox: POST, wait, and delete whatever does not become ready."""

from __future__ import annotations

import json
from collections.abc import Callable

import httpx
import pytest

from orchard_env import errors
from orchard_env.sdk import SandboxClient, _cleanup
from tests.sdk.conftest import FakeTime
from tests.sdk.fakes import FakeService


def test_create_sends_every_field_and_waits(client: SandboxClient, service: FakeService) -> None:
    sandbox = client.create_sandbox(
        "python:3.11-slim",
        block_network=False,
        cpu="500m",
        memory="1Gi",
        timeout=60,
        labels={"team": "rl"},
        env={"A": "1"},
        workdir="/src",
        ttl_seconds=600,
        idle_timeout_seconds=120,
    )
    (post,) = service.seen("POST", "/sandboxes")
    assert json.loads(post.content) == {
        "image": "python:3.11-slim",
        "block_network": False,
        "cpu": "500m",
        "memory": "1Gi",
        "timeout": 60,
        "labels": {"team": "rl"},
        "env": {"A": "1"},
        "workdir": "/src",
        "ttl_seconds": 600,
        "idle_timeout_seconds": 120,
    }
    (wait,) = service.seen("GET", f"/sandboxes/{sandbox.sandbox_id}/wait")
    assert wait.url.params["timeout"] == "60"
    assert sandbox.info.ready and sandbox.status == "ready"
    assert (sandbox.image, sandbox.block_network, sandbox.namespace) == (
        "python:3.11-slim",
        False,
        "local",
    )


def test_upstream_minimal_payload(client: SandboxClient, service: FakeService) -> None:
    client.create_sandbox("python:3.11-slim")
    (post,) = service.seen("POST", "/sandboxes")
    assert json.loads(post.content) == {"image": "python:3.11-slim", "block_network": True}


def test_without_wait_ready(client: SandboxClient, service: FakeService) -> None:
    sandbox = client.create_sandbox("python:3.11-slim", wait_ready=False)
    assert sandbox.status == "pending"
    assert not service.seen("GET", f"/sandboxes/{sandbox.sandbox_id}/wait")
    assert sandbox.refresh().status == "ready"


def test_failed_start_raises_and_deletes(client: SandboxClient, service: FakeService) -> None:
    service.ready_status = "failed"
    service.status_message = "exec /entrypoint: no such file"
    with pytest.raises(errors.SandboxNotReady) as caught:
        client.create_sandbox("python:3.11-slim")
    assert str(caught.value) == (
        "sandbox sb-00000000 failed to start: exec /entrypoint: no such file; it was deleted"
    )
    assert service.seen("DELETE", "/sandboxes/sb-00000000")
    assert service.sandboxes == {}
    assert client.cleanup_all() == []


def test_ready_timeout_raises_a_timeout_error_and_deletes(
    client: SandboxClient, service: FakeService, fake_time: FakeTime
) -> None:
    service.ready_status = "pending"
    service.on_wait = fake_time.advance
    with pytest.raises(errors.Timeout) as caught:
        client.create_sandbox("python:3.11-slim", timeout=700)
    assert isinstance(caught.value, TimeoutError)  # upstream's SDK raised TimeoutError
    assert str(caught.value) == (
        "sandbox sb-00000000 did not become ready within 700s; it was deleted"
    )
    waits = service.seen("GET", "/sandboxes/sb-00000000/wait")
    assert [w.url.params["timeout"] for w in waits] == ["300", "300", "100"]
    assert service.sandboxes == {}


def test_early_answers_from_wait_are_polled_not_spun(
    client: SandboxClient, service: FakeService, fake_time: FakeTime
) -> None:
    views = iter(["pending", "unschedulable", "ready"])

    def wait_answers(request: httpx.Request) -> httpx.Response | None:
        if request.method == "GET" and request.url.path.endswith("/wait"):
            sandbox_id = request.url.path.split("/")[2]
            status = next(views)
            body = {**service.sandboxes[sandbox_id], "status": status, "ready": status == "ready"}
            return httpx.Response(200, json=body)
        return None

    service.interceptors.append(wait_answers)
    sandbox = client.create_sandbox("python:3.11-slim", poll_interval=1.5)
    assert sandbox.status == "ready"
    assert fake_time.sleeps == [1.5, 1.5]


def test_deleted_while_starting(client: SandboxClient, service: FakeService) -> None:
    service.ready_status = "deleted"
    with pytest.raises(errors.SandboxNotFound, match="was deleted while starting"):
        client.create_sandbox("python:3.11-slim")


def test_ctrl_c_while_waiting_deletes_the_sandbox(
    client: SandboxClient, service: FakeService
) -> None:
    def interrupt(request: httpx.Request) -> httpx.Response | None:
        if request.url.path.endswith("/wait"):
            raise KeyboardInterrupt
        return None

    service.interceptors.append(interrupt)
    with pytest.raises(KeyboardInterrupt):
        client.create_sandbox("python:3.11-slim")
    assert service.seen("DELETE", "/sandboxes/sb-00000000")
    assert service.sandboxes == {}
    assert _cleanup.pending() == {}


def test_a_failed_cleanup_delete_does_not_hide_the_error(
    client: SandboxClient, service: FakeService
) -> None:
    service.ready_status = "failed"

    def refuse_delete(request: httpx.Request) -> httpx.Response | None:
        if request.method == "DELETE":
            return httpx.Response(500, json={"detail": "engine exploded"})
        return None

    service.interceptors.append(refuse_delete)
    with pytest.raises(errors.SandboxNotReady):
        client.create_sandbox("python:3.11-slim")
    # Still tracked: close() (and the exit handler) will try again.
    assert client.cleanup_all() == []
    service.interceptors.remove(refuse_delete)
    assert client.cleanup_all() == ["sb-00000000"]
    assert service.sandboxes == {}


def test_ctrl_c_during_the_post_deletes_a_sandbox_with_our_id(
    make_client: Callable[..., SandboxClient], service: FakeService
) -> None:
    client = make_client(prefix="job")

    def interrupt_after_creating(request: httpx.Request) -> httpx.Response | None:
        if request.method == "POST" and request.url.path == "/sandboxes":
            service.interceptors.remove(interrupt_after_creating)
            service._route(request)
            raise KeyboardInterrupt
        return None

    service.interceptors.append(interrupt_after_creating)
    with pytest.raises(KeyboardInterrupt):
        client.create_sandbox("python:3.11-slim")
    (delete,) = [r for r in service.requests if r.method == "DELETE"]
    assert delete.url.path.startswith("/sandboxes/job-")
    assert service.sandboxes == {}
