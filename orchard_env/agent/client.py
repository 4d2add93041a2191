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

The other end is under the sandbox's control, so every connection and read goes through
:mod:`orchard_env.agent.peer`: no symlink is followed, every reply is bounded, and whatever
the real agent never sends raises :class:`~orchard_env.errors.AgentTampered` (and is reported
to ``on_tampered``), never retried.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import time
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal, NoReturn
from urllib.parse import quote, urlencode, urlsplit

from websockets.asyncio.client import ClientConnection, connect, unix_connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus

from orchard_env import errors, http1
from orchard_env.agent import peer
from orchard_env.agent.daemon import proof
from orchard_env.protocol import FileEntry

RESUME_DELAYS = (0.05, 0.2, 0.5, 1.0)  # between re-attach attempts of a broken job stream
# Between health polls of a starting agent: 10 ms, doubling up to this. A poll of an agent
# not yet listening is a refused connect (microseconds); a longer gap is time a ready sandbox
# waits to be seen (up to 250 ms each before, in a fork of 8 the slowest one's).
READY_POLL_MAX = 0.05
PTY_MAX_MESSAGE = 1024 * 1024  # the agent's frames carry at most 64 KiB of output
PTY_MAX_QUEUE = 4  # frames read ahead of the relay
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
    ``cancelled``: killed by :meth:`AgentClient.cancel`; ``oom_killed``: the kernel's OOM killer
    ended it (the sandbox's memory limit); ``truncated``: output went over
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
    oom_killed: bool = False


AgentEvent = Output | Exit


def _target(path: str, params: dict[str, str]) -> str:
    return f"{path}?{urlencode(params, quote_via=quote)}"


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

    def __init__(self, response: http1.Response, client: AgentClient, size: int) -> None:
        self._response = response
        self._client = client
        self.size = size
        """The file's size in bytes (the agent's Content-Length: no more is read)."""

    async def __aiter__(self) -> AsyncIterator[bytes]:
        body = self._response.body(self._client._timeout)
        try:
            async for chunk in body:
                yield chunk
        except OSError as exc:
            raise self._client._unavailable(exc) from exc
        finally:
            await body.aclose()
            self._response.close()

    async def aclose(self) -> None:
        self._response.close()


class AgentPty:
    """A PTY session on the agent: upstream's JSON frames, sent and received as dicts."""

    def __init__(self, ws: ClientConnection, tampered: peer.Tampered) -> None:
        self._ws = ws
        self._tampered = tampered

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
        try:
            message = json.loads(raw)
        except ValueError:
            message = None
        if not isinstance(message, dict):
            raise self._tampered(f"the agent sent a PTY frame that is not an object: {raw[:200]!r}")
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
        env: dict[str, str] | None = None,
        model: dict[str, Any] | None = None,
        on_tampered: Callable[[errors.AgentTampered], None] | None = None,
    ) -> None:
        """``token`` is the sandbox's key (see :mod:`orchard_env.agent.proof`); ``env`` the
        sandbox's environment for its commands, handed to the agent with the key when it is
        enrolled (:meth:`wait_ready`). ``on_tampered`` hears of every
        :class:`~orchard_env.errors.AgentTampered` before it is raised (the orchestrator
        fails the sandbox). ``model``: the sandbox's model gateway relay, handed over at
        enrollment too (``{listen, socket, files}``, see :mod:`.daemon.model`)."""
        if (uds is None) == (base_url is None):
            raise errors.InvalidRequest("AgentClient needs exactly one of uds= or base_url=")
        if not token:
            raise errors.InvalidRequest("AgentClient needs the sandbox's agent token (token=)")
        self._token = token
        self._key = token.encode()
        self._env = dict(env or {})
        self._model = model
        self._uds = uds
        self._base_url = (base_url or "http://agent").rstrip("/")
        origin = urlsplit(self._base_url)
        self._host = origin.netloc
        self._address = (origin.hostname or "", origin.port or 80)
        self._where = uds if uds is not None else self._base_url
        self._timeout = timeout
        self._on_tampered = on_tampered
        self._http = self._connections(max_idle=32)

    def _connections(self, max_idle: int) -> http1.Connections:
        return http1.Connections(self._connect, max_idle=max_idle, idle_expiry=60.0)

    async def _connect(self) -> http1.Stream:
        host, port = self._address
        return await peer.connect(uds=self._uds, host=host, port=port, tampered=self._tampered)

    async def __aenter__(self) -> AgentClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.close()

    # plumbing

    def _unavailable(self, exc: Exception) -> errors.AgentUnavailable:
        return errors.AgentUnavailable(f"agent at {self._where} is unreachable: {exc!r}")

    def _tampered(self, message: str) -> errors.AgentTampered:
        error = peer.tampered_error(self._where, message)
        if self._on_tampered is not None:
            self._on_tampered(error)
        return error

    def _sign(self, method: str, target: str, body: str) -> tuple[str, list[tuple[str, str]]]:
        """(nonce, headers) authenticating one request to the agent."""
        return proof.sign(self._key, method, target, body)

    async def _send(
        self,
        method: str,
        target: str,
        content: bytes | AsyncIterable[bytes] = b"",
        *,
        http: http1.Connections | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 - the request's, for each phase
        read_timeout: float | None = None,
    ) -> tuple[http1.Response, str]:
        """Send a request carrying its MAC (over the body's digest unless it is streamed)
        and read its answer's head: (the answer, the request's nonce). ``timeout`` (the
        client's if None) bounds connecting and each write, ``read_timeout`` the wait for
        the head (None: no bound)."""
        if isinstance(content, bytes):
            body, length = proof.digest(content), len(content)
        else:
            body, length = proof.UNSIGNED_BODY, None
        nonce, headers = self._sign(method, target, body)
        head = http1.request_head(method, target, self._host, headers, length)
        response = await (http or self._http).request(
            method,
            head,
            content,
            timeout=self._timeout if timeout is None else timeout,
            read_timeout=read_timeout,
        )
        return response, nonce

    def _check_proof(self, response: http1.Response, nonce: str, body: str) -> None:
        """The answer came from the agent holding the sandbox's key, else tampering."""
        given = response.header(proof.PROOF_HEADER.lower()) or ""
        expected = proof.response_mac(self._key, nonce, response.status, body)
        if not proof.same(given, expected):
            raise self._tampered(
                "its answer carries no valid proof of the sandbox's key: "
                "something other than the sandbox's agent answered"
            )

    async def _fail(self, response: http1.Response, nonce: str) -> NoReturn:
        """Raise the error of a non-200 answer (proven, except a 401 for a wrong key)."""
        body = await self._read(response, peer.MAX_ERROR_BYTES, "an error", self._timeout)
        if response.status != 401:
            self._check_proof(response, nonce, proof.digest(body))
        self._raise_error(response.status, body)

    async def _read(
        self,
        response: http1.Response,
        limit: int,
        what: str,
        timeout: float,  # noqa: ASYNC109 - for each read
    ) -> bytes:
        """The answer's whole body (at most ``limit`` bytes); the connection is released."""
        try:
            return await peer.read_capped(response.body(timeout), limit, what, self._tampered)
        finally:
            response.close()

    def _bad_http(self, exc: http1.BadAnswer) -> errors.AgentTampered:
        return self._tampered(f"the agent's answer is not HTTP/1.1 as it speaks it: {exc}")

    @contextlib.contextmanager
    def _link(self) -> Iterator[None]:
        """An answer that breaks HTTP/1.1 is tampering; a connection that fails, breaks off
        or times out leaves the agent unavailable."""
        try:
            yield
        except http1.BadAnswer as exc:
            raise self._bad_http(exc) from None
        except OSError as exc:
            raise self._unavailable(exc) from exc

    def _json(self, body: bytes) -> Any:
        try:
            return json.loads(body)
        except ValueError:
            message = f"the agent sent a reply that is not JSON: {body[:200]!r}"
            raise self._tampered(message) from None

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

    async def _request(
        self,
        method: str,
        target: str,
        *,
        http: http1.Connections | None = None,
        content: bytes | AsyncIterable[bytes] = b"",
        timeout: float | None = None,  # noqa: ASYNC109 - the request's
    ) -> Any:
        """One signed request and its proven JSON answer."""
        timeout = self._timeout if timeout is None else timeout
        with self._link():
            response, nonce = await self._send(
                method, target, content, http=http, timeout=timeout, read_timeout=timeout
            )
            if response.status != 200:
                await self._fail(response, nonce)
            body = await self._read(response, peer.MAX_JSON_BYTES, "a JSON reply", timeout)
        self._check_proof(response, nonce, proof.digest(body))
        return self._json(body)

    async def _liveness(self, timeout: float) -> dict[str, Any]:  # noqa: ASYNC109
        """The agent's unauthenticated ``GET /health`` (it answers before it is enrolled)."""
        head = http1.request_head("GET", "/health", self._host, [], 0)
        with self._link():
            response = await self._http.request("GET", head, timeout=timeout, read_timeout=timeout)
            body = await self._read(response, peer.MAX_ERROR_BYTES, "a health answer", timeout)
        result = self._json(body)
        if response.status != 200 or not isinstance(result, dict):
            raise self._tampered(f"the agent's health answer is HTTP {response.status}")
        return result

    async def enroll(self) -> None:
        """Hand the agent the sandbox's key and environment, once, before anything runs.

        An agent enrolled already must hold this very key (an orchestrator that restarted
        enrolled it before); one enrolled with another key is tampering.
        """
        enrollment: dict[str, Any] = {"key": self._token, "env": self._env}
        if self._model is not None:
            enrollment["model"] = self._model
        content = json.dumps(enrollment).encode()
        try:
            await self._request("POST", "/enroll", content=content)
        except errors.Conflict:
            pass  # a proven 409: enrolled with this key already
        except errors.AuthenticationRequired:
            raise self._tampered("the agent was enrolled with another key") from None

    # health

    async def health(self) -> dict[str, Any]:
        """The agent's ``{"status", "pid", "version", "enrolled"}``, proven to come from the
        agent holding the key; AgentUnavailable when unreachable."""
        result: dict[str, Any] = await self._request("GET", "/health")
        return result

    async def probe(self, timeout: float) -> str | None:  # noqa: ASYNC109 - a deadline
        """Check the agent on a fresh connection (a pooled one outlives a removed socket).

        None when it answered, or merely not in time (a busy sandbox is not a dead one);
        else why nothing listens at its endpoint (the socket is gone, the connection is
        refused). Tampering raises :class:`~orchard_env.errors.AgentTampered`.
        """
        http = self._connections(max_idle=0)
        try:
            await self._request("GET", "/health", http=http, timeout=timeout)
        except errors.AgentUnavailable as exc:
            if isinstance(exc.__cause__, peer.ConnectFailed):
                return str(exc.__cause__) or "the connection was refused"
        finally:
            await http.close()
        return None

    async def wait_ready(self, timeout: float) -> None:  # noqa: ASYNC109 - a deadline
        """Poll the agent's health with a short backoff until it answers or ``timeout``
        passes; then enroll it (:meth:`enroll`) if it is not yet, and prove it holds the key."""
        deadline = time.monotonic() + timeout
        delay = 0.01
        while True:
            try:
                status = await self._liveness(max(0.1, min(2.0, timeout)))
                if not status.get("enrolled"):
                    await self.enroll()
                await self.health()
                return
            except errors.AgentUnavailable as exc:
                if time.monotonic() + delay > deadline:
                    raise errors.AgentUnavailable(
                        f"agent at {self._where} did not answer within {timeout:g} s: {exc.message}"
                    ) from None
            await asyncio.sleep(delay)
            delay = min(delay * 2, READY_POLL_MAX)

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
        return self._job_stream("POST", "/exec", payload, read_timeout, max_output_bytes)

    def attach(
        self, job_id: str, *, max_output_bytes: int | None = None
    ) -> AsyncGenerator[AgentEvent, None]:
        """Follow a job the agent knows: its output from the start, then live, then its exit
        (``max_output_bytes``: the cap it was started with, which bounds what is read)."""
        target = f"/exec/{quote(job_id, safe='')}"
        return self._job_stream("GET", target, None, None, max_output_bytes)

    async def cancel(self, job_id: str) -> bool:
        """Kill a running job's process group; False if it had already finished."""
        result = await self._request("POST", f"/exec/{quote(job_id, safe='')}/cancel")
        return bool(result["cancelled"])

    def _event(self, line: bytes, cap: int, seen: dict[str, int]) -> AgentEvent:
        """One line of a job stream as an event; anything the agent never sends is tampering
        (``seen``: output bytes so far per stream in this response, at most ``cap`` each)."""
        try:
            event = json.loads(line)
            if event["t"] == "x":
                return Exit(
                    exit_code=event["exit_code"],
                    signal=event["signal"],
                    timed_out=bool(event["timed_out"]),
                    cancelled=bool(event["cancelled"]),
                    truncated=bool(event["truncated"]),
                    error=event["error"],
                    duration=float(event["duration"]),
                    dropped=_dropped(event.get("dropped")),
                    oom_killed=event.get("oom_killed") is True,
                )
            stream = _STREAMS[event["t"]]
            data = base64.b64decode(event["d"], validate=True)
        except (ValueError, KeyError, TypeError):
            raise self._tampered(f"the agent sent a bad job event: {line[:200]!r}") from None
        seen[stream] += len(data)
        if seen[stream] > cap:
            raise self._tampered(f"the agent sent more {stream} than the job's cap of {cap} bytes")
        return Output(stream, data)

    async def _job_stream(
        self,
        method: str,
        target: str,
        payload: dict[str, Any] | None,
        read_timeout: float | None,
        max_output: int | None,
    ) -> AsyncGenerator[AgentEvent, None]:
        delivered = {"stdout": 0, "stderr": 0}
        cap = peer.AGENT_DEFAULT_MAX_OUTPUT if max_output is None else max_output
        content = b"" if payload is None else json.dumps(payload).encode()
        for delay in (*RESUME_DELAYS, None):
            final: Exit | None = None
            proven = False
            try:
                resp, nonce = await self._send(
                    method, target, content, timeout=self._timeout, read_timeout=read_timeout
                )
                try:
                    if resp.status != 200:
                        await self._fail(resp, nonce)
                    self._check_proof(resp, nonce, proof.STREAM)
                    seen = {"stdout": 0, "stderr": 0}
                    sent = hashlib.sha256()
                    body = resp.body(read_timeout)
                    lines = peer.capped_lines(body, peer.stream_bytes_limit(cap), self._tampered)
                    # Read to the end of the response (the proof is last): only a fully read
                    # response leaves its connection reusable for the next call.
                    async for line in lines:
                        if proven:
                            raise self._tampered("the agent sent events after its proof")
                        if final is not None:
                            proven = self._stream_proof(line, nonce, sent.hexdigest())
                            continue
                        sent.update(line + b"\n")
                        event = self._event(line, cap, seen)
                        if isinstance(event, Exit):
                            final = event
                            continue
                        # After a re-attach the agent replays from the start: skip what the
                        # caller already has.
                        skip = delivered[event.stream] - (seen[event.stream] - len(event.data))
                        if skip < len(event.data):
                            data = event.data[max(skip, 0) :]
                            delivered[event.stream] += len(data)
                            yield Output(event.stream, data)
                finally:
                    resp.close()
                if final is None:
                    raise http1.Closed("the job stream ended before its exit event")
                if not proven:
                    raise self._tampered("the job stream ended without the agent's proof")
            except http1.BadAnswer as exc:
                raise self._bad_http(exc) from None
            except OSError as exc:
                # Cut off before the proof (an exit event included): re-attach, which
                # replays the whole stream and its proof.
                if delay is None:
                    raise self._unavailable(exc) from exc
                await asyncio.sleep(delay)
                continue
            yield final
            return

    def _stream_proof(self, line: bytes, nonce: str, stream_digest: str) -> bool:
        """True for the valid proof line of a job stream, else tampering."""
        try:
            given = json.loads(line)
            valid = given["t"] == "p" and proof.same(
                str(given["mac"]), proof.stream_mac(self._key, nonce, stream_digest)
            )
        except (ValueError, KeyError, TypeError):
            valid = False
        if not valid:
            raise self._tampered(
                "the job stream's proof does not hold: "
                "something other than the sandbox's agent sent it or changed it"
            )
        return True

    # files

    async def open_file(self, path: str) -> FileStream:
        """Start a download: its size is known before any byte is read (FileNotFound if
        missing, InvalidRequest for a directory, raised here rather than mid-stream)."""
        with self._link():
            response, nonce = await self._send("GET", _target("/files", {"path": path}))
            if response.status != 200:
                await self._fail(response, nonce)
        try:
            self._check_proof(response, nonce, proof.RAW)
            if response.length is None or response.chunked:
                length = response.header("content-length") or ""
                raise self._tampered(f"the agent sent a file without a valid size ({length!r})")
        except errors.AgentTampered:
            response.close()
            raise
        return FileStream(response, self, response.length)

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
        result = await self._request("PUT", _target("/files", params), content=data)
        return int(result["size"])

    async def list_dir(self, path: str) -> list[FileEntry]:
        """Entries of a directory, sorted by name; symlinks are reported, not followed."""
        result = await self._request("GET", _target("/files/list", {"path": path}))
        return [FileEntry.model_validate(entry) for entry in result]

    async def delete_path(self, path: str, recursive: bool = False) -> str:
        """Delete a file, symlink or (empty, unless ``recursive``) directory; returns its path."""
        params = {"path": path, "recursive": "true" if recursive else "false"}
        result = await self._request("DELETE", _target("/files", params))
        return str(result["deleted"])

    async def mkdir(self, path: str, parents: bool = True) -> str:
        """Create a directory (with its parents by default); returns its absolute path."""
        params = {"path": path, "parents": "true" if parents else "false"}
        result = await self._request("POST", _target("/files/mkdir", params))
        return str(result["path"])

    # PTY

    async def open_pty(self) -> AgentPty:
        """Open a PTY WebSocket; send the ``init`` frame next (within 10 s)."""
        nonce, headers = self._sign("GET", "/pty", proof.digest(b""))
        options: dict[str, Any] = {
            "additional_headers": headers,
            "compression": None,
            "open_timeout": self._timeout,
            "max_size": PTY_MAX_MESSAGE,
            "max_queue": PTY_MAX_QUEUE,
        }
        try:
            if self._uds is not None:
                with peer.socket_path(self._uds, self._tampered) as path:
                    ws = await unix_connect(path, uri="ws://agent/pty", **options)
            else:
                ws = await connect("ws" + self._base_url.removeprefix("http") + "/pty", **options)
        except InvalidStatus as exc:
            self._raise_error(exc.response.status_code, bytes(exc.response.body or b""))
        except (OSError, InvalidHandshake, TimeoutError) as exc:
            raise self._unavailable(exc) from exc
        given = ws.response.headers.get(proof.PROOF_HEADER, "") if ws.response else ""
        if not proof.same(given, proof.response_mac(self._key, nonce, 101, proof.UPGRADE)):
            await ws.close()
            raise self._tampered(
                "its PTY handshake carries no valid proof of the sandbox's key: "
                "something other than the sandbox's agent answered"
            )
        return AgentPty(ws, self._tampered)
