"""What the orchestrator accepts from the other end of a sandbox's agent channel.

Everything at that end is under the sandbox's control: root in the sandbox can replace the
socket with a symlink, a file or an impostor, and an impostor can answer with anything. So
the client (:mod:`orchard_env.agent.client`) connects only to a unix socket that really sits
in the per-sandbox directory (never following a symlink to a host socket or file), and reads
every reply through a bound: a line, a JSON body, an error body, a job's output. Whatever
breaks a bound is :class:`~orchard_env.errors.AgentTampered`, never buffered.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import stat
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator

from orchard_env import errors, http1

MiB = 1024 * 1024
MAX_LINE_BYTES = MiB
"""Longest line of a job stream: the agent sends at most 64 KiB of output per line."""
MAX_JSON_BYTES = 32 * MiB
"""Largest JSON reply (a directory listing of ~300,000 entries)."""
MAX_ERROR_BYTES = 64 * 1024
"""Largest error reply (the agent's messages name a path at most)."""
AGENT_DEFAULT_MAX_OUTPUT = 10 * MiB
"""The agent's per-stream output cap when a request names none."""

Tampered = Callable[[str], errors.AgentTampered]
"""Makes the error (and reports the sandbox) for what an agent endpoint did wrong."""


def tampered_error(where: str, message: str) -> errors.AgentTampered:
    """The error for what the agent endpoint ``where`` did wrong."""
    return errors.AgentTampered(
        f"agent at {where}: {message}",
        hint="code in the sandbox interfered with its agent; the sandbox is failed",
    )


def stream_bytes_limit(max_output: int) -> int:
    """Raw bytes a job stream may take: both streams' output base64-encoded (4/3) with the
    JSON around each chunk, plus the exit event."""
    return 3 * max_output + MAX_LINE_BYTES


def _kind(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "a symlink"
    if stat.S_ISREG(mode):
        return "a regular file"
    if stat.S_ISDIR(mode):
        return "a directory"
    return "not a socket"


@contextlib.contextmanager
def socket_path(path: str, tampered: Tampered) -> Iterator[str]:
    """A path that reaches the unix socket at ``path`` and nothing else, while open.

    The socket is opened ``O_PATH | O_NOFOLLOW`` in its (host-owned) directory and must be
    a socket on that directory's filesystem; the path handed out names that very inode
    (``/proc/self/fd/N``), so nothing swapped in after the check is followed. Raises
    :class:`~orchard_env.errors.AgentUnavailable` when there is no socket (the agent is gone)
    and :class:`~orchard_env.errors.AgentTampered` for anything else in its place.
    """
    parent, name = os.path.split(path)
    flags = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        dir_fd = os.open(parent, flags | os.O_DIRECTORY)
    except OSError as exc:
        raise errors.AgentUnavailable(f"the agent's directory {parent} is gone: {exc}") from None
    try:
        try:
            fd = os.open(name, flags, dir_fd=dir_fd)
        except FileNotFoundError:
            raise errors.AgentUnavailable(f"no agent socket at {path}") from None
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise tampered(f"{path} is not the agent's socket: {exc.strerror}") from None
            raise errors.AgentUnavailable(f"cannot open the agent socket {path}: {exc}") from None
        try:
            found, home = os.fstat(fd), os.fstat(dir_fd)
            if not stat.S_ISSOCK(found.st_mode):
                raise tampered(
                    f"{path} is {_kind(found.st_mode)}, not the agent's socket: "
                    "something in the sandbox replaced it"
                )
            if found.st_dev != home.st_dev:
                raise tampered(f"{path} is a socket from another filesystem than {parent}")
            yield f"/proc/self/fd/{fd}"
        finally:
            os.close(fd)
    finally:
        os.close(dir_fd)


class ConnectFailed(ConnectionError):
    """Nothing listens at the agent's endpoint (no socket, the connection refused)."""


async def connect(*, uds: str | None, host: str, port: int, tampered: Tampered) -> http1.Stream:
    """A new connection to the agent: its unix socket through :func:`socket_path`, else TCP."""
    try:
        if uds is None:
            return await asyncio.open_connection(host, port, limit=http1.MAX_HEAD)
        with socket_path(uds, tampered) as path:
            return await asyncio.open_unix_connection(path, limit=http1.MAX_HEAD)
    except errors.AgentUnavailable as exc:
        raise ConnectFailed(exc.message) from None
    except OSError as exc:
        if isinstance(exc, TimeoutError):
            raise
        raise ConnectFailed(str(exc)) from exc


async def read_capped(
    body: AsyncGenerator[bytes, None], limit: int, what: str, tampered: Tampered
) -> bytes:
    """A body (:meth:`http1.Response.body`), at most ``limit`` bytes (more is tampering).
    Raw bytes: no decoder runs on what an impostor sends."""
    parts: list[bytes] = []
    size = 0
    async with contextlib.aclosing(body):
        async for chunk in body:
            size += len(chunk)
            if size > limit:
                raise tampered(f"the agent sent {what} over {limit} bytes")
            parts.append(chunk)
    return b"".join(parts)


async def capped_lines(
    body: AsyncGenerator[bytes, None], total_limit: int, tampered: Tampered
) -> AsyncIterator[bytes]:
    """The non-empty lines of a body: each at most :data:`MAX_LINE_BYTES`, all together at
    most ``total_limit`` bytes."""
    pending = b""
    total = 0
    try:
        async for chunk in body:
            total += len(chunk)
            if total > total_limit:
                raise tampered(f"the agent sent a job stream over {total_limit} bytes")
            pending += chunk
            *lines, pending = pending.split(b"\n")
            if len(pending) > MAX_LINE_BYTES:
                raise tampered(f"the agent sent a line over {MAX_LINE_BYTES} bytes")
            for line in lines:
                if len(line) > MAX_LINE_BYTES:
                    raise tampered(f"the agent sent a line over {MAX_LINE_BYTES} bytes")
                if line.strip():
                    yield line
    finally:
        await body.aclose()
    if pending.strip():
        yield pending
