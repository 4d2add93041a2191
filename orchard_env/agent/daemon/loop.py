"""The agent's event loop: one thread (the main one) that owns every job and process.

Its callbacks run one at a time on that thread, so the job table, the jobs and the children
are never touched by two threads at once: a connection's thread hands such work over with
:meth:`Loop.call` (and waits for its result). It watches descriptors (commands' pipes, the
listening socket), runs timers (time limits, drain graces) and wakes on signals (SIGCHLD:
reap; TERM/INT: stop) through the interpreter's wakeup descriptor.

asyncio would do all this, but importing it costs an agent about 30 ms of CPU at every start
(logging, inspect, typing and concurrent.futures come with it): with 500 sandboxes starting
at once on 2 cores, that is seconds (see docs/performance.md).
"""

from __future__ import annotations

import collections
import contextlib
import heapq
import os
import select
import signal
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from .http import Conn, log

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
READABLE = select.EPOLLIN | select.EPOLLHUP | select.EPOLLERR
WRITABLE = select.EPOLLOUT | select.EPOLLHUP | select.EPOLLERR
COMPACT_AT = 256  # timers in the heap before the cancelled ones are dropped
THREAD_STACK = 512 * 1024  # a connection's thread needs little: its stack stays small
ACCEPT_PAUSE = 1.0  # seconds without accepting once the process is out of descriptors


class Timer:
    """A callback due at ``when`` (monotonic); :meth:`cancel` before it runs drops it."""

    __slots__ = ("callback", "cancelled", "when")

    def __init__(self, when: float, callback: Callable[[], None]) -> None:
        self.when = when
        self.callback = callback
        self.cancelled = False

    def __lt__(self, other: Timer) -> bool:
        return self.when < other.when

    def cancel(self) -> None:
        self.cancelled = True


class _Call:
    """A call handed to the loop by another thread, and its outcome."""

    __slots__ = ("args", "done", "error", "fn", "result")

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.fn = fn
        self.args = args
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self.fn(*self.args)
        except BaseException as exc:  # re-raised in the calling thread
            self.error = exc
        self.done.set()


