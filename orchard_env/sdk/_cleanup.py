"""The process-wide list of sandboxes to delete if their client never gets to.

A client with ``auto_cleanup`` registers each sandbox it creates here and removes it once
deleted. Whatever is left when the interpreter exits (``atexit``) or is told to stop
(SIGINT, SIGTERM) is deleted in parallel, each delete with a short timeout; failures are
logged, never raised. Signal handlers are installed once, from the main thread only, and
chain to whatever handler was there before.
"""

from __future__ import annotations

import atexit
import logging
import signal
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import TypeVar, cast

import httpx

from orchard_env.sdk._base import CLEANUP_TIMEOUT, seg

logger = logging.getLogger("orchard_env.sdk")

_T = TypeVar("_T")
_R = TypeVar("_R")
_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_MAX_PARALLEL = 32


@dataclass(frozen=True, eq=False)
class Target:
    """Where one client's sandboxes live and how to reach it without the client itself."""

    base_url: str
    headers: tuple[tuple[str, str], ...]
    transport: httpx.BaseTransport | None = None


# Re-entrant: a signal handler runs on the main thread, possibly while it holds the lock.
_lock = threading.RLock()
_pending: dict[Target, dict[str, None]] = {}
_atexit_installed = False
_signals_installed = False


def track(target: Target, sandbox_id: str) -> None:
    _install()
    with _lock:
        _pending.setdefault(target, {})[sandbox_id] = None


def untrack(target: Target, sandbox_id: str) -> None:
    with _lock:
        ids = _pending.get(target)
        if ids is not None:
            ids.pop(sandbox_id, None)
            if not ids:
                del _pending[target]


def pending() -> dict[Target, list[str]]:
    with _lock:
        return {target: list(ids) for target, ids in _pending.items()}


def cleanup_pending(timeout: float = CLEANUP_TIMEOUT) -> None:
    """Delete every registered sandbox now (in parallel); log what could not be deleted."""
    with _lock:
        work = [(target, sandbox_id) for target, ids in _pending.items() for sandbox_id in ids]
        _pending.clear()
    if not work:
        return
    logger.info("deleting %d sandbox(es) left by Orchard clients", len(work))
    clients = {
        target: httpx.Client(
            base_url=target.base_url,
            headers=dict(target.headers),
            transport=target.transport,
            timeout=timeout,
        )
        for target, _ in work
    }

    def delete(item: tuple[Target, str]) -> None:
        target, sandbox_id = item
        try:
            response = clients[target].delete(f"/sandboxes/{seg(sandbox_id)}")
        except httpx.HTTPError as exc:
            logger.warning(
                "could not delete sandbox %s at %s: %s", sandbox_id, target.base_url, exc
            )
            return
        if response.is_error and response.status_code != 404:
            logger.warning(
                "could not delete sandbox %s at %s: HTTP %d %s",
                sandbox_id,
                target.base_url,
                response.status_code,
                response.text[:200],
            )

    try:
        in_parallel(delete, work)
    finally:
        for client in clients.values():
            client.close()


def in_parallel(fn: Callable[[_T], _R], items: Sequence[_T]) -> list[_R]:
    """``[fn(item) for item in items]`` on up to 32 threads.

    Plain threads, not a ThreadPoolExecutor: an executor refuses work once the interpreter
    is shutting down, which is exactly when the exit handler runs.
    """
    results: dict[int, _R] = {}
    failures: list[BaseException] = []
    todo = iter(enumerate(items))
    lock = threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                index, item = next(todo, (-1, None))
            if index < 0:
                return
            try:
                results[index] = fn(cast(_T, item))
            except BaseException as exc:  # re-raised in the caller's thread
                failures.append(exc)

    threads = [
        threading.Thread(target=worker, name="orchard-cleanup", daemon=True)
        for _ in range(min(_MAX_PARALLEL, len(items)))
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failures:
        raise failures[0]
    return [results[i] for i in range(len(items))]


def _install() -> None:
    global _atexit_installed, _signals_installed
    with _lock:
        if not _atexit_installed:
            atexit.register(cleanup_pending)
            _atexit_installed = True
        if _signals_installed or threading.current_thread() is not threading.main_thread():
            return
        for signum in _SIGNALS:
            signal.signal(signum, _chained(signum, signal.getsignal(signum)))
        _signals_installed = True


_Handler = Callable[[int, FrameType | None], object] | int | None


def _chained(signum: int, previous: _Handler) -> Callable[[int, FrameType | None], None]:
    def handler(received: int, frame: FrameType | None) -> None:
        cleanup_pending()
        if callable(previous):
            previous(received, frame)
        elif previous != signal.SIG_IGN:
            # The default action (terminate): restore it and deliver the signal again.
            signal.signal(received, signal.SIG_DFL)
            signal.raise_signal(received)

    handler.__qualname__ = f"orchard_cleanup_{signal.Signals(signum).name}"
    return handler
