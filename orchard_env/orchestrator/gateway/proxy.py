"""The gateway: one unix socket per sandbox, in its run directory, where the sandbox's agent
relays each connection its harnesses open to ``127.0.0.1:4000``; or, for an agent on TCP
that cannot dial out (Kubernetes), connections the orchestrator parks at the agent
(:mod:`.parks`), handled here the same way.

The socket a connection came in on, or the agent it was parked at, is the sandbox it is from
(nothing it sends can claim another). Each request is routed by path to the endpoint chosen
for the sandbox (``/v1/messages...`` to its Anthropic endpoint, other ``/v1/...`` to its
OpenAI-compatible one), with the sandbox's credentials stripped and the real key put in; the
answer is streamed back as it arrives and the call recorded (:mod:`.calls`). No absolute
URI, CONNECT or upgrade: only the configured upstreams are reachable.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orchard_env import http1
from orchard_env.orchestrator.backends.base import AgentEndpoint
from orchard_env.orchestrator.gateway import wire
from orchard_env.orchestrator.gateway.assemble import OPENAI_CHAT, api_of
from orchard_env.orchestrator.gateway.calls import SECRET_HEADERS, Call
from orchard_env.orchestrator.gateway.endpoints import Endpoint, Endpoints
from orchard_env.orchestrator.gateway.harness import SOCKET_NAME
from orchard_env.orchestrator.gateway.parks import Parks, Tampered
from orchard_env.orchestrator.gateway.upstream import READ_TIMEOUT, Pool, UpstreamError
from orchard_env.orchestrator.records import GatewayRecord
from orchard_env.orchestrator.store import Store

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 64  # open at once per sandbox; more are answered 503 and closed
IDLE_SECONDS = 300.0  # a keep-alive connection with no request for this long is closed
TRAJECTORY_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
_PATH_RE = re.compile(r"^/v1(/[A-Za-z0-9._~:@!$&'()*+,;=-]+)*/?$")
_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
        "expect",
        "accept-encoding",
    }
)


@dataclass
class _Sandbox:
    sandbox_id: str
    config: GatewayRecord
    server: asyncio.AbstractServer | None = None
    parks: Parks | None = None
    connections: int = 0
    calls: int = 0
    tokens: int = 0
    seqs: dict[str, int] = field(default_factory=dict)
    writers: set[asyncio.StreamWriter] = field(default_factory=set)


class ModelGateway:
    def __init__(self, endpoints: Endpoints, store: Store, sandboxes_dir: Path) -> None:
        self.endpoints = endpoints
        self.store = store
        self.sandboxes_dir = sandboxes_dir
        self._sandboxes: dict[str, _Sandbox] = {}
        self._changed: dict[str, asyncio.Condition] = {}
        self._pending: set[asyncio.Task[None]] = set()
        self._upstream = Pool()

    # -- sandboxes ------------------------------------------------------------------------

    async def attach(self, sandbox_id: str, config: GatewayRecord) -> None:
        """Serve the sandbox's socket (again, after a restart); idempotent."""
        current = self._sandboxes.get(sandbox_id)
        if current is not None:
            current.config = config
            return
        box = await self._box(sandbox_id, config)
        path = self.sandboxes_dir / sandbox_id / SOCKET_NAME
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        box.server = await asyncio.start_unix_server(
            lambda r, w: self._connection(box, r, w), str(path), limit=wire.MAX_LINE, backlog=256
        )
        path.chmod(0o666)  # the agent may run as any user of the image
        self._sandboxes[sandbox_id] = box

    async def attach_parked(
        self, sandbox_id: str, config: GatewayRecord, agent: AgentEndpoint, tampered: Tampered
    ) -> None:
        """Serve the sandbox over connections parked at its enrolled agent on TCP (again,
        after a restart); idempotent. ``tampered`` hears of an impostor at ``agent``."""
        current = self._sandboxes.get(sandbox_id)
        if current is not None:
            current.config = config
            return
        box = await self._box(sandbox_id, config)
        box.parks = Parks(
            sandbox_id,
            agent,
            lambda r, w: self._connection(box, r, w),
            tampered,
            MAX_CONNECTIONS,
        )
        self._sandboxes[sandbox_id] = box

    async def _box(self, sandbox_id: str, config: GatewayRecord) -> _Sandbox:
        box = _Sandbox(sandbox_id, config)
        box.calls, box.tokens, box.seqs = await self.store.model_call_totals(sandbox_id)
        return box

    def set_trajectory(self, sandbox_id: str, config: GatewayRecord) -> None:
        box = self._sandboxes.get(sandbox_id)
        if box is not None:
            box.config = config

    async def detach(self, sandbox_id: str) -> None:
        box = self._sandboxes.pop(sandbox_id, None)
        if box is None:
            return
        if box.server is not None:
            box.server.close()
        for writer in list(box.writers):
            writer.close()
        if box.parks is not None:
            await box.parks.close()
        if box.server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(box.server.wait_closed(), 5)
        self._wake(sandbox_id)

    async def close(self) -> None:
        for sandbox_id in list(self._sandboxes):
            await self.detach(sandbox_id)
        if self._pending:
            await asyncio.gather(*self._pending, return_exceptions=True)
        await self._upstream.close()

    # -- followers of a sandbox's records -----------------------------------------------

    def condition(self, sandbox_id: str) -> asyncio.Condition:
        return self._changed.setdefault(sandbox_id, asyncio.Condition())

    def attached(self, sandbox_id: str) -> bool:
        return sandbox_id in self._sandboxes

    def _wake(self, sandbox_id: str) -> None:
        condition = self._changed.get(sandbox_id)
        if condition is None:
            return

        async def notify() -> None:
            async with condition:
                condition.notify_all()

        self._spawn(notify())

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    # -- connections --------------------------------------------------------------------

    async def _connection(
        self, box: _Sandbox, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        if box.connections >= MAX_CONNECTIONS:
            message = f"the sandbox has {MAX_CONNECTIONS} gateway connections open already"
            writer.write(wire.error_bytes(503, message, anthropic=False, close=True))
            with contextlib.suppress(ConnectionError):
                await writer.drain()
                await _linger(reader, writer)  # closing on an unread request would reset it
            writer.close()
            return
        box.connections += 1
        box.writers.add(writer)
        try:
            while True:
                try:
                    async with asyncio.timeout(IDLE_SECONDS + wire.HEAD_TIMEOUT):
                        request = await wire.read_request(reader, writer)
                except wire.BadRequest as exc:
                    writer.write(
                        wire.error_bytes(exc.status, exc.message, anthropic=False, close=True)
                    )
                    await writer.drain()
                    await _linger(reader, writer)  # so the answer is read, not reset away
                    break
                if request is None:
                    break
                if not await self._call(box, request, writer) or not request.keep_alive:
                    break
        except (ConnectionError, asyncio.IncompleteReadError, TimeoutError, ValueError):
            pass
        finally:
            box.connections -= 1
            box.writers.discard(writer)
            writer.close()

    async def _call(
        self, box: _Sandbox, request: wire.Request, writer: asyncio.StreamWriter
    ) -> bool:
        """Answer one request; False when the connection must close after it."""
        path, _, query = request.target.partition("?")
        trajectory = box.config.trajectory_id
        if path.startswith("/t/"):
            trajectory, _, rest = path[3:].partition("/")
            path = "/" + rest
        else:
            trajectory = request.header("x-orchard-trajectory") or trajectory
        anthropic = path.startswith("/v1/messages")
        if not TRAJECTORY_RE.fullmatch(trajectory):
            message = f"trajectory id {trajectory[:60]!r}: use 1-128 of A-Z a-z 0-9 . _ : -"
            writer.write(wire.error_bytes(400, message, anthropic=anthropic, close=True))
            return False
        seq = box.seqs.get(trajectory, 0) + 1
        box.seqs[trajectory] = seq
        call = Call(
            sandbox_id=box.sandbox_id,
            trajectory_id=trajectory,
            seq=seq,
            method=request.method,
            path=path + (f"?{query}" if query else ""),
            api=api_of(request.method, path),
            request_headers=request.headers,
            request_body=request.body,
        )
        try:
            return await self._forward(box, call, request, writer, anthropic, query)
        finally:
            self._spawn(self._store(box, call))

    async def _forward(
        self,
        box: _Sandbox,
        call: Call,
        request: wire.Request,
        writer: asyncio.StreamWriter,
        anthropic: bool,
        query: str,
    ) -> bool:
        def refuse(status: int, message: str, close: bool = False) -> bool:
            call.status, call.error = status, message
            call.first_byte()
            writer.write(wire.error_bytes(status, message, anthropic=anthropic, close=close))
            return not close

        if request.header("upgrade"):
            return refuse(426, "the gateway speaks plain HTTP/1.1 only: no upgrades (WebSocket)")
        path = call.path.split("?", 1)[0]
        endpoint = self._endpoint(box.config, "anthropic" if anthropic else "openai")
        if not _PATH_RE.fullmatch(path) or "/../" in path + "/" or "/./" in path + "/":
            return refuse(404, f"no model API at {path[:80]!r}: the gateway serves /v1/...")
        if endpoint is None:
            api = "Anthropic" if anthropic else "OpenAI-compatible"
            return refuse(404, f"this sandbox has no {api} endpoint")
        limits = box.config
        if limits.max_calls is not None and box.calls >= limits.max_calls:
            return refuse(
                403,
                f"model call budget exceeded: {box.calls} of max_calls "
                f"{limits.max_calls} used (set when the sandbox was created)",
            )
        if limits.max_tokens is not None and box.tokens >= limits.max_tokens:
            return refuse(
                403,
                f"model token budget exceeded: {box.tokens} of max_tokens "
                f"{limits.max_tokens} used (set when the sandbox was created)",
            )
        box.calls += 1
        call.upstream = endpoint.name
        # Anthropic's base URL has no /v1 (its clients append /v1/messages); an
        # OpenAI-compatible one ends where /v1 would (https://api.openai.com/v1, .../v4).
        tail = path if anthropic else path.removeprefix("/v1")
        url = endpoint.base_url + tail + (f"?{query}" if query else "")
        headers = _upstream_headers(request, endpoint)
        try:
            response = await self._upstream.request(
                request.method, url, headers, _upstream_body(call)
            )
        except UpstreamError as exc:
            return refuse(502, f"the model endpoint {endpoint.name!r} is unreachable: {exc}")
        try:
            return await self._relay(call, response, writer)
        finally:
            response.close()

    @staticmethod
    async def _relay(call: Call, response: http1.Response, writer: asyncio.StreamWriter) -> bool:
        call.first_byte()
        call.status = response.status
        call.response_headers = response.headers
        head = wire.status_line(response.status)
        for name, value in response.headers:
            if name not in _HOP or (name == "content-length" and not response.chunked):
                head += f"{name}: {value}\r\n".encode("latin-1", "replace")
        chunked = response.length is None or response.chunked
        if chunked:
            head += b"transfer-encoding: chunked\r\n"
        writer.write(head + b"\r\n")
        try:
            async for chunk in response.body(READ_TIMEOUT):
                call.keep(chunk)
                writer.write(b"%x\r\n%b\r\n" % (len(chunk), chunk) if chunked else chunk)
                await writer.drain()
        except (http1.BadAnswer, OSError, TimeoutError) as exc:
            if isinstance(exc, ConnectionError) and writer.is_closing():
                call.error = "the harness closed the connection before the answer ended"
                raise
            call.error = f"the model endpoint broke off its answer: {type(exc).__name__}: {exc}"
            return False
        if chunked:
            writer.write(b"0\r\n\r\n")
        await writer.drain()
        return True

    def _endpoint(self, config: GatewayRecord, api: str) -> Endpoint | None:
        name = config.anthropic if api == "anthropic" else config.openai
        return None if name is None else self.endpoints.endpoints.get(name)

    async def _store(self, box: _Sandbox, call: Call) -> None:
        try:
            record = call.record()
            usage = record["usage"] or {}
            box.tokens += int(usage.get("input_tokens", 0)) + int(usage.get("output_tokens", 0))
            await self.store.insert_model_call(record)
        except Exception as exc:
            log.warning(
                "could not record a model call",
                extra={"sandbox_id": box.sandbox_id, "error": repr(exc)},
            )
        self._wake(box.sandbox_id)


def _upstream_headers(request: wire.Request, endpoint: Endpoint) -> list[tuple[str, str]]:
    headers = [
        (name, value)
        for name, value in request.headers
        if name not in _HOP and name not in SECRET_HEADERS and not name.startswith("x-orchard-")
    ]
    headers.append(("accept-encoding", "identity"))  # recorded answers stay readable
    key = endpoint.key()
    if key:
        if endpoint.api == "anthropic":
            headers.append(("x-api-key", key))
        else:
            headers.append(("authorization", f"Bearer {key}"))
    return headers


def _upstream_body(call: Call) -> bytes:
    """The body as sent, but a streamed Chat call asks for its usage (pi and hermes do not)."""
    if call.api != OPENAI_CHAT:
        return call.request_body
    body = call.request_json
    if not isinstance(body, dict) or not body.get("stream"):
        return call.request_body
    options = body.get("stream_options")
    if isinstance(options, dict) and "include_usage" in options:
        return call.request_body
    asked = {**body, "stream_options": {**(options or {}), "include_usage": True}}
    return json.dumps(asked).encode()


async def _linger(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """After an error answer: half-close and swallow what the sender still sends (at most
    1 MiB for 1 s), as closing with unread data would reset the connection."""
    if writer.can_write_eof():
        writer.write_eof()
    with contextlib.suppress(Exception):
        async with asyncio.timeout(1.0):
            left = 1024 * 1024
            while left > 0 and (data := await reader.read(65536)):
                left -= len(data)
