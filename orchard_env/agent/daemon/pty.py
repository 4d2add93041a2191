"""PTY sessions: one command on a pseudo-terminal, driven by the JSON frames of a WebSocket
(upstream's protocol: init, stdin, signal, resize, close; ready, stdout, exit, error).

A session's command is a child subreaper like a job's: killing the session (a ``KILL``
signal frame, the end of the grace after ``close``, a disconnect) kills its whole tree,
``setsid`` and ``nohup`` descendants included, not only its process group."""

from __future__ import annotations

import asyncio
import base64
import fcntl
import json
import os
import signal
import struct
import subprocess
import termios
from collections.abc import Callable

from .fdio import wait_fd, write_fd
from .http import HTTPError, Request, decode_b64, invalid, string_map
from .procs import Processes, build_argv, kill_tree, signal_group, spawn_failure
from .websocket import WebSocket, accept

PTY_INIT_TIMEOUT = 10.0
PTY_CHUNK = 64 * 1024
PTY_CLOSE_GRACE = 5.0  # after a "close" frame: SIGTERM, then SIGKILL this much later
PTY_SIGNALS = {
    "TERM": signal.SIGTERM,
    "KILL": signal.SIGKILL,
    "INT": signal.SIGINT,
    "HUP": signal.SIGHUP,
    "QUIT": signal.SIGQUIT,
}


async def serve_pty(
    req: Request, procs: Processes, base_env: dict[str, str], resolve: Callable[[str], str]
) -> None:
    """The ``GET /pty`` route: upgrade, read the init frame, run the session to its end."""
    ws = accept(req)
    try:
        text = await asyncio.wait_for(ws.recv(), PTY_INIT_TIMEOUT)
    except TimeoutError:
        await ws.close(4400, "init frame not received within 10 s")
        return
    if text is None:
        return
    try:
        argv, env, cwd, size = parse_init(text, base_env, resolve)
    except HTTPError as exc:
        await ws.send_json({"type": "error", "message": exc.message})
        await ws.close(4400, "bad init frame")
        return
    session = PtySession(procs, ws)
    try:
        session.spawn(argv, env, cwd, size)
    except OSError as exc:
        message = spawn_failure(exc, argv[0], cwd)["error"]
        await ws.send_json({"type": "error", "message": message})
        await ws.close(4500, "spawn failed")
        return
    await session.run()


def parse_init(
    text: str, base_env: dict[str, str], resolve: Callable[[str], str]
) -> tuple[list[str], dict[str, str], str, tuple[int, int]]:
    """argv, environment, cwd and size from the session's init frame."""
    try:
        init = json.loads(text)
    except ValueError:
        raise invalid("the first frame must be a JSON init message") from None
    if not isinstance(init, dict) or init.get("type") != "init":
        raise invalid('the first frame must be {"type": "init", ...}')
    cmd = init.get("cmd") or ["/bin/sh"]
    if not isinstance(cmd, list) or not all(isinstance(a, str) for a in cmd):
        raise invalid("cmd must be a list of strings")
    rows, cols = init.get("rows", 24), init.get("cols", 80)
    if not all(isinstance(v, int) and 1 <= v <= 1000 for v in (rows, cols)):
        raise invalid("rows and cols must be integers from 1 to 1000")
    cwd = resolve(init.get("cwd") or ".")
    if not os.path.isdir(cwd):
        raise invalid(f"cwd {cwd} does not exist")
    env = {**base_env, "TERM": "xterm-256color", **string_map(init.get("env"), "env")}
    return build_argv(cmd, bool(init.get("login_shell"))), env, cwd, (rows, cols)


