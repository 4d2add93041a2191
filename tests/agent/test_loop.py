"""The agent's event loop, in-process: calls handed over from other threads, timers, watched
descriptors, and the signals that reap children and stop it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator

import pytest

from orchard_env.agent.daemon import loop as loop_module
from orchard_env.agent.daemon.loop import Loop


@pytest.fixture
def running() -> Iterator[Loop]:
    """A loop running on a thread of its own (signals aside, it does not care which)."""
    loop = Loop()
    started = threading.Event()

    def run() -> None:
        loop.thread = threading.current_thread()
        started.set()
        while not loop.stopping:
            loop._run_once()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    started.wait()
    yield loop
    loop.call_soon(lambda: setattr(loop, "stopping", True))
    thread.join(5)


def test_a_call_runs_on_the_loop_and_returns_its_result_or_raises(running: Loop) -> None:
    assert running.call(threading.current_thread) is running.thread
    assert running.call(lambda a, b: a + b, 2, 3) == 5
    with pytest.raises(KeyError, match="missing"):
        running.call({}.__getitem__, "missing")


def test_timers_run_in_order_and_a_cancelled_one_never(running: Loop) -> None:
    ran: list[str] = []
    done = threading.Event()

    def schedule() -> None:
        running.call_later(0.05, lambda: ran.append("late"))
        running.call_later(0.01, lambda: ran.append("early"))
        running.call_later(0.02, lambda: ran.append("cancelled")).cancel()
        running.call_later(0.1, done.set)

    running.call(schedule)
    assert done.wait(5)
    assert ran == ["early", "late"]


def test_a_failing_callback_is_logged_and_the_loop_goes_on(
    running: Loop, capfd: pytest.CaptureFixture[str]
) -> None:
    def fail() -> None:
        raise ValueError("boom")

    running.call_soon(fail)
    assert running.call(lambda: "still running") == "still running"
    assert "a loop callback failed" in capfd.readouterr().err


def test_cancelled_timers_do_not_pile_up(running: Loop) -> None:
    def many() -> int:
        for _ in range(10 * loop_module.COMPACT_AT):
            running.call_later(3600, lambda: None).cancel()
        return len(running.timers)

    assert running.call(many) <= 2 * loop_module.COMPACT_AT


def test_a_reader_is_called_until_removed(running: Loop) -> None:
    read_end, write_end = os.pipe()
    os.set_blocking(read_end, False)
    got: list[bytes] = []
    ended = threading.Event()

    def on_readable() -> None:
        data = os.read(read_end, 100)
        got.append(data)
        if not data:
            running.remove_reader(read_end)
            ended.set()

    running.call(running.add_reader, read_end, on_readable)
    os.write(write_end, b"one")
    os.close(write_end)
    assert ended.wait(5)
    assert b"".join(got) == b"one" and got[-1] == b""
    assert read_end not in running.handlers
    os.close(read_end)


def test_out_of_descriptors_accepting_pauses_instead_of_spinning() -> None:
    # A process in the sandbox may open connections until the agent has no descriptor left;
    # the waiting ones keep the listening socket readable, so retrying at once would spin
    # the loop (and flood the log) until some are freed.
    script = textwrap.dedent(
        """
        import os, resource, socket, threading, time
        from orchard_env.agent.daemon.http import listen_socket
        from orchard_env.agent.daemon.loop import Loop

        loop = Loop()
        server = listen_socket("tcp", "127.0.0.1", 0)
        port = server.getsockname()[1]
        loop.serve(server, lambda conn: conn.read(1))  # each connection held open
        clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(40)]
        used = len(os.listdir("/proc/self/fd"))
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.setrlimit(resource.RLIMIT_NOFILE, (used + 10, hard))
        loop.thread = threading.current_thread()
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            loop._run_once()
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=30
    )
    failures = done.stderr.count("accept failed")
    assert 1 <= failures <= 3, done.stderr[-2000:]


def test_sigchld_reaps_and_sigterm_stops_the_loop() -> None:
    # run() installs signal handlers, so it runs on the main thread of a process of its own.
    script = textwrap.dedent(
        """
        import os, signal, subprocess
        from orchard_env.agent.daemon.loop import Loop

        loop = Loop()
        child = subprocess.Popen(["true"])
        def reaped():
            if child.poll() is not None:
                print("reaped", child.returncode, flush=True)
                os.kill(os.getpid(), signal.SIGTERM)
        loop.on_child_exit = reaped
        loop.run()
        print("stopped", flush=True)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=30, check=True
    )
    assert done.stdout.split("\n")[:2] == ["reaped 0", "stopped"]
