"""Async client for the in-sandbox agent, as the orchestrator uses it (one per sandbox).

It speaks the agent protocol described in :mod:`orchard_env.agent` over a unix socket
(``uds=``) or TCP (``base_url=``), reusing connections, and turns agent error bodies into the
:mod:`orchard_env.errors` class of their code.

Exec is idempotent by ``job_id``: the agent never runs a job id twice, so when a stream breaks
(the connection dropped, the agent was briefly unreachable) :meth:`AgentClient.exec` and
:meth:`AgentClient.attach` re-attach by themselves, skip the output already delivered and go
on; the caller sees one uninterrupted stream. Only if the agent stays unreachable (or lost its
memory of the job, e.g. it restarted) does the caller get
:class:`~orchard_env.errors.AgentUnavailable` (or :class:`~orchard_env.errors.JobNotFound`).
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal, NoReturn

import httpx
from websockets.asyncio.client import ClientConnection, connect, unix_connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus

from orchard_env import errors
from orchard_env.protocol import FileEntry

RESUME_DELAYS = (0.05, 0.2, 0.5, 1.0)  # between re-attach attempts of a broken job stream
PTY_MAX_MESSAGE = 4 * 1024 * 1024
_STREAMS: dict[str, Literal["stdout", "stderr"]] = {"o": "stdout", "e": "stderr"}


@dataclass(frozen=True, slots=True)
class Output:
    """A chunk of a command's output, in the order the agent read it."""

    stream: Literal["stdout", "stderr"]
    data: bytes


@dataclass(frozen=True, slots=True)
class Exit:
    """The end of a command. ``exit_code`` is None when a signal (``signal``) ended it.

    ``timed_out``: the agent killed it at its timeout (distinct from a command exiting 124);
    ``cancelled``: killed by :meth:`AgentClient.cancel`; ``truncated``: output went over
    ``max_output_bytes`` on a stream; ``dropped``: bytes (stdout, stderr) the agent cut out
    between a stream's head and its tail; ``error``: it could not be started (e.g. the binary
    does not exist, with exit code 127).
    """

    exit_code: int | None
    signal: int | None
    timed_out: bool
    cancelled: bool
    truncated: bool
    error: str | None
    duration: float
    dropped: tuple[int, int] = (0, 0)


AgentEvent = Output | Exit


def _dropped(value: Any) -> tuple[int, int]:
    """The exit event's ``dropped`` (absent from older agents): two non-negative counts."""
    if (
        isinstance(value, list)
        and len(value) == 2
        and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in value)
    ):
        return (value[0], value[1])
    return (0, 0)


class FileStream:
    """An open download (:meth:`AgentClient.open_file`): the file's size, then its bytes.

    Iterate it once; the connection is released when the iteration ends (or on
    :meth:`aclose`, for a download given up before it started).
    """

    def __init__(self, response: httpx.Response, client: AgentClient) -> None:
        self._response = response
        self._client = client
        length = response.headers.get("Content-Length")
        self.size: int | None = int(length) if length is not None else None
        """The file's size in bytes (the agent's Content-Length; None if it sent none)."""

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._response.aiter_raw():
                yield chunk
        except httpx.TransportError as exc:
            raise self._client._unavailable(exc) from exc
        finally:
            await self._response.aclose()

    async def aclose(self) -> None:
        await self._response.aclose()


class AgentPty:
    """A PTY session on the agent: upstream's JSON frames, sent and received as dicts."""

    def __init__(self, ws: ClientConnection) -> None:
        self._ws = ws

    async def __aenter__(self) -> AgentPty:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def send(self, message: dict[str, Any]) -> None:
        """Send one frame (``init`` first, then ``stdin``/``signal``/``resize``/``close``)."""
        try:
            await self._ws.send(json.dumps(message))
        except ConnectionClosed as exc:
            raise errors.AgentUnavailable(f"the agent closed the PTY session: {exc}") from None

    async def recv(self) -> dict[str, Any] | None:
        """The next frame (``ready``/``stdout``/``exit``/``error``); None once closed."""
        try:
            raw = await self._ws.recv()
        except ConnectionClosed:
            return None
        message = json.loads(raw)
        if not isinstance(message, dict):
            raise errors.OrchardError(f"the agent sent a PTY frame that is not an object: {raw!r}")
        return message

    @property
    def close_code(self) -> int | None:
        """The close code once the session closed (4400: bad init, 4500: spawn failed)."""
        return self._ws.close_code

    async def close(self) -> None:
        await self._ws.close()


