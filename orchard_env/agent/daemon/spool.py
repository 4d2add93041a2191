"""Where job output waits for its readers without growing the agent's memory.

A job's event log (:class:`EventLog`) keeps its first bytes in memory, within a per-job and
an agent-wide budget (:class:`Budget`), and spills the rest to a spool file; a stream's tail
(:class:`TailRing`) is a ring of fixed size in a spool file of its own. Spool files are
unlinked as soon as they are made (``O_TMPFILE`` where the filesystem has it), so nothing in
the sandbox can reach them by name, and the disk they use goes with their descriptor. They
live in ``ORCHARD_AGENT_SPOOL`` (default ``/var/tmp``, else ``/tmp``): the sandbox's own disk,
never the workspace. Without a writable spool directory the log stays in memory (still
bounded by the output cap) and a tail keeps at most :data:`MEMORY_TAIL` bytes.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

SPOOL_ENV = "ORCHARD_AGENT_SPOOL"
SPOOL_DIRS = ("/var/tmp", "/tmp")  # noqa: S108 - the files in it are unlinked at once
JOB_MEMORY = 64 * 1024  # event bytes one job keeps in memory before it spills
AGENT_MEMORY = 4 * 1024 * 1024  # event bytes all jobs together keep in memory
MEMORY_TAIL = 256 * 1024  # the most a tail keeps when it has no spool file


def spool_dir() -> str | None:
    """The directory for spool files: ``$ORCHARD_AGENT_SPOOL`` or the first writable default."""
    configured = os.environ.get(SPOOL_ENV)
    for folder in (configured,) if configured else SPOOL_DIRS:
        if os.path.isdir(folder) and os.access(folder, os.W_OK | os.X_OK):
            return folder
    return None


def open_spool(folder: str | None) -> int | None:
    """A new anonymous read-write file in ``folder`` (None when there is none to be had)."""
    if folder is None:
        return None
    try:
        return os.open(folder, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
    except OSError:
        pass  # a filesystem without O_TMPFILE: make one with a name and unlink it at once
    import tempfile  # rare, and it brings shutil, random, bz2 and lzma

    try:
        fd, path = tempfile.mkstemp(prefix=".orchard-spool-", dir=folder)
    except OSError:
        return None
    os.unlink(path)
    return fd


def pwrite_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


class Budget:
    """The memory all event logs share: bytes in use against :data:`AGENT_MEMORY`."""

    def __init__(self, limit: int = AGENT_MEMORY) -> None:
        self.limit = limit
        self.used = 0


class EventLog:
    """An append-only byte log read by offset: memory first, then a spool file."""

    def __init__(self, budget: Budget, folder: str | None) -> None:
        self.budget = budget
        self.folder = folder
        self.memory = bytearray()
        self.fd: int | None = None
        self.spilled = 0  # bytes in the spool file
        self.in_memory_only = False  # no spool file could be made: the rest stays in memory

    @property
    def size(self) -> int:
        return len(self.memory) + self.spilled

    def append(self, data: bytes) -> bool:
        """Add ``data``; False when it could not be kept (the spool's disk is full)."""
        fits = len(self.memory) + len(data) <= JOB_MEMORY and (
            self.budget.used + len(data) <= self.budget.limit
        )
        if self.fd is None and (fits or self.in_memory_only):
            self.memory += data
            self.budget.used += len(data)
            return True
        if self.fd is None:
            self.fd = open_spool(self.folder)
            if self.fd is None:
                self.in_memory_only = True
                return self.append(data)
        try:
            pwrite_all(self.fd, data, self.spilled)
        except OSError:
            return False
        self.spilled += len(data)
        return True

    def read(self, offset: int, limit: int) -> bytes:
        """Up to ``limit`` bytes from ``offset`` (empty at the end)."""
        if offset < len(self.memory):
            return bytes(self.memory[offset : offset + limit])
        start = offset - len(self.memory)
        if self.fd is None or start >= self.spilled:
            return b""
        return os.pread(self.fd, min(limit, self.spilled - start), start)

    def close(self) -> None:
        """Free the log (memory and spool file); it reads as empty from now on."""
        self.budget.used -= len(self.memory)
        self.memory = bytearray()
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        self.spilled = 0


class TailRing:
    """The last ``size`` bytes written to it, in a spool file used as a ring."""

    def __init__(self, size: int, folder: str | None) -> None:
        self.fd = open_spool(folder)
        self.size = size if self.fd is not None else min(size, MEMORY_TAIL)
        self.memory = bytearray()  # the ring itself when there is no spool file
        self.written = 0

    @property
    def dropped(self) -> int:
        return max(self.written - self.size, 0)

    def write(self, data: bytes) -> None:
        if self.size <= 0:
            self.written += len(data)
            return
        if self.fd is None:
            self.memory += data
            del self.memory[: max(len(self.memory) - self.size, 0)]
            self.written += len(data)
            return
        view = memoryview(data)[-self.size :]
        self.written += len(data) - len(view)
        while view:
            at = self.written % self.size
            piece = view[: self.size - at]
            # A full disk loses these bytes (they count as written, like dropped ones).
            with contextlib.suppress(OSError):
                pwrite_all(self.fd, piece, at)
            self.written += len(piece)
            view = view[len(piece) :]

    def chunks(self, limit: int) -> Iterator[bytes]:
        """What the ring holds, oldest first, in pieces of at most ``limit`` bytes."""
        if self.fd is None:
            for i in range(0, len(self.memory), limit):
                yield bytes(self.memory[i : i + limit])
            return
        kept = min(self.written, self.size)
        start = self.written % self.size if self.written > self.size else 0
        for n in range(0, kept, limit):
            length = min(limit, kept - n)
            at = (start + n) % self.size
            first = os.pread(self.fd, min(length, self.size - at), at)
            rest = os.pread(self.fd, length - len(first), 0) if len(first) < length else b""
            yield first + rest

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        self.memory = bytearray()