class PtySession:
    """One command on a pseudo-terminal, driven by the JSON frames of a WebSocket."""

    def __init__(self, procs: Processes, ws: WebSocket) -> None:
        self.procs = procs
        self.ws = ws
        self.master = -1
        self.pid = 0
        self.exited: asyncio.Future[int] | None = None
        self.kill_timer: asyncio.TimerHandle | None = None

    def spawn(self, argv: list[str], env: dict[str, str], cwd: str, size: tuple[int, int]) -> None:
        master, slave = os.openpty()
        try:
            set_winsize(master, *size)
            proc = subprocess.Popen(
                argv,
                cwd=cwd,
                env=env,
                stdin=slave,
                stdout=slave,
                stderr=slave,
                start_new_session=True,
                preexec_fn=self._preexec(),  # the agent runs no threads
            )
        except BaseException:
            os.close(master)
            raise
        finally:
            os.close(slave)
        os.set_blocking(master, False)
        self.master = master
        self.pid = proc.pid
        self.procs.expose_to_oom_killer(proc.pid)
        self.exited = self.procs.watch_child(proc)
        self.procs.pty_roots.add(proc.pid)

    def _preexec(self) -> Callable[[], None]:
        """In the child: take the terminal, and become a subreaper as a job's command does."""
        become_subreaper = self.procs.preexec

        def preexec() -> None:
            take_controlling_tty()
            if become_subreaper is not None:
                become_subreaper()

        return preexec

    def kill(self) -> None:
        """SIGKILL everything the session's command started while it runs (:func:`kill_tree`);
        once it has exited (and been reaped: its pid may be reused), only its group."""
        self.procs.reap()
        if self.exited is not None and not self.exited.done():
            kill_tree(self.pid)
        else:
            signal_group(self.pid, signal.SIGKILL)

    async def run(self) -> None:
        assert self.exited is not None
        recv = asyncio.ensure_future(self._recv())
        pump = asyncio.ensure_future(self._pump())
        try:
            await self.ws.send_json({"type": "ready", "pid": self.pid})
            await asyncio.wait((recv, pump), return_when=asyncio.FIRST_COMPLETED)
            if pump.done():
                # Output ended (or the command exited): report the exit unless the client left.
                await asyncio.wait((recv, self.exited), return_when=asyncio.FIRST_COMPLETED)
                if self.exited.done():
                    recv.cancel()
                    await self.ws.send_json({"type": "exit", "code": self.exited.result()})
                    await self.ws.close(1000)
        except ConnectionError:
            pass
        finally:
            recv.cancel()
            pump.cancel()
            if self.kill_timer is not None:
                self.kill_timer.cancel()
            self.kill()
            self.procs.pty_roots.discard(self.pid)
            os.close(self.master)

    async def _pump(self) -> None:
        """Forward terminal output until it ends, or until the command exited and it drained."""
        assert self.exited is not None
        while True:
            try:
                data = os.read(self.master, PTY_CHUNK)
            except BlockingIOError:
                if self.exited.done():
                    return
                await wait_fd(self.master, also=self.exited)
                continue
            except OSError:
                return  # EIO: no process holds the terminal any more
            if not data:
                return
            await self.ws.send_json({"type": "stdout", "data": base64.b64encode(data).decode()})

    async def _recv(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            text = await self.ws.recv()
            if text is None:
                return
            try:
                message = json.loads(text)
                kind = message["type"]
                if kind == "stdin":
                    await write_fd(self.master, decode_b64(message.get("data", ""), "data"))
                elif kind == "signal":
                    name = str(message.get("sig", "")).upper().removeprefix("SIG")
                    if name not in PTY_SIGNALS:
                        raise invalid(f"unknown signal {message.get('sig')!r}")
                    if name == "KILL":
                        self.kill()
                    else:
                        signal_group(self.pid, PTY_SIGNALS[name])
                elif kind == "resize":
                    rows, cols = message.get("rows"), message.get("cols")
                    if not all(isinstance(v, int) and 1 <= v <= 1000 for v in (rows, cols)):
                        raise invalid("rows and cols must be integers from 1 to 1000")
                    set_winsize(self.master, rows, cols)
                elif kind == "close":
                    signal_group(self.pid, signal.SIGTERM)
                    if self.kill_timer is None:
                        self.kill_timer = loop.call_later(PTY_CLOSE_GRACE, self.kill)
                else:
                    raise invalid(f"unknown frame type {kind!r}")
            except HTTPError as exc:
                await self.ws.send_json({"type": "error", "message": exc.message})
            except (ValueError, KeyError, TypeError):
                await self.ws.send_json({"type": "error", "message": "bad frame: " + text[:200]})
            except OSError:
                pass  # the terminal is gone: the exit frame follows


def set_winsize(fd: int, rows: int, cols: int) -> None:
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


def take_controlling_tty() -> None:
    """In the child, after setsid: make the terminal on fd 0 the session's controlling tty."""
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)
