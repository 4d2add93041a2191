"""Non-blocking file-descriptor I/O on the event loop (pipes and terminals)."""

from __future__ import annotations

import asyncio
import os
from typing import Any


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
