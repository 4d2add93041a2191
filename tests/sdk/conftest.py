"""Fixtures for the SDK tests: a hermetic environment, fake time, the fake service, and the
real orchestrator on the service-tier fake backend (under uvicorn, or in-process over ASGI)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import httpx
import pytest

from orchard_env.config import ServiceSettings
from orchard_env.sdk import AsyncSandboxClient, SandboxClient, _cleanup
from tests.orchestrator.conftest import make_settings
from tests.orchestrator.fakes import AgentProcessBackend
from tests.sdk.fakes import FakeService
from tests.servers import Live, asgi_service, fake_backend, live_service

KEY_NAME = "sdk-tests"  # the admin key of the real orchestrator

_ENV = (
    "ORCHARD_URL",
    "ORCHARD_API_KEY",
    "ORCHARD_CONTEXT",
    "SANDBOX_BASE_URL",
    "SANDBOX_API_KEY",
    "SANDBOX_PREFIX",
)


@pytest.fixture(autouse=True)
def hermetic_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """No variable or config file of the machine leaks in; no sandbox is left registered."""
    for name in _ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("ORCHARD_CONFIG", str(tmp_path / "no-config.toml"))
    yield
    leftover = _cleanup.pending()
    assert not leftover, f"test left sandboxes registered for exit cleanup: {leftover}"


class FakeTime:
    """A clock that only moves when the code under test sleeps."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds

    def advance(self, seconds: float) -> None:
        """Time passing inside the service (a server-side wait), not a client sleep."""
        self.now += seconds

    async def asleep(self, seconds: float) -> None:
        self.sleep(seconds)


@pytest.fixture
def fake_time() -> FakeTime:
    return FakeTime()


@pytest.fixture
def service() -> FakeService:
    return FakeService()


@pytest.fixture
def make_client(
    service: FakeService, fake_time: FakeTime
) -> Iterator[Callable[..., SandboxClient]]:
    clients: list[SandboxClient] = []

    def make(**kwargs: object) -> SandboxClient:
        kwargs.setdefault("base_url", "http://orchard.test")
        client = SandboxClient(transport=service.transport(), **kwargs)  # type: ignore[arg-type]
        client._sleep = fake_time.sleep
        client._core.clock = fake_time.clock
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close()


@pytest.fixture
def client(make_client: Callable[..., SandboxClient]) -> SandboxClient:
    return make_client()


@pytest.fixture
async def aclient(service: FakeService, fake_time: FakeTime) -> AsyncIterator[AsyncSandboxClient]:
    client = AsyncSandboxClient(base_url="http://orchard.test", transport=service.async_transport())
    client._sleep = fake_time.asleep
    client._core.clock = fake_time.clock
    yield client
    await client.close()


@pytest.fixture
def backend() -> Iterator[AgentProcessBackend]:
    with fake_backend() as fake:
        yield fake


@pytest.fixture
def settings(tmp_path: Path) -> ServiceSettings:
    return make_settings(tmp_path / "state")


@pytest.fixture
def live(settings: ServiceSettings, backend: AgentProcessBackend) -> Iterator[Live]:
    """The orchestrator under uvicorn on a free loopback port, with an admin key."""
    with live_service(settings, key_name=KEY_NAME, backend=backend) as running:
        yield running


@pytest.fixture
async def asgi_app(
    settings: ServiceSettings, backend: AgentProcessBackend
) -> AsyncIterator[tuple[httpx.ASGITransport, str]]:
    """The orchestrator app with its lifespan running, as an ASGI transport plus a key."""
    async with asgi_service(settings, backend, key_name=KEY_NAME) as app:
        yield app
