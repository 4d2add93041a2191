"""The processes the agent starts: their argv and environment, spawn failures as shell-like
exit codes, and the children it watches (reaped on SIGCHLD) and exposes to the OOM killer."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
from typing import Any

from .http import log

# Variables that belong to the agent and its launcher, never to the commands it runs.
OWN_ENV_PREFIX = "ORCHARD_AGENT_"
LAUNCHER_ENV = ("PYTHONHOME", "PYTHONPATH", "PYTHONNOUSERSITE", "LD_LIBRARY_PATH")
OOM_SCORE_BOOST = 500  # commands are this much likelier OOM victims than the agent itself


class Processes:
    """The agent's children: a future per child for its return code, resolved from SIGCHLD
    (:meth:`reap`), the process groups of PTY sessions, and background tasks."""

    def __init__(self) -> None:
        self.children: dict[int, tuple[subprocess.Popen[bytes], asyncio.Future[int]]] = {}
        self.tasks: set[asyncio.Task[None]] = set()
        self.pty_groups: set[int] = set()
        self.child_oom_score_adj = min(1000, read_oom_score_adj() + OOM_SCORE_BOOST)

    def expose_to_oom_killer(self, pid: int) -> None:
        """Make a command a likelier OOM victim than the agent (raising needs no privilege):
        when a sandbox runs out of memory, the command is killed and the agent survives."""
        with contextlib.suppress(OSError), open(f"/proc/{pid}/oom_score_adj", "w") as target:
            target.write(str(self.child_oom_score_adj))

    def watch_child(self, proc: subprocess.Popen[bytes]) -> asyncio.Future[int]:
        """A future for the child's return code, resolved from SIGCHLD (see :meth:`reap`)."""
        exited: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.children[proc.pid] = (proc, exited)
        return exited

    def reap(self) -> None:
        for pid, (proc, exited) in list(self.children.items()):
            returncode = proc.poll()
            if returncode is not None:
                del self.children[pid]
                if not exited.done():
                    exited.set_result(returncode)

    def track(self, task: asyncio.Task[None]) -> None:
        self.tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log(f"background task failed: {task.exception()!r}")


def signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def exit_fields(returncode: int) -> tuple[int | None, int | None]:
    """(exit_code, signal) from a Popen return code (negative = killed by that signal)."""
    return (returncode, None) if returncode >= 0 else (None, -returncode)


def spawn_failure(exc: OSError, program: str, cwd: str) -> dict[str, Any]:
    """Final-event fields for a command that could not be started (shell-like exit codes)."""
    if isinstance(exc, FileNotFoundError) and exc.filename == cwd:
        return {"exit_code": None, "error": f"cwd {cwd} does not exist"}
    if isinstance(exc, FileNotFoundError):
        return {"exit_code": 127, "error": f"command not found: {program}"}
    if isinstance(exc, PermissionError):
        return {"exit_code": 126, "error": f"permission denied: {program}"}
    return {"exit_code": 126, "error": f"cannot run {program}: {exc.strerror or exc}"}


def build_argv(command: str | list[str], login_shell: bool) -> list[str]:
    """A string runs through bash (``/bin/sh`` where the image has no bash), as upstream's
    agent did, so ``source`` and ``[[`` work; a list is an argv; a login shell wraps either."""
    shell = "/bin/bash" if os.path.exists("/bin/bash") else "/bin/sh"
    if login_shell:
        if isinstance(command, str):
            return [shell, "-l", "-c", command]
        return [shell, "-l", "-c", 'exec "$@"', shell, *command]
    if isinstance(command, str):
        return [shell, "-c", command]
    return list(command)


def command_env(environ: dict[str, str], prefix: str) -> dict[str, str]:
    """The agent's environment as commands get it: without the agent's and its launcher's own.

    ``ORCHARD_AGENT_*`` always goes; ``PYTHONHOME``/``PYTHONPATH``/``LD_LIBRARY_PATH`` go only
    when they point into the agent's own interpreter (``prefix``), so an image's own values
    are kept.
    """

    def launcher_value(value: str) -> bool:
        if prefix in ("", "/", "/usr", "/usr/local"):
            return False
        return any(p == prefix or p.startswith(prefix + "/") for p in value.split(os.pathsep))

    return {
        key: value
        for key, value in environ.items()
        if not key.startswith(OWN_ENV_PREFIX)
        and not (key in LAUNCHER_ENV and launcher_value(value))
    }


def initial_environ() -> dict[str, str]:
    """The environment this process was started with, as the kernel recorded it.

    ``os.environ`` may differ already: the interpreter sets ``LC_CTYPE`` itself when it
    coerces the C locale (PEP 538), and that must not reach the commands.
    """
    try:
        with open("/proc/self/environ", "rb") as source:
            raw = source.read()
    except OSError:
        return dict(os.environ)
    environ = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep and key:
            environ[os.fsdecode(key)] = os.fsdecode(value)
    return environ


def read_oom_score_adj() -> int:
    try:
        with open("/proc/self/oom_score_adj") as source:
            return int(source.read())
    except (OSError, ValueError):
        return 0
