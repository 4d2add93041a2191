"""Orchard's in-sandbox agent: a small HTTP/1.1 + WebSocket server, Python standard library only.

It runs under the relocatable bundle interpreter inside any image (see ``orchard_env.agent``
for the wire protocol), so it must import nothing outside the standard library, start fast
and stay small (idle RSS target: 20 MB).

    python -I server.py --listen unix:/run/orchard/agent.sock
    python -I server.py --listen tcp:0.0.0.0:9090

The bearer token comes from ``ORCHARD_AGENT_TOKEN`` (``--no-auth`` disables auth, for tests).
``ORCHARD_AGENT_WORKDIR`` (default ``/workspace``) is where relative paths and commands start.
"""

# The agent works with os-level calls on purpose (no pathlib: fewer imports, smaller idle RSS),
# and its quick local filesystem syscalls run on the event loop by design.
# ruff: noqa: PTH101, PTH102, PTH103, PTH105, PTH106, PTH108, PTH110, PTH112, PTH116
# ruff: noqa: PTH118, PTH120, PTH208, ASYNC240
# As PID 1 the agent forks before its heavy imports (become_init_reaper), hence E402.
# ruff: noqa: E402

from __future__ import annotations

import os
import signal
import sys


def become_init_reaper() -> None:
    """As PID 1, fork before anything heavy is imported and stay behind as a tiny init.

    The parent reaps every zombie (orphans of the commands are re-parented to it) and
    forwards TERM/INT to the child, then exits with the child's status. Forking here, with
    only ``os``, ``signal`` and ``sys`` loaded, keeps the parent's private memory to the bare
    interpreter's; the child goes on to import the rest and serve.
    """
    pid = os.fork()
    if pid == 0:
        return

    def forward(signum: int, _frame: object) -> None:
        try:  # noqa: SIM105 - contextlib is not imported yet, on purpose
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    while True:
        try:
            reaped, status = os.wait()
        except ChildProcessError:
            os._exit(1)
        if reaped == pid:
            code = os.waitstatus_to_exitcode(status)
            os._exit(code if code >= 0 else 128 - code)


if __name__ == "__main__" and os.getpid() == 1:
    become_init_reaper()

import argparse
import asyncio
import base64
import contextlib
import errno
import fcntl
import hmac
import json
import stat
import struct
import subprocess
import termios
import time
from collections.abc import AsyncIterator, Callable
from typing import Any
from urllib.parse import parse_qsl, unquote

AGENT_VERSION = "0.1.0"
DEFAULT_WORKDIR = "/workspace"
DEFAULT_MAX_OUTPUT = 10 * 1024 * 1024  # per stream, when the request names no cap
READ_CHUNK = 64 * 1024
FILE_CHUNK = 256 * 1024
MAX_HEADER_BYTES = 64 * 1024
MAX_JSON_BODY = 64 * 1024 * 1024
EXIT_DRAIN_GRACE = 1.0  # seconds to wait for pipe EOF after the command itself exited
JOB_KEEP_SECONDS = 3600.0
JOB_KEEP_COUNT = 1000
JOB_BUFFER_BUDGET = 256 * 1024 * 1024  # output kept for finished jobs, all together
PTY_INIT_TIMEOUT = 10.0
PTY_CHUNK = 64 * 1024
PTY_CLOSE_GRACE = 5.0  # after a "close" frame: SIGTERM, then SIGKILL this much later
WS_MAX_MESSAGE = 16 * 1024 * 1024
WS_GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
# Variables that belong to the agent and its launcher, never to the commands it runs.
OWN_ENV_PREFIX = "ORCHARD_AGENT_"
LAUNCHER_ENV = ("PYTHONHOME", "PYTHONPATH", "PYTHONNOUSERSITE", "LD_LIBRARY_PATH")
OOM_SCORE_BOOST = 500  # commands are this much likelier OOM victims than the agent itself
PTY_SIGNALS = {
    "TERM": signal.SIGTERM,
    "KILL": signal.SIGKILL,
    "INT": signal.SIGINT,
    "HUP": signal.SIGHUP,
    "QUIT": signal.SIGQUIT,
}
REASONS = {
    101: "Switching Protocols",
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    404: "Not Found",
    405: "Method Not Allowed",
    409: "Conflict",
    413: "Payload Too Large",
    500: "Internal Server Error",
}


def log(message: str) -> None:
    sys.stderr.write(f"orchard-agent[{os.getpid()}]: {message}\n")
    sys.stderr.flush()


class HTTPError(Exception):
    """An error answered as ``{"code", "message"}`` JSON with ``status``."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message


def invalid(message: str) -> HTTPError:
    return HTTPError(400, "invalid_request", message)


def file_not_found(path: str) -> HTTPError:
    return HTTPError(404, "file_not_found", f"{path} does not exist")


def os_error(exc: OSError, path: str, action: str) -> HTTPError:
    """Map a filesystem error to the agent's error codes with a message naming the path."""
    if isinstance(exc, FileNotFoundError):
        return file_not_found(path)
    if isinstance(exc, PermissionError):
        return invalid(f"permission denied {action} {path}")
    if isinstance(exc, NotADirectoryError):
        return invalid(f"{action} {path} failed: a parent is not a directory")
    return invalid(f"{action} {path} failed: {exc.strerror or exc}")


