"""One live service per instance on this machine: a lease every other service can see.

A service on the local engine holds an exclusive ``flock`` on
``<tmp>/orchard-instances/<instance>.lock`` for as long as it runs (the kernel drops it when
the process ends, however it ends), and writes who holds it there. A second service started
with the same instance name, from another state directory or the same one, is refused at
start with a message naming the holder, instead of adopting and then deleting its sandboxes.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from orchard_env.config import ServiceSettings
from orchard_env.errors import ConfigError


def lease_dir() -> Path:
    return Path(tempfile.gettempdir()) / "orchard-instances"


def _open(path: Path) -> tuple[int, bool]:
    """(fd, writable): read-only when another user made the file (flock needs no write)."""
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT, 0o644), True
    except PermissionError:
        return os.open(path, os.O_RDONLY), False


@contextlib.contextmanager
def instance_lease(settings: ServiceSettings) -> Iterator[None]:
    """Hold the lease of ``settings.instance`` around a block, or raise ConfigError."""
    directory = lease_dir()
    with contextlib.suppress(FileExistsError):
        directory.mkdir()
        directory.chmod(0o1777)  # every user's services lease here, like /tmp itself
    path = directory / f"{settings.instance}.lock"
    fd, writable = _open(path)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(path)
        os.close(fd)
        raise ConfigError(
            f"instance {settings.instance!r} is already served by another Orchard service on "
            f"this machine ({holder}); a second one would adopt and remove its sandboxes",
            hint="stop that service (`orchard down` with its --state-dir), or give this one "
            "its own instance: leave ORCHARD_INSTANCE unset (each state dir gets one) or "
            "choose another",
        ) from None
    try:
        if writable:
            held = {"state_dir": str(settings.state_dir), "pid": os.getpid(), "port": settings.port}
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(held).encode(), 0)
        yield
    finally:
        os.close(fd)


def _holder(path: Path) -> str:
    try:
        held = json.loads(path.read_text())
        return f"state dir {held['state_dir']}, pid {held['pid']}, port {held['port']}"
    except (OSError, ValueError, KeyError, TypeError):
        return f"see {path}"