class AgentClient:
    """Talks to one sandbox's agent. Give exactly one of ``uds`` (socket path) or ``base_url``."""

    def __init__(
        self,
        *,
        token: str,
        uds: str | None = None,
        base_url: str | None = None,
        timeout: float = 30.0,
    ) -> None:
        if (uds is None) == (base_url is None):
            raise errors.InvalidRequest("AgentClient needs exactly one of uds= or base_url=")
        if not token:
            raise errors.InvalidRequest("AgentClient needs the sandbox's agent token (token=)")
        self._token = token
        self._uds = uds
        self._base_url = (base_url or "http://agent").rstrip("/")
        self._where = uds if uds is not None else self._base_url
        self._timeout = timeout
        self._http = httpx.AsyncClient(
            transport=httpx.AsyncHTTPTransport(uds=uds, retries=1),
            base_url=self._base_url,
            headers={"Authorization": f"Bearer {token}"},
            timeout=httpx.Timeout(timeout),
            limits=httpx.Limits(max_keepalive_connections=32, keepalive_expiry=60.0),
        )

    async def __aenter__(self) -> AgentClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    # plumbing

    def _unavailable(self, exc: Exception) -> errors.AgentUnavailable:
        return errors.AgentUnavailable(f"agent at {self._where} is unreachable: {exc!r}")

    def _raise_error(self, status: int, body: bytes) -> NoReturn:
        try:
            payload = json.loads(body)
        except ValueError:
            payload = None
        if isinstance(payload, dict) and "code" in payload:
            cls = errors.error_class(str(payload["code"]))
            message = str(payload.get("message", ""))
        else:
            cls = errors.OrchardError
            message = f"agent answered HTTP {status}: {body[:200]!r}"
        if cls is errors.AuthenticationRequired:
            raise cls(message, hint="the orchestrator holds a different token for this sandbox")
        raise cls(message)

    async def _request(self, method: str, url: str, **kwargs: Any) -> Any:
        try:
            response = await self._http.request(method, url, **kwargs)
        except httpx.TransportError as exc:
            raise self._unavailable(exc) from exc
        if response.status_code != 200:
            self._raise_error(response.status_code, response.content)
        return response.json()

    # health

    async def health(self) -> dict[str, Any]:
        """The agent's ``{"status", "pid", "version"}``; AgentUnavailable when unreachable."""
        result: dict[str, Any] = await self._request("GET", "/health")
        return result

    async def wait_ready(self, timeout: float) -> None:  # noqa: ASYNC109 - a deadline
        """Poll :meth:`health` with a short backoff until it answers or ``timeout`` passes."""
        deadline = time.monotonic() + timeout
        delay = 0.01
        while True:
            try:
                await self._request("GET", "/health", timeout=max(0.1, min(2.0, timeout)))
                return
            except errors.AgentUnavailable as exc:
                if time.monotonic() + delay > deadline:
                    raise errors.AgentUnavailable(
                        f"agent at {self._where} did not answer within {timeout:g} s: {exc.message}"
                    ) from None
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.25)

    # exec

    def exec(
        self,
        job_id: str,
        command: str | list[str],
        *,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout: float | None = 300,
        login_shell: bool = False,
        stdin: bytes | None = None,
        max_output_bytes: int | None = None,
    ) -> AsyncGenerator[AgentEvent, None]:
        """Run ``command`` (a string: ``/bin/sh -c``; a list: argv) and stream its events.

        Yields :class:`Output` chunks while it runs and one final :class:`Exit`. Submitting a
        known ``job_id`` again attaches to that job (output replayed from the start) instead
        of running it again. ``timeout`` is enforced by the agent (None: no limit).
        ``aclose()`` on the stream drops the connection; the job keeps running (see
        :meth:`attach`, :meth:`cancel`).
        """
        payload: dict[str, Any] = {
            "job_id": job_id,
            "command": command,
            "cwd": cwd,
            "env": env or {},
            "timeout": timeout,
            "login_shell": login_shell,
            "max_output_bytes": max_output_bytes,
        }
        if stdin is not None:
            payload["stdin"] = base64.b64encode(stdin).decode()
        read_timeout = None if timeout is None else timeout + 30.0
        return self._job_stream("POST", "/exec", payload, read_timeout)

    def attach(self, job_id: str) -> AsyncGenerator[AgentEvent, None]:
        """Follow a job the agent knows: its output from the start, then live, then its exit."""
        return self._job_stream("GET", f"/exec/{job_id}", None, None)

    async def cancel(self, job_id: str) -> bool:
        """Kill a running job's process group; False if it had already finished."""
        result = await self._request("POST", f"/exec/{job_id}/cancel")
        return bool(result["cancelled"])

    async def _job_stream(
        self, method: str, url: str, payload: dict[str, Any] | None, read_timeout: float | None
    ) -> AsyncGenerator[AgentEvent, None]:
        delivered = {"stdout": 0, "stderr": 0}
        timeout = httpx.Timeout(self._timeout, read=read_timeout)
        for delay in (*RESUME_DELAYS, None):
            final: Exit | None = None
            try:
                async with self._http.stream(method, url, json=payload, timeout=timeout) as resp:
                    if resp.status_code != 200:
                        self._raise_error(resp.status_code, await resp.aread())
                    seen = {"stdout": 0, "stderr": 0}
                    # Read to the end of the response (the exit event is last): only a fully
                    # read response leaves its connection reusable for the next call.
                    async for line in resp.aiter_lines():
                        if not line:
                            continue
                        event = json.loads(line)
                        if event["t"] == "x":
                            final = Exit(
                                exit_code=event["exit_code"],
                                signal=event["signal"],
                                timed_out=event["timed_out"],
                                cancelled=event["cancelled"],
                                truncated=event["truncated"],
                                error=event["error"],
                                duration=event["duration"],
                                dropped=_dropped(event.get("dropped")),
                            )
                            continue
                        stream = _STREAMS[event["t"]]
                        data = base64.b64decode(event["d"])
                        # After a re-attach the agent replays from the start: skip what the
                        # caller already has.
                        skip = delivered[stream] - seen[stream]
                        seen[stream] += len(data)
                        if skip < len(data):
                            data = data[max(skip, 0) :]
                            delivered[stream] += len(data)
                            yield Output(stream, data)
                if final is None:
                    raise httpx.RemoteProtocolError("the job stream ended before its exit event")
            except httpx.TransportError as exc:
                if final is None:
                    if delay is None:
                        raise self._unavailable(exc) from exc
                    await asyncio.sleep(delay)
                    continue
            yield final
            return

    # files

    async def open_file(self, path: str) -> FileStream:
        """Start a download: its size is known before any byte is read (FileNotFound if
        missing, InvalidRequest for a directory, raised here rather than mid-stream)."""
        request = self._http.build_request("GET", "/files", params={"path": path})
        try:
            response = await self._http.send(request, stream=True)
            if response.status_code != 200:
                try:
                    body = await response.aread()
                finally:
                    await response.aclose()
                self._raise_error(response.status_code, body)
        except httpx.TransportError as exc:
            raise self._unavailable(exc) from exc
        return FileStream(response, self)

    async def read_file(self, path: str) -> AsyncIterator[bytes]:
        """Stream a file's bytes (see :meth:`open_file` for the size and the errors)."""
        stream = await self.open_file(path)
        try:
            async for chunk in stream:
                yield chunk
        finally:
            await stream.aclose()

    async def write_file(
        self, path: str, data: bytes | AsyncIterable[bytes], mode: int | None = None
    ) -> int:
        """Write a file atomically (parents created); returns the size written."""
        params = {"path": path}
        if mode is not None:
            params["mode"] = f"{mode:04o}"
        result = await self._request("PUT", "/files", params=params, content=data)
        return int(result["size"])

    async def list_dir(self, path: str) -> list[FileEntry]:
        """Entries of a directory, sorted by name; symlinks are reported, not followed."""
        result = await self._request("GET", "/files/list", params={"path": path})
        return [FileEntry.model_validate(entry) for entry in result]

    async def delete_path(self, path: str, recursive: bool = False) -> str:
        """Delete a file, symlink or (empty, unless ``recursive``) directory; returns its path."""
        params = {"path": path, "recursive": "true" if recursive else "false"}
        result = await self._request("DELETE", "/files", params=params)
        return str(result["deleted"])

    async def mkdir(self, path: str, parents: bool = True) -> str:
        """Create a directory (with its parents by default); returns its absolute path."""
        params = {"path": path, "parents": "true" if parents else "false"}
        result = await self._request("POST", "/files/mkdir", params=params)
        return str(result["path"])

    # PTY

    async def open_pty(self) -> AgentPty:
        """Open a PTY WebSocket; send the ``init`` frame next (within 10 s)."""
        options: dict[str, Any] = {
            "additional_headers": {"Authorization": f"Bearer {self._token}"},
            "compression": None,
            "open_timeout": self._timeout,
            "max_size": PTY_MAX_MESSAGE,
        }
        try:
            if self._uds is not None:
                ws = await unix_connect(self._uds, uri="ws://agent/pty", **options)
            else:
                ws = await connect("ws" + self._base_url.removeprefix("http") + "/pty", **options)
        except InvalidStatus as exc:
            self._raise_error(exc.response.status_code, bytes(exc.response.body or b""))
        except (OSError, InvalidHandshake, TimeoutError) as exc:
            raise self._unavailable(exc) from exc
        return AgentPty(ws)
