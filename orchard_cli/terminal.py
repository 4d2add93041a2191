"""The local side of `orchard sandbox shell`: raw terminal <-> sandbox PTY."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import termios
import threading
import tty
from collections.abc import Iterator
from types import FrameType

from orchard_env.sdk import Sandbox


@contextlib.contextmanager
def _raw_stdin() -> Iterator[None]:
    if not sys.stdin.isatty():
        yield
        return
    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    tty.setraw(fd, termios.TCSANOW)  # keep what was typed before the session started
    try:
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def run_interactive(sandbox: Sandbox, cmd: list[str] | None, *, login_shell: bool) -> int:
    """Attach this terminal to a new PTY session; return the session's exit code."""
    size = shutil.get_terminal_size()
    program = cmd or [
        "/bin/sh",
        "-c",
        "if [ -x /bin/bash ]; then exec /bin/bash; else exec /bin/sh; fi",
    ]
    process = sandbox.pty(program, rows=size.lines, cols=size.columns, login_shell=login_shell)

    def on_resize(_signum: int, _frame: FrameType | None) -> None:
        new = shutil.get_terminal_size()
        process.resize(new.lines, new.columns)

    def pump_stdin() -> None:
        fd = sys.stdin.fileno()
        while process.returncode is None:
            try:
                data = os.read(fd, 4096)
            except OSError:
                return
            if not data:
                return
            process.write_stdin(data)

    previous = signal.signal(signal.SIGWINCH, on_resize)
    try:
        with _raw_stdin():
            threading.Thread(target=pump_stdin, daemon=True).start()
            while True:
                chunk = process.read(timeout=0.5)
                if chunk:
                    os.write(sys.stdout.fileno(), chunk)
                elif process.poll() is not None:
                    break
    finally:
        signal.signal(signal.SIGWINCH, previous)
        process.close()
    code = process.returncode
    return code if code is not None and code >= 0 else 128 - (code or 0)
