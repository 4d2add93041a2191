"""What the sync and async sandbox handles share that is not I/O."""

from __future__ import annotations

import logging
import os
import stat
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from orchard_env import errors, protocol

logger = logging.getLogger("orchard_env.sdk")

CHUNK = 1024 * 1024
"""Bytes per read or write when streaming a file."""


class _TextStream(Protocol):
    def write(self, text: str, /) -> object: ...

    def flush(self) -> object: ...


OutputSink = _TextStream | Callable[[str], object]
"""Where streamed output goes: a text stream (written and flushed) or a callable."""


def emit(sink: OutputSink, text: str | None) -> None:
    if not text:
        return
    if callable(sink):
        sink(text)
        return
    sink.write(text)
    sink.flush()


def route(
    event: protocol.ExecEvent, stdout: OutputSink | None, stderr: OutputSink | None
) -> protocol.Job | None:
    """Write a streamed exec's output event to its sink (default: this process's); the
    finished job for its ``exit`` event, else None."""
    if event.event == "stdout":
        emit(stdout or sys.stdout, event.data)
    elif event.event == "stderr":
        emit(stderr or sys.stderr, event.data)
    elif event.event == "exit":
        return event.job
    return None


def local_file(path: Path) -> os.stat_result:
    """The stat of a local file to upload, or an error naming what is wrong with it."""
    try:
        info = path.stat()
    except FileNotFoundError:
        raise errors.FileNotFound(f"local file {path} does not exist") from None
    if not stat.S_ISREG(info.st_mode):
        raise errors.InvalidRequest(f"{path} is not a regular file", hint="upload files one by one")
    return info


def file_mode(info: os.stat_result) -> int:
    """The permission bits an uploaded file keeps (an executable stays executable)."""
    return stat.S_IMODE(info.st_mode)


class PartFile:
    """A download's destination: written beside the target, renamed over it when complete,
    so the target appears whole or not at all."""

    def __init__(self, target: Path) -> None:
        self._target = target
        try:
            fd, name = tempfile.mkstemp(
                dir=target.parent, prefix=f".{target.name}.", suffix=".part"
            )
        except FileNotFoundError:
            raise errors.FileNotFound(f"local directory {target.parent} does not exist") from None
        self._path = Path(name)
        self._handle = os.fdopen(fd, "wb")
        self.size = 0

    def write(self, chunk: bytes) -> None:
        self._handle.write(chunk)
        self.size += len(chunk)

    def discard(self) -> None:
        self._handle.close()
        self._path.unlink(missing_ok=True)

    def commit(self) -> int:
        self._handle.close()
        self._path.replace(self._target)
        return self.size


def keep_beating(sandbox_id: str, exc: errors.OrchardError) -> bool:
    """After a failed background heartbeat: log it; False once the sandbox is gone."""
    if isinstance(exc, errors.SandboxNotFound):
        logger.info("sandbox %s is gone; its heartbeat stops", sandbox_id)
        return False
    logger.warning("heartbeat for sandbox %s failed: %s", sandbox_id, exc)
    return True


class SandboxBase:
    """State and upstream-compatible attributes of both handles."""

    def __init__(self, info: protocol.SandboxInfo) -> None:
        self.sandbox_id = info.sandbox_id
        self.info = info
        self._deleted = False

    @property
    def image(self) -> str:
        """The image the sandbox was created from."""
        return self.info.image

    @property
    def namespace(self) -> str:
        """The Kubernetes namespace of its pod (upstream's field; local: the instance)."""
        return self.info.namespace

    @property
    def block_network(self) -> bool:
        """Whether outbound network is blocked (the default)."""
        return self.info.block_network

    @property
    def status(self) -> protocol.SandboxStatus:
        """The status when last fetched (``refresh()`` fetches it again)."""
        return self.info.status

    def __repr__(self) -> str:
        state = "deleted" if self._deleted else self.info.status.value
        return f"{type(self).__name__}(sandbox_id={self.sandbox_id!r}, status={state!r})"


def share_docs(twin: type, original: type) -> None:
    """Give ``twin``'s methods without a docstring their ``original``'s (the asyncio
    classes mirror the sync ones), so ``help()`` reads the same on both."""
    for name, member in vars(twin).items():
        source = getattr(original, name, None)
        doc = getattr(source, "__doc__", None)
        if name.startswith("_") or not doc or not callable(member) or member.__doc__:
            continue
        member.__doc__ = doc
