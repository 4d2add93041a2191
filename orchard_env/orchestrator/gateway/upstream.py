"""HTTP/1.1 to the configured model endpoints (:mod:`orchard_env.http1`): keep-alive
connections pooled per origin, TLS for ``https``, bodies read as they arrive (Content-Length,
chunked, or to the end of the connection).
"""

from __future__ import annotations

import asyncio
import ssl
from urllib.parse import urlsplit

from orchard_env import http1

CONNECT_TIMEOUT = 5.0
READ_TIMEOUT = 600.0  # a model may think this long before its first byte, or between two
MAX_IDLE = 64  # pooled connections per origin
IDLE_EXPIRY = 60.0

Origin = tuple[str, str, int]


class UpstreamError(Exception):
    """The endpoint could not be reached, or answered no HTTP."""


class Pool:
    def __init__(self) -> None:
        self._origins: dict[Origin, http1.Connections] = {}
        self._tls = ssl.create_default_context()

    async def request(
        self, method: str, url: str, headers: list[tuple[str, str]], body: bytes
    ) -> http1.Response:
        """The answer's head (its body from ``body(READ_TIMEOUT)``); ``close()`` it after."""
        parts = urlsplit(url)
        scheme = parts.scheme
        host = parts.hostname or ""
        port = parts.port or (443 if scheme == "https" else 80)
        origin = (scheme, host, port)
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        head = http1.request_head(method, target, parts.netloc, headers, len(body))
        connections = self._origins.get(origin)
        if connections is None:
            connections = self._origins[origin] = http1.Connections(
                lambda: self._connect(origin), max_idle=MAX_IDLE, idle_expiry=IDLE_EXPIRY
            )
        try:
            return await connections.request(method, head, body, read_timeout=READ_TIMEOUT)
        except TimeoutError:
            raise UpstreamError(f"no answer within {READ_TIMEOUT:g} s") from None
        except (OSError, http1.BadAnswer) as exc:
            raise UpstreamError(f"{type(exc).__name__}: {exc or 'no answer'}") from exc

    async def _connect(self, origin: Origin) -> http1.Stream:
        scheme, host, port = origin
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT):
                return await asyncio.open_connection(
                    host, port, ssl=self._tls if scheme == "https" else None, limit=http1.MAX_HEAD
                )
        except TimeoutError:
            raise UpstreamError(f"no connection within {CONNECT_TIMEOUT:g} s") from None
        except (OSError, ssl.SSLError) as exc:
            raise UpstreamError(f"{type(exc).__name__}: {exc}") from exc

    async def close(self) -> None:
        origins, self._origins = self._origins, {}
        for connections in origins.values():
            await connections.close()