class Loop:
    """See the module's docstring. Only :meth:`call` and :meth:`call_soon` may be used from
    other threads; everything else runs on the loop's own thread."""

    def __init__(self) -> None:
        self.epoll = select.epoll()
        self.handlers: dict[int, tuple[Callable[[], None] | None, Callable[[], None] | None]] = {}
        self.timers: list[Timer] = []
        self._compact_at = COMPACT_AT
        self.pending: collections.deque[Callable[[], None]] = collections.deque()
        self.thread: threading.Thread | None = None
        self.stopping = False
        self.on_child_exit: Callable[[], None] = lambda: None
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.epoll.register(self._wake_r, select.EPOLLIN)

    # descriptors

    def add_reader(self, fd: int, callback: Callable[[], None]) -> None:
        self._watch(fd, callback, self.handlers.get(fd, (None, None))[1])

    def remove_reader(self, fd: int) -> None:
        self._watch(fd, None, self.handlers.get(fd, (None, None))[1])

    def add_writer(self, fd: int, callback: Callable[[], None]) -> None:
        self._watch(fd, self.handlers.get(fd, (None, None))[0], callback)

    def remove_writer(self, fd: int) -> None:
        self._watch(fd, self.handlers.get(fd, (None, None))[0], None)

    def _watch(
        self, fd: int, reader: Callable[[], None] | None, writer: Callable[[], None] | None
    ) -> None:
        mask = (select.EPOLLIN if reader else 0) | (select.EPOLLOUT if writer else 0)
        known = fd in self.handlers
        if not mask:
            if known:
                del self.handlers[fd]
                self.epoll.unregister(fd)
            return
        self.handlers[fd] = (reader, writer)
        if known:
            self.epoll.modify(fd, mask)
        else:
            self.epoll.register(fd, mask)

    def serve(self, sock: socket.socket, handle: Callable[[Conn], None]) -> None:
        """Accept on ``sock`` (listening, non-blocking) and serve each connection with
        ``handle`` in a thread of its own. Out of descriptors (a process in the sandbox may
        open connections until the agent is), accepting pauses for :data:`ACCEPT_PAUSE`:
        the waiting connections keep the socket readable, and retrying at once would spin."""
        threading.stack_size(THREAD_STACK)
        fd = sock.fileno()

        def accept() -> None:
            while True:
                try:
                    client, _ = sock.accept()
                except (BlockingIOError, InterruptedError):
                    return
                except OSError as exc:
                    log(f"accept failed: {exc}; accepting again in {ACCEPT_PAUSE:g} s")
                    self.remove_reader(fd)
                    self.call_later(ACCEPT_PAUSE, lambda: self.add_reader(fd, accept))
                    return
                client.setblocking(True)
                try:
                    threading.Thread(target=handle, args=(Conn(client),), daemon=True).start()
                except RuntimeError as exc:  # no thread to be had (the sandbox's pids limit)
                    log(f"cannot serve a connection: {exc}")
                    client.close()

        self.add_reader(fd, accept)

    # timers and calls

    def call_later(self, delay: float, callback: Callable[[], None]) -> Timer:
        if len(self.timers) > self._compact_at:
            # Cancelled timers wait in the heap until they are due: drop them now and then,
            # or a run of long time limits, each cancelled early, would pile up.
            self.timers = [timer for timer in self.timers if not timer.cancelled]
            heapq.heapify(self.timers)
            self._compact_at = max(COMPACT_AT, 2 * len(self.timers))
        timer = Timer(time.monotonic() + delay, callback)
        heapq.heappush(self.timers, timer)
        return timer

    def call_soon(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` on the loop's thread soon (from any thread)."""
        self.pending.append(callback)
        with contextlib.suppress(BlockingIOError):  # the pipe is full of wake-ups already
            os.write(self._wake_w, b"\0")

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on the loop's thread, its result (or exception) returned here."""
        if threading.current_thread() is self.thread:
            return fn(*args)
        call = _Call(fn, args)
        self.call_soon(call.run)
        call.done.wait()
        if call.error is not None:
            raise call.error
        return call.result

    # running

    def run(self) -> None:
        """Run until SIGTERM or SIGINT (on the main thread: it gets the signals)."""
        self.thread = threading.current_thread()
        for sig in (*STOP_SIGNALS, signal.SIGCHLD):
            signal.signal(sig, lambda *_: None)  # the wakeup byte carries them (below)
        signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
        while not self.stopping:
            self._run_once()

    def _run_once(self) -> None:
        timeout = -1.0
        while self.timers and self.timers[0].cancelled:
            heapq.heappop(self.timers)
        if self.pending:
            timeout = 0.0
        elif self.timers:
            timeout = max(self.timers[0].when - time.monotonic(), 0.0)
        for fd, events in self.epoll.poll(timeout):
            if fd == self._wake_r:
                self._woken()
                continue
            reader = self.handlers.get(fd, (None, None))[0]
            if reader is not None and events & READABLE:
                _run(reader)
            # A reader may have removed the writer (or the fd): look it up again.
            writer = self.handlers.get(fd, (None, None))[1]
            if writer is not None and events & WRITABLE:
                _run(writer)
        now = time.monotonic()
        while self.timers and self.timers[0].when <= now:
            timer = heapq.heappop(self.timers)
            if not timer.cancelled:
                _run(timer.callback)
        for _ in range(len(self.pending)):
            _run(self.pending.popleft())

    def _woken(self) -> None:
        try:
            data = os.read(self._wake_r, 4096)
        except BlockingIOError:
            return
        if signal.SIGCHLD in data:
            self.on_child_exit()
        if any(sig in data for sig in STOP_SIGNALS):
            self.stopping = True


def _run(callback: Callable[[], None]) -> None:
    """Run a callback; one that fails is logged, and the loop (and the agent) goes on."""
    try:
        callback()
    except Exception:
        import traceback  # only on the rare failure path

        log(f"a loop callback failed:\n{traceback.format_exc()}")
