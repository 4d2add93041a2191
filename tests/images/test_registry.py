"""Pushing: the ACR token exchange at the HTTP layer (httpx.MockTransport), the builder's
login with the password on stdin, and push_images (fake builders on PATH)."""

from __future__ import annotations

import base64
import json
import sys
import urllib.parse
from dataclasses import dataclass, field

import httpx
import pytest
from azure.core.exceptions import ClientAuthenticationError

from images.build import (
    ACR_USERNAME,
    ARM_SCOPE,
    acr_login,
    default_azure_credential,
    exchange_acr_token,
    push_images,
)
from orchard_env.errors import ConfigError, OrchardError, PermissionDenied
from tests.images.conftest import FakeBuilders

SERVER = "myacr.azurecr.io"
REFRESH = "acr-refresh-token-value"


def _jwt(claims: dict[str, str]) -> str:
    def part(data: dict[str, str]) -> str:
        return base64.urlsafe_b64encode(json.dumps(data).encode()).decode().rstrip("=")

    return f"{part({'alg': 'RS256'})}.{part(claims)}.c2lnbmF0dXJl"


AAD_TOKEN = _jwt({"tid": "72f988bf-0000-0000-0000-000000000000", "aud": "management"})


@dataclass
class Exchange:
    """A fake ACR: answers /oauth2/exchange and records the requests it got."""

    status: int = 200
    body: object = field(default_factory=lambda: {"refresh_token": REFRESH})
    requests: list[httpx.Request] = field(default_factory=list)

    def transport(self) -> httpx.MockTransport:
        def handle(request: httpx.Request) -> httpx.Response:
            self.requests.append(request)
            return httpx.Response(self.status, json=self.body)

        return httpx.MockTransport(handle)


def _form(request: httpx.Request) -> dict[str, list[str]]:
    return urllib.parse.parse_qs(request.content.decode(), strict_parsing=True)


def test_the_exchange_posts_the_aad_token_as_a_form() -> None:
    acr = Exchange()
    assert exchange_acr_token(SERVER, AAD_TOKEN, transport=acr.transport()) == REFRESH
    (request,) = acr.requests
    assert request.method == "POST"
    assert str(request.url) == "https://myacr.azurecr.io/oauth2/exchange"
    assert request.headers["content-type"] == "application/x-www-form-urlencoded"
    assert _form(request) == {
        "grant_type": ["access_token"],
        "service": [SERVER],
        "tenant": ["72f988bf-0000-0000-0000-000000000000"],
        "access_token": [AAD_TOKEN],
    }


def test_a_token_without_a_tenant_claim_is_sent_without_tenant() -> None:
    acr = Exchange()
    exchange_acr_token(SERVER, "opaque-token", transport=acr.transport())
    assert _form(acr.requests[0]) == {
        "grant_type": ["access_token"],
        "service": [SERVER],
        "access_token": ["opaque-token"],
    }


def test_a_refused_exchange_names_the_role_and_never_the_token() -> None:
    acr = Exchange(status=401, body={"errors": [{"code": "UNAUTHORIZED", "message": "nope"}]})
    with pytest.raises(PermissionDenied) as caught:
        exchange_acr_token(SERVER, AAD_TOKEN, transport=acr.transport())
    assert caught.value.message == (
        'myacr.azurecr.io refused the ACR token exchange (HTTP 401): {"errors":[{"code":'
        '"UNAUTHORIZED","message":"nope"}]}'
    )
    assert caught.value.hint is not None and "AcrPush" in caught.value.hint
    assert AAD_TOKEN not in caught.value.message


def test_an_answer_without_a_refresh_token_is_an_error() -> None:
    with pytest.raises(OrchardError) as caught:
        exchange_acr_token(SERVER, AAD_TOKEN, transport=Exchange(body={}).transport())
    assert caught.value.message == (
        "myacr.azurecr.io answered the ACR token exchange without a token"
    )


def test_an_unreachable_registry_is_an_error() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("name or service not known", request=request)

    with pytest.raises(OrchardError) as caught:
        exchange_acr_token(SERVER, AAD_TOKEN, transport=httpx.MockTransport(refuse))
    assert caught.value.message == (
        "cannot reach myacr.azurecr.io for the ACR token exchange: name or service not known"
    )


@dataclass
class _Token:
    token: str


@dataclass
class FakeCredential:
    scopes: list[tuple[str, ...]] = field(default_factory=list)
    fail: bool = False

    def get_token(self, *scopes: str) -> _Token:
        self.scopes.append(scopes)
        if self.fail:
            raise ClientAuthenticationError("DefaultAzureCredential failed to retrieve a token")
        return _Token(AAD_TOKEN)


