"""Every error answers ``{"detail": {"code", "message", "hint"?}}``; every response has an id.

* :class:`~orchard_env.errors.OrchardError` -> its ``http_status`` (503s carry Retry-After).
* Request validation -> 400 ``invalid_request`` naming the field, with the protocol
  validators' own messages.
* Unknown routes and methods -> 404 ``not_found`` / 405 ``invalid_request``.
* Anything else -> 500 ``internal`` naming the request id (logged with its traceback).
"""

from __future__ import annotations

import logging
import re
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.datastructures import Headers, MutableHeaders
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from orchard_env.errors import InvalidRequest, NotFound, OrchardError, Unavailable
from orchard_env.orchestrator.logs import request_id_var
from orchard_env.protocol import ErrorBody, validation_message

log = logging.getLogger(__name__)

REQUEST_ID_HEADER = "X-Request-ID"
RETRY_AFTER_SECONDS = "5"
_CLIENT_ID_RE = re.compile(r"^[\w.:-]{1,128}$")


def error_response(error: OrchardError) -> JSONResponse:
    headers = {"Retry-After": RETRY_AFTER_SECONDS} if isinstance(error, Unavailable) else None
    return JSONResponse(error.to_wire(), status_code=error.http_status, headers=headers)


async def _orchard_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, OrchardError)
    return error_response(exc)


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return error_response(InvalidRequest(validation_message(list(exc.errors()))))


class ErrorAsHTTP(HTTPException):
    """An :class:`OrchardError` raised where FastAPI lets only HTTP exceptions through (while
    it reads a request body); answered as the error itself."""

    def __init__(self, error: OrchardError) -> None:
        super().__init__(error.http_status, error.message)
        self.error = error


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    error: OrchardError
    if isinstance(exc, ErrorAsHTTP):
        return error_response(exc.error)
    if exc.status_code == 404:
        error = NotFound(f"no route {request.method} {request.url.path}")
    elif exc.status_code == 405:
        error = InvalidRequest(f"{request.method} is not allowed on {request.url.path}")
    else:
        error = OrchardError(str(exc.detail))
    response = error_response(error)
    response.status_code = exc.status_code
    return response


def document_errors(app: FastAPI) -> None:
    """Make the OpenAPI schema say what the service answers on errors: a bad request is a
    400 with :class:`~orchard_env.protocol.ErrorBody` (never FastAPI's 422 validation body),
    and any route may answer an ``ErrorBody`` with the status of its error class."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = generate()
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            components.pop(name, None)
        body = ErrorBody.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(body.pop("$defs", {}))
        components["ErrorBody"] = body
        ref = {"$ref": "#/components/schemas/ErrorBody"}
        error = {"content": {"application/json": {"schema": ref}}}
        for operations in schema.get("paths", {}).values():
            for operation in operations.values():
                responses = operation.setdefault("responses", {})
                if responses.pop("422", None) is not None:
                    responses["400"] = {"description": "Invalid request", **error}
                responses["default"] = {"description": "An error (see its code)", **error}
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(OrchardError, _orchard_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)


class RequestContextMiddleware:
    """Sets the request id (the client's ``X-Request-ID`` if sane, else a new one), adds it to
    every response, and turns an unhandled exception into a 500 that names it."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        given = Headers(scope=scope).get(REQUEST_ID_HEADER)
        request_id = given if given and _CLIENT_ID_RE.match(given) else uuid.uuid4().hex
        token = request_id_var.set(request_id)
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                MutableHeaders(scope=message).append(REQUEST_ID_HEADER, request_id)
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            log.exception(
                "unhandled error",
                extra={"method": scope.get("method"), "path": scope.get("path")},
            )
            if scope["type"] == "http" and not started:
                error = OrchardError(
                    f"internal error (request id {request_id})",
                    hint="this is a bug in Orchard: the service log has the details",
                )
                await error_response(error)(scope, receive, send_with_id)
        finally:
            request_id_var.reset(token)
