"""The orchestrator started for real in tests: the app under uvicorn on 127.0.0.1 in a thread
(:func:`serve`, :func:`live_service`), or in-process behind ``httpx.ASGITransport`` with its
lifespan running (:func:`asgi_service`), each with an admin key; the service-tier fake
backend that stops its agents afterwards (:func:`fake_backend`); and a server process that
prints where it listens (:func:`printing_server`)."""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack, asynccontextmanager, contextmanager
from typing import NamedTuple

import httpx
import uvicorn
from fastapi import FastAPI

from orchard_env.config import ServiceSettings
from orchard_env.orchestrator.app import create_app
from orchard_env.orchestrator.backends.base import Backend
from orchard_env.orchestrator.keys import create_key, create_key_sync
from tests.orchestrator.fakes import AgentProcessBackend

START_SECONDS = 60  # the engine backend connects to the engine and sweeps it on startup
STOP_SECONDS = 30


class Live(NamedTuple):
    """A running orchestrator: its base URL and an admin key (unpacks as ``url, key``)."""

    url: str
    api_key: str


@contextmanager
def serve(app: FastAPI, *, thread_name: str = "uvicorn") -> Iterator[str]:
    """Run ``app`` (lifespan on) under uvicorn on a free loopback port in a daemon thread;
    yield its base URL, and stop the server on the way out."""
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host="127.0.0.1",
            port=0,
            lifespan="on",
            log_config=None,
            log_level="warning",
        )
    )
    thread = threading.Thread(target=server.run, name=thread_name, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + START_SECONDS
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=STOP_SECONDS)


@contextmanager
def live_service(
    settings: ServiceSettings,
    *,
    key_name: str,
    backend: Backend | None = None,
    thread_name: str = "uvicorn",
) -> Iterator[Live]:
    """The orchestrator for ``settings`` under uvicorn (see :func:`serve`) with an admin key
    named ``key_name``; on ``backend`` (the service-tier fake), or on the backend the settings
    choose (the real engine) when it is None."""
    key = create_key_sync(settings, key_name, admin=True)
    with serve(create_app(settings, backend=backend), thread_name=thread_name) as url:
        yield Live(url, key.api_key)


@asynccontextmanager
async def asgi_service(
    settings: ServiceSettings, backend: Backend, *, key_name: str
) -> AsyncIterator[tuple[httpx.ASGITransport, str]]:
    """The orchestrator app with its lifespan running, as an ASGI transport plus an admin
    key named ``key_name``."""
    app = create_app(settings, backend=backend)
    async with AsyncExitStack() as stack:
        await stack.enter_async_context(app.router.lifespan_context(app))
        key = await create_key(app.state.orchard.store, key_name, admin=True)
        yield httpx.ASGITransport(app=app), key.api_key


@contextmanager
def fake_backend() -> Iterator[AgentProcessBackend]:
    """The service-tier fake backend (agents as host processes), shut down on the way out."""
    fake = AgentProcessBackend()
    try:
        yield fake
    finally:
        fake.shutdown()


@contextmanager
def printing_server(command: list[str]) -> Iterator[str]:
    """Run a server process that prints one line once it listens (its port, its URL); yield
    that line, and kill the process on the way out."""
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True) as server:
        try:
            assert server.stdout is not None
            yield server.stdout.readline().strip()
        finally:
            server.kill()
