"""The FastAPI application: routes, error handling, and the lifespan that owns the services."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from datetime import datetime

from fastapi import FastAPI

from orchard_env import __version__
from orchard_env.config import ServiceSettings
from orchard_env.orchestrator.api import add_routes
from orchard_env.orchestrator.api.errors import (
    RequestContextMiddleware,
    document_errors,
    install_error_handlers,
)
from orchard_env.orchestrator.api.limits import BodyLimitMiddleware
from orchard_env.orchestrator.backends import make_backend
from orchard_env.orchestrator.backends.base import Backend
from orchard_env.orchestrator.keys import import_key_file
from orchard_env.orchestrator.lease import instance_lease
from orchard_env.orchestrator.records import utcnow
from orchard_env.orchestrator.services import Orchard
from orchard_env.orchestrator.store import SQLiteStore, Store

log = logging.getLogger(__name__)


def create_app(
    settings: ServiceSettings,
    *,
    backend: Backend | None = None,
    store: Store | None = None,
    clock: Callable[[], datetime] = utcnow,
) -> FastAPI:
    """The orchestrator app. A ``backend`` or ``store`` passed in is used but not closed (the
    caller owns it); otherwise the lifespan makes them from ``settings`` and closes them, and
    on the local engine holds the instance's lease (:mod:`orchard_env.orchestrator.lease`)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with contextlib.AsyncExitStack() as stack:
            the_store = store
            if the_store is None:
                the_store = SQLiteStore(settings.db_path)
                stack.push_async_callback(the_store.close)
            await the_store.open()
            if settings.bootstrap_key_file is not None:
                await import_key_file(the_store, settings.bootstrap_key_file)
            the_backend = backend
            if the_backend is None:
                the_backend = make_backend(settings)  # checks the instance name, too
                stack.push_async_callback(the_backend.close)
                if settings.backend == "docker":
                    stack.enter_context(instance_lease(settings))
            orchard = Orchard.build(settings, the_store, the_backend, clock)
            stack.push_async_callback(orchard.stop)
            await orchard.start()
            reaper = asyncio.create_task(orchard.reaper.run_forever(), name="reaper")
            stack.push_async_callback(_cancel, reaper)
            app.state.orchard = orchard
            log.info(
                "orchestrator ready",
                extra={"backend": the_backend.name, "state": str(settings.db_path)},
            )
            yield

    app = FastAPI(
        title="Orchard",
        version=__version__,
        summary="Sandboxes for AI agents: upstream Orchard Env's API, extended.",
        lifespan=lifespan,
    )
    install_error_handlers(app)
    document_errors(app)
    app.add_middleware(BodyLimitMiddleware, limit=settings.max_body_bytes)
    app.add_middleware(RequestContextMiddleware)
    add_routes(app)
    return app


async def _cancel(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
