"""The request body cap: no JSON body (base64 uploads included) may make the orchestrator's
memory grow past a constant. Raw uploads (``PUT .../files/raw``) are streamed to the agent a
chunk at a time and are not capped here."""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from orchard_env.errors import PayloadTooLarge
from orchard_env.orchestrator.api.errors import ErrorAsHTTP, error_response
from orchard_env.quantities import format_memory


def too_large(limit: int, size: int | None = None) -> PayloadTooLarge:
    what = "the request body" if size is None else f"the request body of {size} bytes"
    return PayloadTooLarge(
        f"{what} is over this service's limit of {format_memory(limit)} ({limit} bytes) "
        "for JSON bodies",
        hint="upload large files with PUT /sandboxes/{sandbox_id}/files/raw (streamed, "
        "uncapped; the SDK's upload_file and `orchard sandbox cp` use it), or raise "
        "ORCHARD_MAX_BODY_BYTES",
    )


def streamed(scope: Scope) -> bool:
    return scope.get("method") == "PUT" and str(scope.get("path", "")).endswith("/files/raw")


class BodyLimitMiddleware:
    """413 ``payload_too_large`` for a body over ``limit`` bytes: at once from its
    Content-Length, or as soon as a chunked body passes it (the route never sees it whole)."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or streamed(scope):
            await self.app(scope, receive, send)
            return
        length = Headers(scope=scope).get("content-length", "")
        if length.isdigit() and int(length) > self.limit:
            await error_response(too_large(self.limit, int(length)))(scope, receive, send)
            return
        received = 0

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise ErrorAsHTTP(too_large(self.limit))
            return message

        await self.app(scope, limited, send)
