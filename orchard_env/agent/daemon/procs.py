"""The processes the agent starts: their argv and environment, spawn failures as shell-like
exit codes, the children it watches (reaped on SIGCHLD) and exposes to the OOM killer (whose
kills the sandbox's cgroup counts), and how a command's whole tree is killed."""

from __future__ import annotations

import contextlib
import functools
import os
import shlex
import signal
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from .http import log
from .loop import Loop

# Variables that belong to the agent and its launcher, never to the commands it runs.
OWN_ENV_PREFIX = "ORCHARD_AGENT_"
LAUNCHER_ENV = ("PYTHONHOME", "PYTHONPATH", "PYTHONNOUSERSITE", "LD_LIBRARY_PATH")
OOM_SCORE_BOOST = 500  # commands are this much likelier OOM victims than the agent itself


def find_subreaper() -> str:
    """The bundle's ``orchard-subreaper`` (orchard_env/agent/subreaper.c), as the launcher
    names it; "" without one, or when it names a file that cannot run (a bundle older than
    the orchestrator that launched it): commands then start through a ``preexec_fn``."""
    path = os.environ.get(OWN_ENV_PREFIX + "SUBREAPER", "")
    if path and not os.access(path, os.X_OK):
        log(f"no subreaper at {path}: commands start through a preexec_fn")
        return ""
    return path


SUBREAPER = find_subreaper()


class Processes:
    """The agent's children, each with a callback for its return code, called on the loop
    when SIGCHLD says it exited (:meth:`reap`), and the first processes of PTY sessions."""

    def __init__(self, loop: Loop) -> None:
        self.loop = loop
        loop.on_child_exit = self.reap
        self.children: dict[int, tuple[subprocess.Popen[bytes], Callable[[int], None]]] = {}
        self.pty_roots: set[int] = set()
        self.child_oom_score_adj = min(1000, read_oom_score_adj() + OOM_SCORE_BOOST)

    @functools.cached_property
    def preexec(self) -> Callable[[], None] | None:
        """:func:`subreaper_hook`, made at the first command (ctypes is not loaded before)."""
        return subreaper_hook()

    def spawn(
        self, argv: list[str], pass_fds: tuple[int, ...], tty: bool = False, **options: Any
    ) -> subprocess.Popen[bytes]:
        """Start ``argv`` in a session of its own, its first process a child subreaper (with
        ``tty``, its stdin a terminal that becomes the session's controlling terminal):
        through :data:`SUBREAPER` when the agent has one, which CPython starts with
        ``vfork()``, else with :attr:`preexec` (a ``preexec_fn`` makes CPython ``fork()`` the
        whole agent; the child runs only ``ioctl`` and ``prctl``, so the agent's other threads
        hold nothing it needs). Raises :class:`OSError` as ``Popen`` does when the command
        cannot start; returns once it has been exec'd."""
        if not SUBREAPER:
            preexec = tty_hook(self.preexec) if tty else self.preexec
            return subprocess.Popen(
                argv, pass_fds=pass_fds, start_new_session=True, preexec_fn=preexec, **options
            )
        status_r, status_w = os.pipe()
        try:
            proc = subprocess.Popen(
                [SUBREAPER, *(["--tty"] if tty else []), str(status_w), *argv],
                pass_fds=(*pass_fds, status_w),
                start_new_session=True,
                **options,
            )
        except BaseException:
            os.close(status_r)
            raise
        finally:
            os.close(status_w)
        try:
            status = os.read(status_r, 4)  # end-of-file: the command was exec'd
        finally:
            os.close(status_r)
        if not status:
            return proc
        proc.wait()  # the subreaper wrote why it could not exec, and is exiting
        error = int.from_bytes(status, sys.byteorder)
        raise OSError(error, os.strerror(error), argv[0])

    def expose_to_oom_killer(self, pid: int) -> None:
        """Make a command a likelier OOM victim than the agent (raising needs no privilege):
        when a sandbox runs out of memory, the command is killed and the agent survives."""
        with contextlib.suppress(OSError), open(f"/proc/{pid}/oom_score_adj", "w") as target:
            target.write(str(self.child_oom_score_adj))

    def watch_child(self, proc: subprocess.Popen[bytes], exited: Callable[[int], None]) -> None:
        """Call ``exited`` with the child's return code once it exits (on the loop)."""
        returncode = proc.poll()  # it may have exited already, its SIGCHLD handled before
        if returncode is None:
            self.children[proc.pid] = (proc, exited)
        else:
            exited(returncode)

    def reap(self) -> None:
        """On the loop: reap the children that exited and call their callbacks."""
        for pid, (proc, exited) in list(self.children.items()):
            returncode = proc.poll()
            if returncode is not None:
                del self.children[pid]
                exited(returncode)


PR_SET_CHILD_SUBREAPER = 36
KILL_ROUNDS = 100  # scans of a tree being killed, while what it forks keeps appearing


