"""Interactive PTY sessions: ``WS /sandboxes/{id}/exec/pty``.

Wire frames (JSON text, payloads base64): the client sends ``init`` first, then ``stdin``,
``signal``, ``resize`` and ``close``; the server answers ``ready`` (with the pid), ``stdout``
(stdout and stderr merged, as a terminal shows them), ``exit`` (negative code = killed by
that signal) or ``error``. The API key travels in the ``X-API-Key`` header, never in the URL.

Output is buffered up to ``max_buffer`` bytes; past that the session stops reading, so the
process blocks on its writes as it would on a full pipe. Read the output (``read``,
``read_all``) of a chatty process, or ``wait()`` may not see it exit.
"""

# ruff: noqa: ASYNC109 -- `timeout=` parameters are the public API (upstream SDK compatible)

from __future__ import annotations

import asyncio
import base64
import collections
import contextlib
import json
import threading
import time
from types import TracebackType
from typing import Any, Self

from websockets.asyncio.client import ClientConnection as AsyncConnection
from websockets.asyncio.client import connect as async_connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus
from websockets.sync.client import ClientConnection
from websockets.sync.client import connect as sync_connect

from orchard_env import __version__, errors, protocol
from orchard_env.sdk._base import seg
from orchard_env.sdk._handle import share_docs

OPEN_TIMEOUT = 10.0
CLOSE_GRACE = 2.0
"""Seconds close() waits for the exit status after asking the process to end."""
MAX_FRAME = 8 * 1024 * 1024
MAX_BUFFER = 16 * 1024 * 1024

_CLOSE_CODES: dict[int, type[errors.OrchardError]] = {
    4400: errors.InvalidRequest,
    4401: errors.AuthenticationRequired,
    4403: errors.PermissionDenied,
    4404: errors.SandboxNotFound,
    4409: errors.SandboxNotReady,
    4503: errors.AgentUnavailable,
}
_HTTP_STATUS: dict[int, type[errors.OrchardError]] = {
    401: errors.AuthenticationRequired,
    403: errors.PermissionDenied,
    404: errors.SandboxNotFound,
}


def ws_url(base_url: str, sandbox_id: str) -> str:
    scheme, rest = base_url.split("://", 1)
    return f"{'wss' if scheme == 'https' else 'ws'}://{rest}/sandboxes/{seg(sandbox_id)}/exec/pty"


def init_frame(
    cmd: str | list[str] | None,
    *,
    rows: int,
    cols: int,
    env: dict[str, str] | None,
    cwd: str | None,
    login_shell: bool,
) -> str:
    """The ``init`` frame; a string command runs through ``/bin/sh -c`` (like exec)."""
    values: dict[str, Any] = {
        "rows": rows,
        "cols": cols,
        "env": dict(env or {}),
        "cwd": cwd,
        "login_shell": login_shell,
    }
    if cmd is not None:
        values["cmd"] = ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)
    try:
        return protocol.PtyInit(**values).model_dump_json()
    except ValueError as exc:
        raise errors.InvalidRequest(f"bad PTY session request: {exc}") from None


def _stdin_frame(data: str | bytes) -> str:
    raw = data.encode() if isinstance(data, str) else data
    return json.dumps({"type": "stdin", "data": base64.b64encode(raw).decode("ascii")})


def _signal_frame(sig: str) -> str:
    name = sig.upper().removeprefix("SIG")
    if name not in protocol.PTY_SIGNALS:
        raise errors.InvalidRequest(
            f"signal {sig!r} cannot be sent to a PTY session",
            hint=f"use one of {', '.join(protocol.PTY_SIGNALS)}",
        )
    return json.dumps({"type": "signal", "sig": name})


def _resize_frame(rows: int, cols: int) -> str:
    if not (1 <= rows <= 1000 and 1 <= cols <= 1000):
        raise errors.InvalidRequest(f"terminal size {rows}x{cols} is out of range (1-1000)")
    return json.dumps({"type": "resize", "rows": rows, "cols": cols})


_CLOSE_FRAME = json.dumps({"type": "close"})


def _headers(api_key: str | None) -> dict[str, str]:
    return {"X-API-Key": api_key} if api_key else {}


def _open_error(exc: Exception, url: str) -> errors.OrchardError:
    if isinstance(exc, InvalidStatus):
        status = exc.response.status_code
        body = exc.response.body.decode(errors="replace") if exc.response.body else ""
        cls = _HTTP_STATUS.get(status, errors.OrchardError)
        return cls(f"PTY session refused with HTTP {status}: {body or 'no reason given'}")
    return errors.ServiceUnreachable(f"cannot open a PTY session at {url}: {exc}")


