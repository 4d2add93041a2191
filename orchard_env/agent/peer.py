"""What the orchestrator accepts from the other end of a sandbox's agent channel.

Everything at that end is under the sandbox's control: root in the sandbox can replace the
socket with a symlink, a file or an impostor, and an impostor can answer with anything. So
the client (:mod:`orchard_env.agent.client`) connects only to a unix socket that really sits
in the per-sandbox directory (never following a symlink to a host socket or file), and reads
every reply through a bound: a line, a JSON body, an error body, a job's output. Whatever
breaks a bound is :class:`~orchard_env.errors.AgentTampered`, never buffered.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from typing import Any

import httpcore
import httpx

from orchard_env import errors

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


class SocketBackend(httpcore.AsyncNetworkBackend):
    """httpcore's network backend, connecting unix sockets through :func:`socket_path`."""

    def __init__(self, tampered: Tampered) -> None:
        self._inner = httpcore.AnyIOBackend()
        self._tampered = tampered

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,  # noqa: ASYNC109 - httpcore's signature
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        return await self._inner.connect_tcp(host, port, timeout, local_address, socket_options)

    async def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,  # noqa: ASYNC109 - httpcore's signature
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        try:
            with socket_path(path, self._tampered) as safe:
                return await self._inner.connect_unix_socket(safe, timeout, socket_options)
        except errors.AgentUnavailable as exc:
            # httpx turns ConnectError into a TransportError, which the client retries.
            raise httpcore.ConnectError(exc.message) from None

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


def transport(
    *, uds: str | None, limits: httpx.Limits, tampered: Tampered
) -> httpx.AsyncHTTPTransport:
    """An httpx transport whose unix-socket connections go through :func:`socket_path`."""
    # The agent speaks plain HTTP (its answers are proven by MAC): no TLS context to build.
    result = httpx.AsyncHTTPTransport(limits=limits, verify=False)
    # httpx takes no network backend; its transport drives any httpcore pool given here.
    result._pool = httpcore.AsyncConnectionPool(
        max_connections=limits.max_connections,
        max_keepalive_connections=limits.max_keepalive_connections,
        keepalive_expiry=limits.keepalive_expiry,
        uds=uds,
        retries=1,
        network_backend=SocketBackend(tampered),
    )
    return result


async def read_capped(response: httpx.Response, limit: int, what: str, tampered: Tampered) -> bytes:
    """The body of a streamed response, at most ``limit`` bytes (more is tampering). Raw
    bytes: the agent never compresses, so no decoder runs on what an impostor sends."""
    parts: list[bytes] = []
    size = 0
    async for chunk in response.aiter_raw():
        size += len(chunk)
        if size > limit:
            raise tampered(f"the agent sent {what} over {limit} bytes")
        parts.append(chunk)
    return b"".join(parts)


async def capped_lines(
    response: httpx.Response, total_limit: int, tampered: Tampered
) -> AsyncIterator[bytes]:
    """The non-empty lines of a streamed response: each at most :data:`MAX_LINE_BYTES`, all
    together at most ``total_limit`` bytes."""
    pending = b""
    total = 0
    async for chunk in response.aiter_raw():
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
    if pending.strip():
        yield pending