def subreaper_hook() -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes a command's first process a child subreaper, so whatever
    it starts stays in its tree even when the middle of the tree exits (``setsid``,
    ``nohup``, double forks): orphans are re-parented to it, not to PID 1, and
    :func:`kill_tree` finds them. The setting survives ``execve``. None without ``ctypes``."""
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (ImportError, OSError, AttributeError):
        return None

    def become_subreaper() -> None:
        prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)

    return become_subreaper


def tty_hook(become_subreaper: Callable[[], None] | None) -> Callable[[], None]:
    """A ``preexec_fn`` for a terminal session's command (started in a new session, the
    terminal on fd 0): take the terminal as the session's controlling terminal, then become a
    subreaper as every command does."""
    import fcntl  # terminals are rare: not in the idle agent's memory
    import termios

    def preexec() -> None:
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)
        if become_subreaper is not None:
            become_subreaper()

    return preexec


def descendants(root: int) -> list[int]:
    """The live processes whose parent chain leads to ``root`` (not ``root`` itself)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as source:
                fields = source.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        if fields[0] != b"Z":
            children.setdefault(int(fields[1]), []).append(int(name))
    found: list[int] = []
    stack = [root]
    while stack:
        for child in children.get(stack.pop(), ()):
            found.append(child)
            stack.append(child)
    return found


def kill_tree(root: int) -> None:
    """SIGKILL everything ``root`` started, then ``root``, then its process group: while
    ``root`` lives, it is the subreaper that keeps orphans of its tree in the tree, so it goes
    last. Scans again until nothing is left (what is forked meanwhile is found in the next
    round). ``root`` is stopped first, so it neither exits nor reacts while its tree goes."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(root, signal.SIGSTOP)
    for _ in range(KILL_ROUNDS):
        found = descendants(root)
        if not found:
            break
        for pid in found:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(root, signal.SIGKILL)
    signal_group(root, signal.SIGKILL)  # its group, should any member have left the tree


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


SOURCE_BASHRC = "if [ -f ~/.bashrc ]; then . ~/.bashrc; fi\n"
# The tools payload's bin/ (set by the backend that mounts it): appended to the commands'
# PATH, after the image's own entries, so the image's toolchain wins.
TOOLS_BIN = os.environ.get(OWN_ENV_PREFIX + "TOOLS_BIN", "")
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def with_tools_path(env: dict[str, str]) -> dict[str, str]:
    """``env`` with :data:`TOOLS_BIN` at the end of its PATH (once)."""
    path = env.get("PATH", DEFAULT_PATH)
    if not TOOLS_BIN or TOOLS_BIN in path.split(":"):
        return env
    return {**env, "PATH": f"{path}:{TOOLS_BIN}" if path else TOOLS_BIN}


def _tools_line() -> str:
    """For login shells, whose profile scripts set PATH anew (Debian's /etc/profile)."""
    if not TOOLS_BIN:
        return ""
    quoted = shlex.quote(TOOLS_BIN)
    return f'case ":$PATH:" in *:{quoted}:*) ;; *) PATH="$PATH:"{quoted}; export PATH ;; esac\n'


def build_argv(
    command: str | list[str], login_shell: bool, stderr_fd: int | None = None
) -> list[str]:
    """A string runs through bash (``/bin/sh`` where the image has no bash), as upstream's
    agent did, so ``source`` and ``[[`` work; a list is an argv.

    A login shell is upstream's: an interactive login bash (profile scripts) that sources
    ``~/.bashrc`` explicitly, so a ``.bashrc`` guarded against non-interactive shells
    (``[ -z "$PS1" ] && return``, where images activate conda) still runs. Without a terminal
    an interactive bash complains about job control on its stderr; given ``stderr_fd`` (the
    command's real stderr, while fd 2 is /dev/null) the script moves stderr there first, so
    that noise never reaches the output. Without bash it is ``sh -l -c``.
    """
    shell = "/bin/bash" if os.path.exists("/bin/bash") else "/bin/sh"
    if not login_shell:
        return [shell, "-c", command] if isinstance(command, str) else list(command)
    script = command if isinstance(command, str) else 'exec "$@"'
    args = [] if isinstance(command, str) else [shell, *command]
    if shell != "/bin/bash":
        return [shell, "-l", "-c", _tools_line() + script, *args]
    restore = "" if stderr_fd is None else f"exec 2>&{stderr_fd} {stderr_fd}>&-\n"
    return [shell, "--login", "-i", "-c", restore + SOURCE_BASHRC + _tools_line() + script, *args]


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


# Where the sandbox's memory cgroup counts its OOM kills: cgroup v2, then v1 (whose
# memory.oom_control has an ``oom_kill`` line since Linux 4.13).
OOM_COUNTERS = ("/sys/fs/cgroup/memory.events", "/sys/fs/cgroup/memory/memory.oom_control")


def oom_kills() -> int | None:
    """How many processes the OOM killer has killed in the sandbox's memory cgroup so far;
    None where no counter can be read (no limit, or not in a container)."""
    for path in OOM_COUNTERS:
        try:
            with open(path) as source:
                for line in source:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        except (OSError, ValueError):
            continue
    return None


def read_oom_score_adj() -> int:
    try:
        with open("/proc/self/oom_score_adj") as source:
            return int(source.read())
    except (OSError, ValueError):
        return 0