class _Session:
    """The protocol state both handles share: pid, exit code, the error that ended it."""

    def __init__(self) -> None:
        self.pid: int | None = None
        self.returncode: int | None = None
        self.error: errors.OrchardError | None = None
        self.error_message: str | None = None
        self.ready = False
        self.ended = False

    @property
    def finished(self) -> bool:
        """The process exited (all its output came before the exit frame) or the session is
        over: nothing more will be read."""
        return self.ended or self.returncode is not None

    def feed(self, message: str | bytes) -> bytes | None:
        """Apply one server frame; return its output, if it carried any."""
        frame = json.loads(message)
        kind = frame.get("type")
        if kind == "stdout":
            return base64.b64decode(frame.get("data", ""))
        if kind == "ready":
            self.pid = frame.get("pid")
            self.ready = True
        elif kind == "exit":
            self.returncode = int(frame["code"])
        elif kind == "error":
            self.error_message = str(frame.get("message", ""))
        return None

    def closed(self, exc: ConnectionClosed | None) -> None:
        """The connection is over: work out why, if the process did not simply exit."""
        self.ended = True
        if self.returncode is not None or self.error is not None:
            return
        close = exc.rcvd if exc is not None else None
        code = close.code if close is not None else None
        reason = (close.reason if close is not None else "") or "no reason given"
        if code in _CLOSE_CODES:
            self.error = _CLOSE_CODES[code](self.error_message or reason)
        elif self.error_message is not None:
            self.error = errors.OrchardError(f"PTY session error: {self.error_message}")
        elif code is not None and code >= 4000:
            self.error = errors.OrchardError(f"PTY session closed with code {code}: {reason}")

    def ended_error(self) -> errors.OrchardError:
        """What writing to an ended session raises."""
        if self.error is not None:
            return self.error
        return errors.Conflict(
            f"the PTY session has ended (exit code {self.returncode})",
            hint="start a new one with sandbox.pty()",
        )

    def bad_frame(self, exc: Exception) -> None:
        self.error = errors.OrchardError(f"the PTY session sent a malformed frame: {exc}")

    def exit_code(self) -> int:
        if self.returncode is not None:
            return self.returncode
        if self.error is not None:
            raise self.error
        raise errors.OrchardError("the PTY session closed without an exit status")


class _ProcessView:
    """The process state both PTY handles show, read from their session."""

    _session: _Session

    @property
    def pid(self) -> int | None:
        """The process id inside the sandbox."""
        return self._session.pid

    @property
    def returncode(self) -> int | None:
        """The exit code once the process has exited, else None."""
        return self._session.returncode

    def poll(self) -> int | None:
        """The exit code if the process has exited (or the session ended), else None."""
        if self._session.returncode is not None:
            return self._session.returncode
        return -1 if self._session.ended else None


