"""Service-tier fixtures: the orchestrator in-process (httpx ASGITransport), real agents as
host processes behind a fake backend (see :mod:`tests.orchestrator.fakes`), and a clock the
tests move by hand."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import AsyncExitStack
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI
from websockets.asyncio.client import unix_connect

from orchard_env.config import ServiceSettings, default_service_settings
from orchard_env.orchestrator.app import create_app
from orchard_env.orchestrator.keys import create_key
from orchard_env.orchestrator.services import Orchard
from orchard_env.protocol import KeyCreated
from tests.orchestrator.fakes import AgentProcessBackend
from tests.servers import fake_backend


class FakeClock:
    """Wall-clock time under the test's control; each reading moves it on by 1 ms so
    timestamps stay ordered."""

    def __init__(self) -> None:
        self.now = datetime(2026, 1, 1, tzinfo=UTC)

    def __call__(self) -> datetime:
        self.now += timedelta(milliseconds=1)
        return self.now

    def advance(self, seconds: float) -> datetime:
        self.now += timedelta(seconds=seconds)
        return self.now


def make_settings(state_dir: Path, **overrides: Any) -> ServiceSettings:
    """Hermetic settings: the table's defaults (no env, no config file) plus ``overrides``."""
    return default_service_settings(
        **{"state_dir": state_dir, "instance": "test", "ready_timeout_seconds": 20, **overrides}
    )


@dataclass
class Service:
    """One running app and an HTTP client for it (authenticated as ``admin``)."""

    app: FastAPI
    http: httpx.AsyncClient
    admin: KeyCreated | None
    stop: Callable[[], Awaitable[None]]

    @property
    def orchard(self) -> Orchard:
        orchard: Orchard = self.app.state.orchard
        return orchard

    async def new_key(self, name: str, *, admin: bool = False) -> KeyCreated:
        return await create_key(self.orchard.store, name, admin=admin)

    def as_key(self, key: KeyCreated | str | None) -> httpx.AsyncClient:
        headers = {}
        if key is not None:
            headers["X-API-Key"] = key if isinstance(key, str) else key.api_key
        return httpx.AsyncClient(
            transport=httpx.ASGITransport(app=self.app), base_url="http://orchard", headers=headers
        )

    async def create(self, **body: Any) -> dict[str, Any]:
        """Create a sandbox and wait until it is ready."""
        body.setdefault("image", "debian:12")
        response = await self.http.post("/sandboxes", json=body)
        assert response.status_code == 201, response.text
        sandbox_id = response.json()["sandbox_id"]
        ready = await self.http.get(f"/sandboxes/{sandbox_id}/wait", params={"timeout": 30})
        assert ready.status_code == 200, ready.text
        info: dict[str, Any] = ready.json()
        assert info["status"] == "ready", info
        return info

    async def exec(
        self, sandbox_id: str, command: str | list[str] | None, **body: Any
    ) -> dict[str, Any]:
        """Run ``command`` (None: the body names ``argv`` instead), waiting by default."""
        body.setdefault("wait", True)
        if command is not None:
            body["command"] = command
        response = await self.http.post(f"/sandboxes/{sandbox_id}/exec", json=body)
        assert response.status_code == 200, response.text
        job: dict[str, Any] = response.json()
        return job


StartService = Callable[..., Awaitable[Service]]
Connect = Callable[..., Any]


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def backend() -> Iterator[AgentProcessBackend]:
    with fake_backend() as fake:
        yield fake


@pytest.fixture
def settings(tmp_path: Path) -> ServiceSettings:
    return make_settings(tmp_path / "state")


@pytest.fixture
async def start_service(
    settings: ServiceSettings, backend: AgentProcessBackend, clock: FakeClock
) -> AsyncIterator[StartService]:
    """Start apps on the shared db, backend and clock; each is stopped at the end (or by
    ``stop()``), like an orchestrator process would be."""
    stops: list[Callable[[], Awaitable[None]]] = []

    async def start(**overrides: Any) -> Service:
        stack = AsyncExitStack()
        stopped = False

        async def stop() -> None:
            nonlocal stopped
            if not stopped:
                stopped = True
                await stack.aclose()

        stops.append(stop)
        service_settings = replace(settings, **overrides)
        app = create_app(service_settings, backend=backend, clock=clock)
        await stack.enter_async_context(app.router.lifespan_context(app))
        orchard: Orchard = app.state.orchard
        admin = None
        headers = {}
        if service_settings.require_api_key:
            admin = await create_key(orchard.store, "admin", admin=True)
            headers["X-API-Key"] = admin.api_key
        http = await stack.enter_async_context(
            httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://orchard", headers=headers
            )
        )
        return Service(app=app, http=http, admin=admin, stop=stop)

    yield start
    for stop in reversed(stops):
        await stop()


@pytest.fixture
async def service(start_service: StartService) -> Service:
    return await start_service()


@pytest.fixture
async def ws_connect(service: Service, tmp_path: Path) -> AsyncIterator[Connect]:
    """Serve the running app on a unix socket (no TCP) and connect WebSockets to it."""
    sock = tmp_path / "orchard.sock"
    server = uvicorn.Server(
        uvicorn.Config(service.app, uds=str(sock), lifespan="off", log_config=None)
    )
    task = asyncio.create_task(server.serve())

    async def started() -> bool:
        return server.started

    await eventually(started)

    def connect(path: str, **options: Any) -> Any:
        return unix_connect(str(sock), uri=f"ws://orchard{path}", **options)

    yield connect
    server.should_exit = True
    await task


async def eventually(check: Callable[[], Awaitable[bool]], seconds: float = 10.0) -> None:
    """Poll ``check`` until it is true, failing after ``seconds``."""
    deadline = time.monotonic() + seconds
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {seconds} s")
        await asyncio.sleep(0.02)
