"""The server's error classes come back as the same classes, with message and hint."""

from __future__ import annotations

import httpx
import pytest

from orchard_env import errors
from orchard_env.sdk import SandboxClient
from tests.sdk.fakes import FakeService
from tests.sdk.test_retries import fail_first


@pytest.mark.parametrize(
    "cls",
    [
        errors.SandboxNotFound,
        errors.JobNotFound,
        errors.FileNotFound,
        errors.LimitExceeded,
        errors.ImageNotFound,
        errors.PermissionDenied,
        errors.AuthenticationRequired,
        errors.SandboxExists,
        errors.SandboxNotReady,
        errors.InvalidRequest,
        errors.NotSupported,
        errors.Timeout,
    ],
)
def test_error_classes_survive_the_wire(
    client: SandboxClient, service: FakeService, cls: type[errors.OrchardError]
) -> None:
    raised = cls("what went wrong", hint="how to fix it")
    service.interceptors.append(
        fail_first(
            "GET",
            "/health",
            response=httpx.Response(raised.http_status, json=raised.to_wire()),
        )
    )
    with pytest.raises(cls) as caught:
        client.health()
    assert type(caught.value) is cls
    assert caught.value.message == "what went wrong"
    assert caught.value.hint == "how to fix it"


def test_plain_fastapi_detail_maps_by_status(client: SandboxClient, service: FakeService) -> None:
    service.interceptors.append(
        fail_first("GET", "/health", response=httpx.Response(404, json={"detail": "Not Found"}))
    )
    with pytest.raises(errors.NotFound, match=r"^Not Found$"):
        client.health()


def test_non_json_error_body_keeps_its_text(client: SandboxClient, service: FakeService) -> None:
    service.interceptors.append(
        fail_first("GET", "/health", response=httpx.Response(502, text="Bad Gateway from nginx"))
    )
    with pytest.raises(errors.OrchardError, match=r"^Bad Gateway from nginx$"):
        client.health()


def test_unknown_sandbox(client: SandboxClient) -> None:
    with pytest.raises(errors.SandboxNotFound, match="sandbox nope not found"):
        client.get_sandbox("nope")
    with pytest.raises(errors.SandboxNotFound):
        client.delete_sandbox("nope")
    assert client.delete_sandbox("nope", missing_ok=True) is False


def test_deleting_twice(client: SandboxClient) -> None:
    sandbox = client.create_sandbox("python:3.11-slim", sandbox_id="twice")
    assert client.delete_sandbox("twice") is True
    # The server answers 200 with already_deleted (upstream's clients rely on a 2xx).
    with pytest.raises(errors.SandboxNotFound, match=r"^sandbox twice was already deleted$"):
        client.delete_sandbox("twice")
    assert client.delete_sandbox("twice", missing_ok=True) is False
    sandbox.delete()  # the handle's delete tolerates it


def test_invalid_requests_are_refused_before_sending(
    client: SandboxClient, service: FakeService
) -> None:
    with pytest.raises(errors.InvalidRequest) as caught:
        client.create_sandbox("Not An Image!")
    assert str(caught.value) == (
        "image: image 'Not An Image!' is not a valid image reference "
        "(expected [registry/]name[:tag][@sha256:digest], lowercase name)"
    )
    with pytest.raises(errors.InvalidRequest, match="cpu"):
        client.create_sandbox("python:3.11-slim", cpu="lots")
    with pytest.raises(errors.InvalidRequest, match="is not a DNS label"):
        client.create_sandbox("python:3.11-slim", sandbox_id="Bad_Id")
    assert service.requests == []


def test_stdin_must_be_text(client: SandboxClient, service: FakeService) -> None:
    sandbox = client.create_sandbox("python:3.11-slim")
    with pytest.raises(errors.InvalidRequest, match="stdin must be UTF-8 text"):
        sandbox.exec("cat", stdin=b"\xff\xfe")
    assert service.executions == 0


def test_unknown_status_filter(client: SandboxClient, service: FakeService) -> None:
    with pytest.raises(errors.InvalidRequest, match="unknown sandbox status 'running'") as caught:
        client.list_sandboxes(status="running")
    assert caught.value.hint is not None and "pending, ready" in caught.value.hint
    assert client.list_sandboxes(labels={"a": "b"}, status="ready") == []
    (listing,) = service.seen("GET", "/sandboxes")
    assert listing.url.params.multi_items() == [
        ("label", "a=b"),
        ("status", "ready"),
        ("limit", "500"),
    ]