class PtyProcess(_ProcessView):
    """A process on a pseudo-terminal in a sandbox (from :meth:`Sandbox.pty`).

    ``read`` returns output as it arrives; ``wait`` returns the exit code (negative: the
    signal that killed it). Methods may be called from any thread. Alias: ``ContainerProcess``.
    """

    def __init__(
        self,
        url: str,
        api_key: str | None,
        init: str,
        *,
        open_timeout: float = OPEN_TIMEOUT,
        max_buffer: int = MAX_BUFFER,
    ) -> None:
        try:
            self._ws: ClientConnection = sync_connect(
                url,
                additional_headers=_headers(api_key),
                user_agent_header=f"orchard-sdk/{__version__}",
                open_timeout=open_timeout,
                max_size=MAX_FRAME,
                legacy=True,  # a long-lived handle, closed by close(), not a with block
            )
        except (OSError, TimeoutError, InvalidHandshake) as exc:
            raise _open_error(exc, url) from exc
        self._session = _Session()
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._max_buffer = max_buffer
        self._cond = threading.Condition()
        self._send_lock = threading.Lock()
        with contextlib.suppress(ConnectionClosed):  # a refusal arrives as the close frame
            self._ws.send(init)
        self._reader = threading.Thread(target=self._read_loop, name="orchard-pty", daemon=True)
        self._reader.start()
        with self._cond:
            started = self._cond.wait_for(
                lambda: self._session.ready or self._session.finished, timeout=open_timeout
            )
        if not started or not self._session.ready:
            self.close()
            if self._session.error is not None:
                raise self._session.error
            raise errors.Timeout(f"the PTY session at {url} did not start within {open_timeout}s")

    def write_stdin(self, data: str | bytes) -> None:
        """Send keystrokes or bytes to the process's terminal."""
        self._send(_stdin_frame(data))

    def read(self, timeout: float | None = None) -> bytes:
        """The output buffered so far, waiting up to ``timeout`` for some.

        Returns ``b""`` when nothing arrived in time or the session is over and drained:
        ``poll()`` tells which.
        """
        with self._cond:
            self._cond.wait_for(lambda: self._chunks or self._session.finished, timeout=timeout)
            return self._take()

    def read_all(self, timeout: float | None = None) -> bytes:
        """All output until the process exits; raises a timeout error if it does not in time."""
        deadline = None if timeout is None else time.monotonic() + timeout
        parts: list[bytes] = []
        with self._cond:
            while True:
                parts.append(self._take())
                if self._session.finished:
                    return b"".join(parts)
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    self._chunks.appendleft(b"".join(parts))  # keep it for the next read
                    self._buffered += len(self._chunks[0])
                    raise errors.Timeout(f"PTY process {self.pid} did not exit within {timeout}s")
                self._cond.wait(remaining)

    def kill(self, sig: str = "KILL") -> None:
        """Signal the process group (TERM, INT, HUP, QUIT); KILL kills everything the process
        started, ``setsid`` descendants included. A no-op once it has exited."""
        self._send(_signal_frame(sig), quiet=True)

    def resize(self, rows: int, cols: int) -> None:
        """Tell the process its terminal is now ``rows`` x ``cols`` (SIGWINCH inside)."""
        self._send(_resize_frame(rows, cols), quiet=True)

    def wait(self, timeout: float | None = None) -> int:
        """Block until the process exits; return its exit code (negative = signal)."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._session.finished, timeout=timeout):
                raise errors.Timeout(f"PTY process {self.pid} did not exit within {timeout}s")
        return self._session.exit_code()

    def close(self) -> None:
        """End the session; a process still running gets SIGTERM. Idempotent.

        Waits briefly for the exit status, so ``returncode`` is set afterwards when the
        service reports it.
        """
        self._send(_CLOSE_FRAME, quiet=True)
        with self._cond:
            self._cond.wait_for(lambda: self._session.finished, timeout=CLOSE_GRACE)
        self._ws.close()
        if self._reader.is_alive() and self._reader is not threading.current_thread():
            self._reader.join(timeout=OPEN_TIMEOUT)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"PtyProcess(pid={self.pid}, returncode={self.returncode})"

    def _take(self) -> bytes:
        data = b"".join(self._chunks)
        self._chunks.clear()
        self._buffered = 0
        self._cond.notify_all()
        return data

    def _send(self, frame: str, *, quiet: bool = False) -> None:
        """Send a frame; once the session is over, raise (stdin) or do nothing (quiet)."""
        try:
            if not self._session.finished:
                with self._send_lock:
                    self._ws.send(frame)
                return
        except ConnectionClosed:
            pass
        if not quiet:
            raise self._session.ended_error()

    def _read_loop(self) -> None:
        closed: ConnectionClosed | None = None
        try:
            for message in self._ws:
                try:
                    data = self._session.feed(message)
                except (ValueError, KeyError, TypeError) as exc:
                    self._session.bad_frame(exc)
                    self._ws.close()
                    break
                with self._cond:
                    if data:
                        self._cond.wait_for(lambda: self._buffered < self._max_buffer)
                        self._chunks.append(data)
                        self._buffered += len(data)
                    self._cond.notify_all()
        except ConnectionClosed as exc:
            closed = exc
        finally:
            with self._cond:
                self._session.closed(closed)
                self._cond.notify_all()


class AsyncPtyProcess(_ProcessView):
    """The asyncio twin of :class:`PtyProcess` (alias ``AsyncContainerProcess``).

    Open with ``await AsyncPtyProcess.connect(...)`` (what :meth:`AsyncSandbox.pty` does).
    """

    def __init__(self, ws: AsyncConnection, *, max_buffer: int = MAX_BUFFER) -> None:
        self._ws = ws
        self._session = _Session()
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._max_buffer = max_buffer
        self._cond = asyncio.Condition()
        self._reader = asyncio.create_task(self._read_loop(), name="orchard-pty")

    @classmethod
    async def connect(
        cls,
        url: str,
        api_key: str | None,
        init: str,
        *,
        open_timeout: float = OPEN_TIMEOUT,
        max_buffer: int = MAX_BUFFER,
    ) -> AsyncPtyProcess:
        """Open the terminal's WebSocket at ``url`` and start the process ``init`` describes."""
        try:
            ws = await async_connect(
                url,
                additional_headers=_headers(api_key),
                user_agent_header=f"orchard-sdk/{__version__}",
                open_timeout=open_timeout,
                max_size=MAX_FRAME,
            )
        except (OSError, TimeoutError, InvalidHandshake) as exc:
            raise _open_error(exc, url) from exc
        with contextlib.suppress(ConnectionClosed):  # a refusal arrives as the close frame
            await ws.send(init)
        process = cls(ws, max_buffer=max_buffer)
        session = process._session
        try:
            async with asyncio.timeout(open_timeout), process._cond:
                await process._cond.wait_for(lambda: session.ready or session.finished)
        except TimeoutError:
            await process.close()
            raise errors.Timeout(
                f"the PTY session at {url} did not start within {open_timeout}s"
            ) from None
        if not session.ready:
            await process.close()
            raise session.error or errors.OrchardError("the PTY session closed before it started")
        return process

    async def write_stdin(self, data: str | bytes) -> None:
        await self._send(_stdin_frame(data))

    async def read(self, timeout: float | None = None) -> bytes:
        """Buffered output, waiting up to ``timeout`` for some; ``b""`` if none (see poll())."""
        async with self._cond:
            try:
                async with asyncio.timeout(timeout):
                    await self._cond.wait_for(lambda: bool(self._chunks) or self._session.finished)
            except TimeoutError:
                pass
            return self._take()

    async def read_all(self, timeout: float | None = None) -> bytes:
        parts: list[bytes] = []
        async with self._cond:
            try:
                async with asyncio.timeout(timeout):
                    while True:
                        parts.append(self._take())
                        if self._session.finished:
                            return b"".join(parts)
                        await self._cond.wait()
            except TimeoutError:
                self._chunks.appendleft(b"".join(parts))
                self._buffered += len(self._chunks[0])
                raise errors.Timeout(
                    f"PTY process {self.pid} did not exit within {timeout}s"
                ) from None

    async def kill(self, sig: str = "KILL") -> None:
        await self._send(_signal_frame(sig), quiet=True)

    async def resize(self, rows: int, cols: int) -> None:
        await self._send(_resize_frame(rows, cols), quiet=True)

    async def wait(self, timeout: float | None = None) -> int:
        try:
            async with asyncio.timeout(timeout), self._cond:
                await self._cond.wait_for(lambda: self._session.finished)
        except TimeoutError:
            raise errors.Timeout(f"PTY process {self.pid} did not exit within {timeout}s") from None
        return self._session.exit_code()

    async def close(self) -> None:
        """See :meth:`PtyProcess.close`."""
        await self._send(_CLOSE_FRAME, quiet=True)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(CLOSE_GRACE), self._cond:
                await self._cond.wait_for(lambda: self._session.finished)
        await self._ws.close()
        if asyncio.current_task() is not self._reader:
            await self._reader

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"AsyncPtyProcess(pid={self.pid}, returncode={self.returncode})"

    def _take(self) -> bytes:
        data = b"".join(self._chunks)
        self._chunks.clear()
        self._buffered = 0
        self._cond.notify_all()
        return data

    async def _send(self, frame: str, *, quiet: bool = False) -> None:
        try:
            if not self._session.finished:
                await self._ws.send(frame)
                return
        except ConnectionClosed:
            pass
        if not quiet:
            raise self._session.ended_error()

    async def _read_loop(self) -> None:
        closed: ConnectionClosed | None = None
        try:
            async for message in self._ws:
                try:
                    data = self._session.feed(message)
                except (ValueError, KeyError, TypeError) as exc:
                    self._session.bad_frame(exc)
                    await self._ws.close()
                    break
                async with self._cond:
                    if data:
                        await self._cond.wait_for(lambda: self._buffered < self._max_buffer)
                        self._chunks.append(data)
                        self._buffered += len(data)
                    self._cond.notify_all()
        except ConnectionClosed as exc:
            closed = exc
        finally:
            async with self._cond:
                self._session.closed(closed)
                self._cond.notify_all()


ContainerProcess = PtyProcess
"""Upstream Orchard Env's name for :class:`PtyProcess`."""
AsyncContainerProcess = AsyncPtyProcess
"""Upstream Orchard Env's name for :class:`AsyncPtyProcess`."""

share_docs(AsyncPtyProcess, PtyProcess)