def test_acr_login_passes_the_refresh_token_on_stdin_never_in_argv(
    fake_builders: FakeBuilders,
) -> None:
    fake_builders.install("podman")
    credential = FakeCredential()
    acr_login(SERVER, credential, "podman", transport=Exchange().transport())
    assert credential.scopes == [(ARM_SCOPE,)]
    (call,) = fake_builders.calls()
    assert call["args"] == ["login", SERVER, "-u", ACR_USERNAME, "--password-stdin"]
    assert call["stdin"] == REFRESH + "\n"


def test_acr_login_without_azure_credentials_says_how_to_log_in(
    fake_builders: FakeBuilders,
) -> None:
    fake_builders.install("podman")
    with pytest.raises(OrchardError) as caught:
        acr_login(SERVER, FakeCredential(fail=True), "podman", transport=Exchange().transport())
    assert caught.value.message == "no Azure credential is available to log in to " + SERVER
    assert caught.value.hint is not None and caught.value.hint.startswith("run `az login`")
    assert fake_builders.calls() == []


def test_a_failed_builder_login_is_an_error(fake_builders: FakeBuilders) -> None:
    fake_builders.install("docker")
    fake_builders.fail("docker", "login")
    with pytest.raises(OrchardError) as caught:
        acr_login(SERVER, FakeCredential(), "docker", transport=Exchange().transport())
    assert caught.value.message == (
        "docker login myacr.azurecr.io failed (exit 3): docker: login failed on purpose"
    )
    assert REFRESH not in caught.value.message


def test_without_the_azure_extra_the_credential_has_an_install_hint(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "azure.identity", None)  # import raises ImportError
    with pytest.raises(OrchardError) as caught:
        default_azure_credential()
    assert caught.value.message == "logging in to Azure Container Registry needs azure-identity"
    assert caught.value.hint == "install the azure extra: pip install 'orchard[azure]'"


def test_push_logs_in_to_each_acr_once_then_pushes_every_image(
    fake_builders: FakeBuilders,
) -> None:
    fake_builders.install("podman")
    acr = Exchange()
    refs = {
        "orchestrator": f"{SERVER}/orchard/orchestrator:t",
        "sandbox": f"{SERVER}/orchard/sandbox:t",
        "agent-injector": "ghcr.io/acme/orchard/agent-injector:t",
    }
    lines: list[str] = []
    pushed = push_images(
        refs,
        builder="podman",
        credential=FakeCredential(),
        transport=acr.transport(),
        progress=lines.append,
    )
    assert pushed == list(refs.values())
    assert len(acr.requests) == 1
    assert [call["args"] for call in fake_builders.calls()] == [
        ["login", SERVER, "-u", ACR_USERNAME, "--password-stdin"],
        ["push", refs["orchestrator"]],
        ["push", refs["sandbox"]],
        ["push", refs["agent-injector"]],
    ]
    assert lines[0] == "logging in to myacr.azurecr.io (ACR token exchange)"
    assert lines[-1] == f"pushing {refs['agent-injector']}"


def test_push_without_login_only_pushes(fake_builders: FakeBuilders) -> None:
    fake_builders.install("docker")
    push_images({"sandbox": f"{SERVER}/orchard/sandbox:t"}, builder="docker", login=False)
    assert fake_builders.args("push") == [["push", f"{SERVER}/orchard/sandbox:t"]]
    assert fake_builders.args("login") == []


def test_a_plain_http_push_tells_podman_and_leaves_docker_to_its_daemon(
    fake_builders: FakeBuilders,
) -> None:
    ref = "10.200.0.2:5000/orchard/sandbox:t"
    for builder in ("podman", "docker"):
        fake_builders.install(builder)
        push_images({"sandbox": ref}, builder=builder, plain_http=True)
    assert fake_builders.args("push") == [["push", "--tls-verify=false", ref], ["push", ref]]


def test_push_refuses_local_references_before_anything(fake_builders: FakeBuilders) -> None:
    fake_builders.install("podman")
    with pytest.raises(ConfigError) as caught:
        push_images(
            {"orchestrator": "r.io/o/orchestrator:t", "sandbox": "localhost/orchard/sandbox:t"},
            builder="podman",
        )
    assert caught.value.message == "localhost/orchard/sandbox:t names no registry to push to"
    assert fake_builders.calls() == []


def test_a_failed_push_is_an_error(fake_builders: FakeBuilders) -> None:
    fake_builders.install("podman")
    fake_builders.fail("podman", "push")
    with pytest.raises(OrchardError) as caught:
        push_images({"sandbox": "r.io/o/sandbox:t"}, builder="podman")
    assert caught.value.message == (
        "podman could not push r.io/o/sandbox:t (exit 3):\n"
        "step 1 of the work\npodman: push failed on purpose"
    )