def iso_utc(ns: int) -> str:
    seconds, rest = divmod(ns, 1_000_000_000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{rest // 1000:06d}Z"


def exit_fields(returncode: int) -> tuple[int | None, int | None]:
    """(exit_code, signal) from a Popen return code (negative = killed by that signal)."""
    return (returncode, None) if returncode >= 0 else (None, -returncode)


async def wait_fd(
    fd: int, *, writable: bool = False, also: asyncio.Future[Any] | None = None
) -> None:
    """Wait until ``fd`` is readable (or writable), or until ``also`` is done."""
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    if writable:
        loop.add_writer(fd, wake)
    else:
        loop.add_reader(fd, wake)
    try:
        if also is None:
            await ready
        else:
            await asyncio.wait((ready, also), return_when=asyncio.FIRST_COMPLETED)
    finally:
        if writable:
            loop.remove_writer(fd)
        else:
            loop.remove_reader(fd)
        ready.cancel()


async def write_fd(fd: int, data: bytes) -> None:
    """Write all of ``data`` to a non-blocking fd without blocking the loop."""
    view = memoryview(data)
    while view:
        try:
            written = os.write(fd, view)
        except BlockingIOError:
            await wait_fd(fd, writable=True)
            continue
        view = view[written:]


# --- HTTP ---------------------------------------------------------------------------------


class Request:
    """One parsed HTTP/1.1 request on a connection, with its body still on the wire."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        method: str,
        target: str,
        version: str,
        headers: dict[str, str],
    ) -> None:
        self.reader = reader
        self.writer = writer
        self.method = method
        self.version = version
        self.headers = headers
        raw_path, _, query = target.partition("?")
        self.path = unquote(raw_path)
        self.query = dict(parse_qsl(query, keep_blank_values=True))
        connection = headers.get("connection", "").lower()
        self.keep_alive = version == "HTTP/1.1" and "close" not in connection
        self.started = False  # response head sent
        self.chunked_body = "chunked" in headers.get("transfer-encoding", "").lower()
        length = headers.get("content-length")
        if self.chunked_body:
            self.remaining: int | None = None
        else:
            try:
                self.remaining = int(length) if length else 0
            except ValueError:
                raise invalid(f"bad Content-Length {length!r}") from None
            if self.remaining < 0:
                raise invalid(f"bad Content-Length {length!r}")
        self.body_done = not self.chunked_body and self.remaining == 0

    # request body

    async def body(self) -> AsyncIterator[bytes]:
        """The request body, streamed (Content-Length or chunked)."""
        if self.body_done:
            return
        if "100-continue" in self.headers.get("expect", "").lower() and not self.started:
            self.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        if self.chunked_body:
            async for chunk in self._chunked():
                yield chunk
        else:
            while self.remaining:
                chunk = await self.reader.read(min(self.remaining, FILE_CHUNK))
                if not chunk:
                    raise ConnectionResetError("client closed the connection mid-body")
                self.remaining -= len(chunk)
                yield chunk
        self.body_done = True

    async def _chunked(self) -> AsyncIterator[bytes]:
        while True:
            line = await self.reader.readuntil(b"\r\n")
            try:
                size = int(line.split(b";", 1)[0].strip(), 16)
            except ValueError:
                raise invalid("bad chunk size in the request body") from None
            if size == 0:
                while await self.reader.readuntil(b"\r\n") != b"\r\n":
                    pass  # trailers are ignored
                return
            while size:
                chunk = await self.reader.read(min(size, FILE_CHUNK))
                if not chunk:
                    raise ConnectionResetError("client closed the connection mid-body")
                size -= len(chunk)
                yield chunk
            if await self.reader.readexactly(2) != b"\r\n":
                raise invalid("bad chunk terminator in the request body")

    async def read_body(self, limit: int) -> bytes:
        parts: list[bytes] = []
        total = 0
        async for chunk in self.body():
            total += len(chunk)
            if total > limit:
                self.keep_alive = False
                raise HTTPError(413, "invalid_request", f"request body is over {limit} bytes")
            parts.append(chunk)
        return b"".join(parts)

    async def json(self) -> dict[str, Any]:
        raw = await self.read_body(MAX_JSON_BODY)
        try:
            value = json.loads(raw or b"{}")
        except ValueError as exc:
            raise invalid(f"request body is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise invalid("request body must be a JSON object")
        return value

    async def discard_body(self) -> None:
        async for _ in self.body():
            pass

    # query parameters

    def arg(self, name: str) -> str:
        value = self.query.get(name)
        if not value:
            raise invalid(f"query parameter {name!r} is required")
        return value

    def flag(self, name: str, default: bool) -> bool:
        value = self.query.get(name)
        if value is None or value == "":
            return default
        lowered = value.lower()
        if lowered in ("1", "true", "yes"):
            return True
        if lowered in ("0", "false", "no"):
            return False
        raise invalid(f"query parameter {name!r} must be true or false, not {value!r}")

    # response

    def head(self, status: int, headers: list[tuple[str, str]]) -> bytes:
        self.started = True
        lines = [f"HTTP/1.1 {status} {REASONS.get(status, 'Unknown')}"]
        lines.extend(f"{name}: {value}" for name, value in headers)
        if status != 101:
            lines.append("Connection: " + ("keep-alive" if self.keep_alive else "close"))
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")

    async def send_json(self, status: int, payload: Any) -> None:
        body = json.dumps(payload, separators=(",", ":")).encode()
        head = self.head(
            status, [("Content-Type", "application/json"), ("Content-Length", str(len(body)))]
        )
        self.writer.write(head + body)
        await self.writer.drain()

    def start_chunked(self, content_type: str) -> None:
        self.writer.write(
            self.head(200, [("Content-Type", content_type), ("Transfer-Encoding", "chunked")])
        )

    def write_chunk(self, data: bytes) -> None:
        if data:
            self.writer.writelines((b"%x\r\n" % len(data), data, b"\r\n"))

    def end_chunked(self) -> None:
        self.writer.write(b"0\r\n\r\n")


async def read_request(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> Request | None:
    """Parse the next request head; None when the client closed the connection cleanly."""
    try:
        raw = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as exc:
        if exc.partial.strip():
            raise invalid("incomplete request head") from None
        return None
    except asyncio.LimitOverrunError:
        raise invalid(f"request head is over {MAX_HEADER_BYTES} bytes") from None
    lines = raw.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise invalid(f"bad request line {lines[0][:200]!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep:
            raise invalid(f"bad header line {line[:200]!r}")
        key = name.strip().lower()
        value = value.strip()
        headers[key] = f"{headers[key]}, {value}" if key in headers else value
    return Request(reader, writer, parts[0], parts[1], parts[2], headers)


# --- jobs ---------------------------------------------------------------------------------


class Job:
    """One command run, kept by job_id so a repeated submission attaches instead of rerunning.

    Output is kept as encoded NDJSON lines (the stream every attacher replays from the start),
    capped per stream at ``max_output`` bytes; the final ``x`` line ends it.
    """

    def __init__(self, agent: Agent, job_id: str, fingerprint: str, max_output: int) -> None:
        self.agent = agent
        self.job_id = job_id
        self.fingerprint = fingerprint
        self.max_output = max_output
        self.events: list[bytes] = []
        self.buffered = 0
        self.sizes = [0, 0]
        self.truncated = False
        self.timed_out = False
        self.cancelled = False
        self.done = False
        self.finished_at = 0.0
        self.pgid: int | None = None
        self._changed: asyncio.Event | None = None
        self._fds: list[int | None] = [None, None]
        self._streams_closed: asyncio.Future[None] | None = None

    # event buffer

    def _append(self, line: bytes) -> None:
        self.events.append(line)
        self.buffered += len(line)
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    async def changed(self) -> None:
        if self._changed is None:
            self._changed = asyncio.Event()
        await self._changed.wait()

    def drop_output(self) -> int:
        """Free a finished job's output, keeping its final event (marked truncated)."""
        final = json.loads(self.events[-1])
        final["truncated"] = True
        line = json.dumps(final, separators=(",", ":")).encode() + b"\n"
        freed = self.buffered - len(line)
        self.events = [line]
        self.buffered = len(line)
        return freed

    def _emit(self, index: int, data: bytes) -> None:
        room = self.max_output - self.sizes[index]
        if len(data) > room:
            self.truncated = True
            data = data[: max(room, 0)]
        if data:
            self.sizes[index] += len(data)
            kind = b"o" if index == 0 else b"e"
            self._append(b'{"t":"%s","d":"%s"}\n' % (kind, base64.b64encode(data)))

    def _finish(
        self,
        started: float,
        *,
        exit_code: int | None = None,
        sig: int | None = None,
        error: str | None = None,
    ) -> None:
        final = {
            "t": "x",
            "exit_code": exit_code,
            "signal": sig,
            "timed_out": self.timed_out,
            "cancelled": self.cancelled,
            "truncated": self.truncated,
            "error": error,
            "duration": round(time.monotonic() - started, 6),
        }
        self._append(json.dumps(final, separators=(",", ":")).encode() + b"\n")
        self.done = True
        self.finished_at = time.monotonic()
        self.pgid = None
        self.agent.job_finished()

    # running

    def start(
        self,
        argv: list[str],
        cwd: str,
        env: dict[str, str],
        timeout: float | None,
        stdin: bytes | None,
    ) -> None:
        """Spawn the command in its own session; output is collected by the event loop."""
        started = time.monotonic()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        in_r, in_w = os.pipe() if stdin is not None else (None, None)
        try:
            proc = subprocess.Popen(
                argv,
                cwd=cwd,
                env=env,
                stdin=in_r if in_r is not None else subprocess.DEVNULL,
                stdout=out_w,
                stderr=err_w,
                start_new_session=True,
            )
        except OSError as exc:
            for fd in (out_r, err_r, in_w):
                if fd is not None:
                    os.close(fd)
            self._finish(started, **spawn_failure(exc, argv[0], cwd))
            return
        finally:
            for fd in (out_w, err_w, in_r):
                if fd is not None:
                    os.close(fd)
        self.pgid = proc.pid
        self.agent.expose_to_oom_killer(proc.pid)
        loop = asyncio.get_running_loop()
        self._streams_closed = loop.create_future()
        self._fds = [out_r, err_r]
        for index, fd in enumerate((out_r, err_r)):
            os.set_blocking(fd, False)
            loop.add_reader(fd, self._on_output, index)
        exited = self.agent.watch_child(proc)
        feeder = None
        if in_w is not None and stdin is not None:
            os.set_blocking(in_w, False)
            feeder = loop.create_task(feed_stdin(in_w, stdin))
        self.agent.track(loop.create_task(self._wait(exited, started, timeout, feeder)))

    def _on_output(self, index: int) -> None:
        fd = self._fds[index]
        if fd is None:
            return
        try:
            data = os.read(fd, READ_CHUNK)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data:
            self._emit(index, data)
        else:
            self._close_stream(index)

    def _close_stream(self, index: int) -> None:
        fd = self._fds[index]
        if fd is None:
            return
        self._fds[index] = None
        asyncio.get_running_loop().remove_reader(fd)
        os.close(fd)
        if self._fds == [None, None] and self._streams_closed and not self._streams_closed.done():
            self._streams_closed.set_result(None)

    async def _wait(
        self,
        exited: asyncio.Future[int],
        started: float,
        time_limit: float | None,
        feeder: asyncio.Task[None] | None,
    ) -> None:
        loop = asyncio.get_running_loop()
        timer = loop.call_later(time_limit, self.kill, "timeout") if time_limit else None
        try:
            returncode = await exited
            assert self._streams_closed is not None
            if not self._streams_closed.done():
                # A background child may still hold the pipes: give it a moment, then stop
                # reading (the command itself is done; its leftovers keep running).
                try:
                    await asyncio.wait_for(asyncio.shield(self._streams_closed), EXIT_DRAIN_GRACE)
                except TimeoutError:
                    self._drain_and_close()
        finally:
            if timer is not None:
                timer.cancel()
            if feeder is not None:
                feeder.cancel()
        exit_code, sig = exit_fields(returncode)
        self._finish(started, exit_code=exit_code, sig=sig)

    def _drain_and_close(self) -> None:
        for index, fd in enumerate(self._fds):
            while fd is not None:
                try:
                    data = os.read(fd, READ_CHUNK)
                except OSError:
                    break
                if not data:
                    break
                self._emit(index, data)
            self._close_stream(index)

    def kill(self, reason: str) -> bool:
        """SIGKILL the command's process group (timeout or cancel); False when already done."""
        if self.done or self.pgid is None:
            return False
        if reason == "timeout":
            self.timed_out = True
        else:
            self.cancelled = True
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pgid, signal.SIGKILL)
        return True


def spawn_failure(exc: OSError, program: str, cwd: str) -> dict[str, Any]:
    """Final-event fields for a command that could not be started (shell-like exit codes)."""
    if isinstance(exc, FileNotFoundError) and exc.filename == cwd:
        return {"exit_code": None, "error": f"cwd {cwd} does not exist"}
    if isinstance(exc, FileNotFoundError):
        return {"exit_code": 127, "error": f"command not found: {program}"}
    if isinstance(exc, PermissionError):
        return {"exit_code": 126, "error": f"permission denied: {program}"}
    return {"exit_code": 126, "error": f"cannot run {program}: {exc.strerror or exc}"}


async def feed_stdin(fd: int, data: bytes) -> None:
    try:
        await write_fd(fd, data)
    except OSError:
        pass  # the command closed its stdin early
    finally:
        os.close(fd)


def build_argv(command: str | list[str], login_shell: bool) -> list[str]:
    """A string runs through bash (``/bin/sh`` where the image has no bash), as upstream's
    agent did, so ``source`` and ``[[`` work; a list is an argv; a login shell wraps either."""
    shell = "/bin/bash" if os.path.exists("/bin/bash") else "/bin/sh"
    if login_shell:
        if isinstance(command, str):
            return [shell, "-l", "-c", command]
        return [shell, "-l", "-c", 'exec "$@"', shell, *command]
    if isinstance(command, str):
        return [shell, "-c", command]
    return list(command)


def command_env(environ: dict[str, str], prefix: str) -> dict[str, str]:
    """The agent's environment as commands get it: without the agent's and its launcher's own.

    ``ORCHARD_AGENT_*`` always goes; ``PYTHONHOME``/``PYTHONPATH``/``LD_LIBRARY_PATH`` go only
    when they point into the agent's own interpreter (``prefix``), so an image's own values
    are kept.
    """

    def launcher_value(value: str) -> bool:
        if prefix in ("", "/", "/usr", "/usr/local"):
            return False
        return any(p == prefix or p.startswith(prefix + "/") for p in value.split(os.pathsep))

    return {
        key: value
        for key, value in environ.items()
        if not key.startswith(OWN_ENV_PREFIX)
        and not (key in LAUNCHER_ENV and launcher_value(value))
    }


def initial_environ() -> dict[str, str]:
    """The environment this process was started with, as the kernel recorded it.

    ``os.environ`` may differ already: the interpreter sets ``LC_CTYPE`` itself when it
    coerces the C locale (PEP 538), and that must not reach the commands.
    """
    try:
        with open("/proc/self/environ", "rb") as source:
            raw = source.read()
    except OSError:
        return dict(os.environ)
    environ = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep and key:
            environ[os.fsdecode(key)] = os.fsdecode(value)
    return environ


def read_oom_score_adj() -> int:
    try:
        with open("/proc/self/oom_score_adj") as source:
            return int(source.read())
    except (OSError, ValueError):
        return 0


def string_map(value: Any, field: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise invalid(f"{field} must be an object of strings")
    return value


def decode_b64(value: Any, field: str) -> bytes:
    if not isinstance(value, str):
        raise invalid(f"{field} must be a base64 string")
    try:
        return base64.b64decode(value, validate=True)
    except ValueError:
        raise invalid(f"{field} is not valid base64") from None


class Agent:
    """Routes, jobs and PTY sessions of one agent process."""

    def __init__(self, token: str | None, workdir: str) -> None:
        self.token = token.encode() if token else None
        self.workdir = workdir
        self.base_env = command_env(initial_environ(), sys.prefix)
        self.umask = os.umask(0o022)
        os.umask(self.umask)
        self.jobs: dict[str, Job] = {}
        self.children: dict[int, tuple[subprocess.Popen[bytes], asyncio.Future[int]]] = {}
        self.tasks: set[asyncio.Task[None]] = set()
        self.pty_groups: set[int] = set()
        self.child_oom_score_adj = min(1000, read_oom_score_adj() + OOM_SCORE_BOOST)

    def expose_to_oom_killer(self, pid: int) -> None:
        """Make a command a likelier OOM victim than the agent (raising needs no privilege):
        when a sandbox runs out of memory, the command is killed and the agent survives."""
        with contextlib.suppress(OSError), open(f"/proc/{pid}/oom_score_adj", "w") as target:
            target.write(str(self.child_oom_score_adj))

    # processes

    def watch_child(self, proc: subprocess.Popen[bytes]) -> asyncio.Future[int]:
        """A future for the child's return code, resolved from SIGCHLD (see :meth:`reap`)."""
        exited: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.children[proc.pid] = (proc, exited)
        return exited

    def reap(self) -> None:
        for pid, (proc, exited) in list(self.children.items()):
            returncode = proc.poll()
            if returncode is not None:
                del self.children[pid]
                if not exited.done():
                    exited.set_result(returncode)

    def track(self, task: asyncio.Task[None]) -> None:
        self.tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log(f"background task failed: {task.exception()!r}")

    def shutdown(self) -> None:
        """Kill every running command and PTY session (the agent is stopping)."""
        for job in self.jobs.values():
            job.kill("cancel")
        for pgid in self.pty_groups:
            signal_group(pgid, signal.SIGKILL)

    # jobs

    def job_finished(self) -> None:
        """Keep finished jobs bounded by age, count and buffered bytes (oldest go first)."""
        now = time.monotonic()
        finished = [job for job in self.jobs.values() if job.done]
        excess = len(finished) - JOB_KEEP_COUNT
        kept = []
        for job in finished:
            if excess > 0 or now - job.finished_at > JOB_KEEP_SECONDS:
                del self.jobs[job.job_id]
                excess -= 1
            else:
                kept.append(job)
        total = sum(job.buffered for job in kept)
        for job in kept:
            if total <= JOB_BUFFER_BUDGET:
                break
            if len(job.events) > 1:
                total -= job.drop_output()

    # HTTP

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    req = await read_request(reader, writer)
                except HTTPError as exc:
                    body = json.dumps({"code": exc.code, "message": exc.message}).encode()
                    writer.write(
                        f"HTTP/1.1 {exc.status} {REASONS.get(exc.status, 'Error')}\r\n"
                        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                        "Connection: close\r\n\r\n".encode()
                        + body
                    )
                    await writer.drain()
                    break
                if req is None:
                    break
                await self.respond(req)
                if not req.keep_alive:
                    break
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def respond(self, req: Request) -> None:
        try:
            await self.route(req)
            if not req.body_done:
                await req.discard_body()
        except HTTPError as exc:
            if req.started:
                req.keep_alive = False
                return
            if not req.body_done and exc.status != 413:
                await req.discard_body()
            await req.send_json(exc.status, {"code": exc.code, "message": exc.message})
        except (ConnectionError, asyncio.IncompleteReadError):
            raise
        except Exception as exc:
            import traceback  # only on the rare failure path

            log(f"{req.method} {req.path} failed:\n{traceback.format_exc()}")
            req.keep_alive = False
            if not req.started:
                await req.send_json(500, {"code": "internal", "message": f"agent error: {exc!r}"})

    async def route(self, req: Request) -> None:
        method, path = req.method, req.path
        if path == "/health" and method == "GET":
            await req.send_json(200, {"status": "ok", "pid": os.getpid(), "version": AGENT_VERSION})
            return
        self.check_auth(req)
        routes: dict[tuple[str, str], Callable[[Request], Any]] = {
            ("POST", "/exec"): self.exec,
            ("GET", "/files"): self.read_file,
            ("PUT", "/files"): self.write_file,
            ("DELETE", "/files"): self.delete_path,
            ("GET", "/files/list"): self.list_dir,
            ("POST", "/files/mkdir"): self.mkdir,
            ("GET", "/pty"): self.pty,
        }
        handler = routes.get((method, path))
        if handler is not None:
            await handler(req)
            return
        if path.startswith("/exec/"):
            job_id, _, action = path[len("/exec/") :].partition("/")
            if action == "" and method == "GET":
                await self.stream_job(req, self.job(job_id))
                return
            if action == "cancel" and method == "POST":
                cancelled = self.job(job_id).kill("cancel")
                await req.send_json(200, {"job_id": job_id, "cancelled": cancelled})
                return
        elif path in {p for _, p in routes}:
            raise HTTPError(405, "invalid_request", f"{method} is not allowed on {path}")
        raise HTTPError(404, "not_found", f"no route {method} {path}")

    def check_auth(self, req: Request) -> None:
        if self.token is None:
            return
        header = req.headers.get("authorization", "")
        if not header:
            raise HTTPError(
                401, "unauthenticated", "missing 'Authorization: Bearer <token>' header"
            )
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            given.strip().encode(), self.token
        ):
            raise HTTPError(401, "unauthenticated", "invalid agent token")

    def resolve(self, raw: str) -> str:
        if "\0" in raw:
            raise invalid("path contains a NUL byte")
        # normpath keeps a leading "//" (POSIX leaves its meaning open); "//" is "/" here.
        path = os.path.normpath(os.path.join(self.workdir, raw))
        return "/" + path.lstrip("/") if path.startswith("//") else path

    def job(self, job_id: str) -> Job:
        job = self.jobs.get(job_id)
        if job is None:
            raise HTTPError(404, "job_not_found", f"job {job_id} is not known to this agent")
        return job

    # exec

    async def exec(self, req: Request) -> None:
        body = await req.json()
        command = body.get("command")
        if isinstance(command, str):
            if not command.strip():
                raise invalid("command is empty")
        elif not (
            isinstance(command, list) and command and all(isinstance(a, str) for a in command)
        ):
            raise invalid("command must be a non-empty string or a non-empty list of strings")
        job_id = body.get("job_id") or os.urandom(16).hex()
        if not isinstance(job_id, str) or len(job_id) > 128:
            raise invalid("job_id must be a string of at most 128 characters")
        fingerprint = json.dumps(command)
        job = self.jobs.get(job_id)
        if job is not None:
            if job.fingerprint != fingerprint:
                raise HTTPError(
                    409, "conflict", f"job_id {job_id} is already used by a different command"
                )
            await self.stream_job(req, job)
            return
        cwd = self.resolve(body.get("cwd") or self.workdir)
        if not os.path.isdir(cwd):
            what = "is not a directory" if os.path.exists(cwd) else "does not exist"
            raise invalid(f"cwd {cwd} {what}")
        env = {**self.base_env, **string_map(body.get("env"), "env")}
        timeout = body.get("timeout")
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0
        ):
            raise invalid("timeout must be a positive number of seconds")
        max_output = body.get("max_output_bytes")
        if max_output is None:
            max_output = DEFAULT_MAX_OUTPUT
        elif isinstance(max_output, bool) or not isinstance(max_output, int) or max_output < 0:
            raise invalid("max_output_bytes must be a non-negative integer")
        stdin = body.get("stdin")
        data = None if stdin is None else decode_b64(stdin, "stdin")
        job = Job(self, job_id, fingerprint, max_output)
        self.jobs[job_id] = job
        argv = build_argv(command, bool(body.get("login_shell")))
        job.start(argv, cwd, env, float(timeout) if timeout else None, data)
        await self.stream_job(req, job)

    async def stream_job(self, req: Request, job: Job) -> None:
        """Replay the job's events from the start, follow live output, end with ``x``."""
        await req.discard_body()
        req.start_chunked("application/x-ndjson")
        events = job.events
        sent = 0
        while True:
            if sent < len(events):
                end = len(events)
                req.write_chunk(b"".join(events[sent:end]))
                sent = end
                await req.writer.drain()
            elif job.done:
                break
            else:
                await job.changed()
        req.end_chunked()
        await req.writer.drain()

    # files

    async def read_file(self, req: Request) -> None:
        path = self.resolve(req.arg("path"))
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except IsADirectoryError:
            raise invalid(f"{path} is a directory") from None
        except OSError as exc:
            raise os_error(exc, path, "reading") from None
        try:
            info = os.fstat(fd)
            if stat.S_ISDIR(info.st_mode):
                raise invalid(f"{path} is a directory")
            if not stat.S_ISREG(info.st_mode):
                raise invalid(f"{path} is not a regular file")
            req.writer.write(
                req.head(
                    200,
                    [
                        ("Content-Type", "application/octet-stream"),
                        ("Content-Length", str(info.st_size)),
                    ],
                )
            )
            left = info.st_size
            while left:
                chunk = os.read(fd, min(left, FILE_CHUNK))
                if not chunk:
                    raise ConnectionResetError(f"{path} shrank while it was being sent")
                left -= len(chunk)
                req.writer.write(chunk)
                await req.writer.drain()
        finally:
            os.close(fd)

    async def write_file(self, req: Request) -> None:
        path = self.resolve(req.arg("path"))
        mode_text = req.query.get("mode")
        mode: int | None = None
        if mode_text:
            try:
                mode = int(mode_text, 8)
            except ValueError:
                mode = -1
            if not 0 <= mode <= 0o7777:
                raise invalid(f"mode {mode_text!r} is not an octal file mode like 0644")
        if os.path.isdir(path):
            raise invalid(f"{path} is a directory")
        parent, name = os.path.split(path)
        try:
            os.makedirs(parent, exist_ok=True)
        except OSError as exc:
            raise os_error(exc, parent, "creating") from None
        if mode is None:
            try:
                mode = stat.S_IMODE(os.stat(path).st_mode)
            except OSError:
                mode = 0o666 & ~self.umask
        tmp = os.path.join(parent, f".{name}.{os.urandom(6).hex()}.orchard-upload")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise os_error(exc, path, "writing") from None
        size = 0
        try:
            try:
                async for chunk in req.body():
                    view = memoryview(chunk)
                    while view:
                        view = view[os.write(fd, view) :]
                    size += len(chunk)
                os.fchmod(fd, mode)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except OSError as exc:
            os.unlink(tmp)
            raise os_error(exc, path, "writing") from None
        except BaseException:
            os.unlink(tmp)
            raise
        await req.send_json(200, {"path": path, "size": size})

    async def list_dir(self, req: Request) -> None:
        path = self.resolve(req.arg("path"))
        try:
            names = sorted(os.listdir(path))
        except NotADirectoryError:
            raise invalid(f"{path} is not a directory") from None
        except OSError as exc:
            raise os_error(exc, path, "listing") from None
        entries = []
        for name in names:
            try:
                info = os.lstat(os.path.join(path, name))
            except FileNotFoundError:
                continue  # removed while listing
            except OSError as exc:
                raise os_error(exc, os.path.join(path, name), "reading") from None
            mode = info.st_mode
            kind = (
                "file"
                if stat.S_ISREG(mode)
                else "directory"
                if stat.S_ISDIR(mode)
                else "symlink"
                if stat.S_ISLNK(mode)
                else "other"
            )
            entries.append(
                {
                    "name": name,
                    "type": kind,
                    "size": info.st_size,
                    "modified": iso_utc(info.st_mtime_ns),
                }
            )
        await req.send_json(200, entries)

    async def delete_path(self, req: Request) -> None:
        path = self.resolve(req.arg("path"))
        recursive = req.flag("recursive", False)
        if path == "/":
            raise invalid("refusing to delete /")
        try:
            info = os.lstat(path)
            if not stat.S_ISDIR(info.st_mode):
                os.unlink(path)
            elif recursive:
                import shutil  # rarely needed: keep it out of the idle agent

                shutil.rmtree(path)
            else:
                os.rmdir(path)
        except OSError as exc:
            if exc.errno == errno.ENOTEMPTY:
                raise HTTPError(
                    409, "conflict", f"directory {path} is not empty (pass recursive=true)"
                ) from None
            raise os_error(exc, path, "deleting") from None
        await req.send_json(200, {"deleted": path})

    async def mkdir(self, req: Request) -> None:
        path = self.resolve(req.arg("path"))
        try:
            if req.flag("parents", True):
                os.makedirs(path, exist_ok=True)
            else:
                os.mkdir(path)
        except FileExistsError:
            raise HTTPError(409, "conflict", f"{path} already exists") from None
        except OSError as exc:
            raise os_error(exc, path, "creating") from None
        await req.send_json(200, {"path": path})

    # PTY

    async def pty(self, req: Request) -> None:
        import hashlib  # only for the WebSocket handshake

        key = req.headers.get("sec-websocket-key")
        if req.headers.get("upgrade", "").lower() != "websocket" or not key:
            raise invalid("GET /pty needs a WebSocket upgrade (Upgrade: websocket)")
        if req.headers.get("sec-websocket-version") != "13":
            raise invalid("unsupported WebSocket version (need 13)")
        digest = hashlib.sha1((key + WS_GUID).encode()).digest()  # noqa: S324 - RFC 6455
        accept = base64.b64encode(digest).decode()
        req.keep_alive = False
        req.writer.write(
            req.head(
                101,
                [
                    ("Upgrade", "websocket"),
                    ("Connection", "Upgrade"),
                    ("Sec-WebSocket-Accept", accept),
                ],
            )
        )
        ws = WebSocket(req.reader, req.writer)
        try:
            text = await asyncio.wait_for(ws.recv(), PTY_INIT_TIMEOUT)
        except TimeoutError:
            await ws.close(4400, "init frame not received within 10 s")
            return
        if text is None:
            return
        try:
            argv, env, cwd, size = self.pty_init(text)
        except HTTPError as exc:
            await ws.send_json({"type": "error", "message": exc.message})
            await ws.close(4400, "bad init frame")
            return
        session = PtySession(self, ws)
        try:
            session.spawn(argv, env, cwd, size)
        except OSError as exc:
            message = spawn_failure(exc, argv[0], cwd)["error"]
            await ws.send_json({"type": "error", "message": message})
            await ws.close(4500, "spawn failed")
            return
        await session.run()

    def pty_init(self, text: str) -> tuple[list[str], dict[str, str], str, tuple[int, int]]:
        try:
            init = json.loads(text)
        except ValueError:
            raise invalid("the first frame must be a JSON init message") from None
        if not isinstance(init, dict) or init.get("type") != "init":
            raise invalid('the first frame must be {"type": "init", ...}')
        cmd = init.get("cmd") or ["/bin/sh"]
        if not isinstance(cmd, list) or not all(isinstance(a, str) for a in cmd):
            raise invalid("cmd must be a list of strings")
        rows, cols = init.get("rows", 24), init.get("cols", 80)
        if not all(isinstance(v, int) and 1 <= v <= 1000 for v in (rows, cols)):
            raise invalid("rows and cols must be integers from 1 to 1000")
        cwd = self.resolve(init.get("cwd") or self.workdir)
        if not os.path.isdir(cwd):
            raise invalid(f"cwd {cwd} does not exist")
        env = {**self.base_env, "TERM": "xterm-256color", **string_map(init.get("env"), "env")}
        return build_argv(cmd, bool(init.get("login_shell"))), env, cwd, (rows, cols)


def signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


# --- WebSocket (RFC 6455, server side) -----------------------------------------------------


class WebSocketClosed(Exception):
    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


def unmask(payload: bytes, mask: bytes) -> bytes:
    size = len(payload)
    if not size:
        return payload
    key = (mask * (size // 4 + 1))[:size]
    return (int.from_bytes(payload, "little") ^ int.from_bytes(key, "little")).to_bytes(
        size, "little"
    )


class WebSocket:
    """Text-message WebSocket over an upgraded connection: ping/pong and close handled here."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.lock = asyncio.Lock()
        self.closing = False  # a close frame was sent

    async def _send(self, opcode: int, payload: bytes) -> None:
        size = len(payload)
        if size < 126:
            head = struct.pack("!BB", 0x80 | opcode, size)
        elif size < 65536:
            head = struct.pack("!BBH", 0x80 | opcode, 126, size)
        else:
            head = struct.pack("!BBQ", 0x80 | opcode, 127, size)
        async with self.lock:
            self.writer.write(head + payload)
            await self.writer.drain()

    async def send_json(self, message: dict[str, Any]) -> None:
        if not self.closing:
            await self._send(0x1, json.dumps(message, separators=(",", ":")).encode())

    async def _frame(self) -> tuple[bool, int, bytes]:
        first, second = await self.reader.readexactly(2)
        size = second & 0x7F
        if size == 126:
            (size,) = struct.unpack("!H", await self.reader.readexactly(2))
        elif size == 127:
            (size,) = struct.unpack("!Q", await self.reader.readexactly(8))
        if size > WS_MAX_MESSAGE:
            raise WebSocketClosed(1009)
        if not second & 0x80:
            raise WebSocketClosed(1002)  # client frames must be masked
        mask = await self.reader.readexactly(4)
        payload = unmask(await self.reader.readexactly(size), mask)
        return bool(first & 0x80), first & 0x0F, payload

    async def recv(self) -> str | None:
        """The next text message; None once the peer closed (or the connection dropped)."""
        parts: list[bytes] = []
        total = 0
        try:
            while True:
                fin, opcode, payload = await self._frame()
                if opcode == 0x8:
                    if not self.closing:
                        self.closing = True
                        await self._send(0x8, payload[:2])
                    return None
                if opcode == 0x9:
                    await self._send(0xA, payload)
                    continue
                if opcode == 0xA:
                    continue
                if opcode in (0x1, 0x2):
                    parts = [payload]
                    total = len(payload)
                elif opcode == 0x0 and parts:
                    parts.append(payload)
                    total += len(payload)
                else:
                    raise WebSocketClosed(1002)
                if total > WS_MAX_MESSAGE:
                    raise WebSocketClosed(1009)
                if fin:
                    return b"".join(parts).decode("utf-8", "replace")
        except WebSocketClosed as exc:
            await self.close(exc.code)
            return None
        except (asyncio.IncompleteReadError, ConnectionError):
            return None

    async def close(self, code: int, reason: str = "") -> None:
        """Send a close frame and wait briefly for the peer's."""
        if self.closing:
            return
        self.closing = True
        try:
            await self._send(0x8, struct.pack("!H", code) + reason.encode()[:120])
            await asyncio.wait_for(self._until_close(), 2.0)
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError, WebSocketClosed):
            pass

    async def _until_close(self) -> None:
        while (await self._frame())[1] != 0x8:
            pass


class PtySession:
    """One command on a pseudo-terminal, driven by the JSON frames of a WebSocket."""

    def __init__(self, agent: Agent, ws: WebSocket) -> None:
        self.agent = agent
        self.ws = ws
        self.master = -1
        self.pid = 0
        self.exited: asyncio.Future[int] | None = None
        self.kill_timer: asyncio.TimerHandle | None = None

    def spawn(self, argv: list[str], env: dict[str, str], cwd: str, size: tuple[int, int]) -> None:
        master, slave = os.openpty()
        try:
            set_winsize(master, *size)
            proc = subprocess.Popen(
                argv,
                cwd=cwd,
                env=env,
                stdin=slave,
                stdout=slave,
                stderr=slave,
                start_new_session=True,
                preexec_fn=take_controlling_tty,  # the agent runs no threads
            )
        except BaseException:
            os.close(master)
            raise
        finally:
            os.close(slave)
        os.set_blocking(master, False)
        self.master = master
        self.pid = proc.pid
        self.agent.expose_to_oom_killer(proc.pid)
        self.exited = self.agent.watch_child(proc)
        self.agent.pty_groups.add(proc.pid)

    async def run(self) -> None:
        assert self.exited is not None
        recv = asyncio.ensure_future(self._recv())
        pump = asyncio.ensure_future(self._pump())
        try:
            await self.ws.send_json({"type": "ready", "pid": self.pid})
            await asyncio.wait((recv, pump), return_when=asyncio.FIRST_COMPLETED)
            if pump.done():
                # Output ended (or the command exited): report the exit unless the client left.
                await asyncio.wait((recv, self.exited), return_when=asyncio.FIRST_COMPLETED)
                if self.exited.done():
                    recv.cancel()
                    await self.ws.send_json({"type": "exit", "code": self.exited.result()})
                    await self.ws.close(1000)
        except ConnectionError:
            pass
        finally:
            recv.cancel()
            pump.cancel()
            if self.kill_timer is not None:
                self.kill_timer.cancel()
            signal_group(self.pid, signal.SIGKILL)
            self.agent.pty_groups.discard(self.pid)
            os.close(self.master)

    async def _pump(self) -> None:
        """Forward terminal output until it ends, or until the command exited and it drained."""
        assert self.exited is not None
        while True:
            try:
                data = os.read(self.master, PTY_CHUNK)
            except BlockingIOError:
                if self.exited.done():
                    return
                await wait_fd(self.master, also=self.exited)
                continue
            except OSError:
                return  # EIO: no process holds the terminal any more
            if not data:
                return
            await self.ws.send_json({"type": "stdout", "data": base64.b64encode(data).decode()})

    async def _recv(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            text = await self.ws.recv()
            if text is None:
                return
            try:
                message = json.loads(text)
                kind = message["type"]
                if kind == "stdin":
                    await write_fd(self.master, decode_b64(message.get("data", ""), "data"))
                elif kind == "signal":
                    name = str(message.get("sig", "")).upper().removeprefix("SIG")
                    if name not in PTY_SIGNALS:
                        raise invalid(f"unknown signal {message.get('sig')!r}")
                    signal_group(self.pid, PTY_SIGNALS[name])
                elif kind == "resize":
                    rows, cols = message.get("rows"), message.get("cols")
                    if not all(isinstance(v, int) and 1 <= v <= 1000 for v in (rows, cols)):
                        raise invalid("rows and cols must be integers from 1 to 1000")
                    set_winsize(self.master, rows, cols)
                elif kind == "close":
                    signal_group(self.pid, signal.SIGTERM)
                    if self.kill_timer is None:
                        self.kill_timer = loop.call_later(
                            PTY_CLOSE_GRACE, signal_group, self.pid, signal.SIGKILL
                        )
                else:
                    raise invalid(f"unknown frame type {kind!r}")
            except HTTPError as exc:
                await self.ws.send_json({"type": "error", "message": exc.message})
            except (ValueError, KeyError, TypeError):
                await self.ws.send_json({"type": "error", "message": "bad frame: " + text[:200]})
            except OSError:
                pass  # the terminal is gone: the exit frame follows


def set_winsize(fd: int, rows: int, cols: int) -> None:
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


def take_controlling_tty() -> None:
    """In the child, after setsid: make the terminal on fd 0 the session's controlling tty."""
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


# --- process entry -------------------------------------------------------------------------


def parse_listen(value: str) -> tuple[str, str, int]:
    """``unix:/path`` -> ("unix", path, 0); ``tcp:HOST:PORT`` -> ("tcp", host, port)."""
    kind, _, rest = value.partition(":")
    if kind == "unix" and rest.startswith("/"):
        return "unix", rest, 0
    if kind == "tcp":
        host, _, port = rest.rpartition(":")
        if host and port.isdigit() and 0 < int(port) < 65536:
            return "tcp", host.strip("[]"), int(port)
    raise ValueError(f"--listen {value!r} must be unix:/abs/path.sock or tcp:HOST:PORT")


async def serve(listen: tuple[str, str, int], token: str | None, workdir: str) -> None:
    loop = asyncio.get_running_loop()
    agent = Agent(token, workdir)
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGCHLD, agent.reap)
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        os.makedirs(workdir, exist_ok=True)
    except OSError as exc:
        log(f"cannot create workdir {workdir}: {exc}")
    kind, address, port = listen
    if kind == "unix":
        os.makedirs(os.path.dirname(address), exist_ok=True)
        server = await asyncio.start_unix_server(
            agent.handle, address, limit=MAX_HEADER_BYTES, backlog=1024
        )
        # Reach is governed by the directory the socket lives in, and every call needs the token.
        os.chmod(address, 0o666)  # noqa: S103
    else:
        server = await asyncio.start_server(
            agent.handle, address, port, limit=MAX_HEADER_BYTES, backlog=1024
        )
    log(f"version {AGENT_VERSION} listening on {kind}:{address}{f':{port}' if port else ''}")
    try:
        async with server:
            await stop.wait()
    finally:
        agent.shutdown()
        if kind == "unix":
            with contextlib.suppress(OSError):
                os.unlink(address)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="orchard-agent", description="Orchard sandbox agent")
    parser.add_argument("--listen", required=True, help="unix:/path/agent.sock or tcp:HOST:PORT")
    parser.add_argument(
        "--no-auth", action="store_true", help="accept requests without a token (tests only)"
    )
    args = parser.parse_args(argv)
    try:
        listen = parse_listen(args.listen)
    except ValueError as exc:
        parser.error(str(exc))
    token = os.environ.get("ORCHARD_AGENT_TOKEN") or None
    if token is None and not args.no_auth:
        parser.error("ORCHARD_AGENT_TOKEN is not set (--no-auth runs without auth, for tests)")
    workdir = os.environ.get("ORCHARD_AGENT_WORKDIR") or DEFAULT_WORKDIR

    asyncio.run(serve(listen, None if args.no_auth else token, workdir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
