"""Where a client connects: argument > ORCHARD_* > SANDBOX_* > config context > default."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest

from orchard_env import contexts, errors
from orchard_env.sdk import SandboxClient
from tests.sdk.fakes import FakeService


def _seen_by(service: FakeService, **kwargs: object) -> httpx.Request:
    with SandboxClient(transport=service.transport(), **kwargs) as client:  # type: ignore[arg-type]
        client.health()
    return service.requests[-1]


@pytest.fixture
def context_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    path = tmp_path / "config.toml"
    monkeypatch.setenv("ORCHARD_CONFIG", str(path))
    contexts.write_context("lab", {"url": "http://from-context:1", "api_key": "ork_context"})
    contexts.write_context(
        "other", {"url": "http://other-context:2", "api_key": "ork_other"}, make_current=False
    )
    return path


def test_default_url(service: FakeService) -> None:
    request = _seen_by(service)
    assert str(request.url) == "http://127.0.0.1:8000/health"
    assert "X-API-Key" not in request.headers


@pytest.mark.usefixtures("context_file")
def test_precedence(monkeypatch: pytest.MonkeyPatch, service: FakeService) -> None:
    request = _seen_by(service)
    assert (request.url.host, request.headers["X-API-Key"]) == ("from-context", "ork_context")

    with SandboxClient(transport=service.transport()) as client:
        assert client.context == "lab"
    request = _seen_by(service, context="other")
    assert (request.url.host, request.headers["X-API-Key"]) == ("other-context", "ork_other")

    monkeypatch.setenv("SANDBOX_BASE_URL", "http://upstream-env:3")
    monkeypatch.setenv("SANDBOX_API_KEY", "upstream-key")
    request = _seen_by(service)
    assert (request.url.host, request.headers["X-API-Key"]) == ("upstream-env", "upstream-key")

    monkeypatch.setenv("ORCHARD_URL", "http://orchard-env:4/")
    monkeypatch.setenv("ORCHARD_API_KEY", "ork_env")
    request = _seen_by(service)
    assert (request.url.host, request.headers["X-API-Key"]) == ("orchard-env", "ork_env")

    request = _seen_by(service, base_url="http://argument:5", api_key="ork_arg")
    assert (request.url.host, request.headers["X-API-Key"]) == ("argument", "ork_arg")


def test_base_url_with_a_path(service: FakeService) -> None:
    with pytest.raises(errors.NotFound):  # the fake serves at the root only
        _seen_by(service, base_url="http://gateway/orchard/")
    assert str(service.requests[-1].url) == "http://gateway/orchard/health"


def test_unknown_context_is_a_config_error(context_file: Path) -> None:
    with pytest.raises(errors.ConfigError, match="context 'missing' is not in"):
        SandboxClient(context="missing")


def test_bad_url_is_a_config_error() -> None:
    with pytest.raises(errors.ConfigError, match="must start with http:// or https://"):
        SandboxClient(base_url="orchard.example:8000")


def test_prefix_from_env_makes_ids(monkeypatch: pytest.MonkeyPatch, service: FakeService) -> None:
    monkeypatch.setenv("SANDBOX_PREFIX", "myapp")
    with SandboxClient(base_url="http://t", transport=service.transport()) as client:
        generated = client.create_sandbox("python:3.11-slim")
        named = client.create_sandbox("python:3.11-slim", sandbox_id="run7")
        kept = client.create_sandbox("python:3.11-slim", sandbox_id="myapp-run8")
        assert re.fullmatch(r"myapp-[0-9a-f]{8}", generated.sandbox_id)
        assert named.sandbox_id == "myapp-run7"
        assert kept.sandbox_id == "myapp-run8"


def test_bad_prefix(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(errors.ConfigError, match=r"prefix 'My_App' \(from prefix=\)"):
        SandboxClient(prefix="My_App")
    monkeypatch.setenv("SANDBOX_PREFIX", "-x")
    with pytest.raises(errors.ConfigError, match=r"\(from SANDBOX_PREFIX\)"):
        SandboxClient()


def test_the_key_is_not_in_the_repr() -> None:
    client = SandboxClient(base_url="http://t", api_key="ork_secret")
    assert "ork_secret" not in repr(client)
    client.close()
