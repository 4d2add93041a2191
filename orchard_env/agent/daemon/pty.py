"""PTY sessions: one command on a pseudo-terminal, driven by the JSON frames of a WebSocket
(upstream's protocol: init, stdin, signal, resize, close; ready, stdout, exit, error).

A session's command is a child subreaper like a job's: killing the session (a ``KILL``
signal frame, the end of the grace after ``close``, a disconnect) kills its whole tree,
``setsid`` and ``nohup`` descendants included, not only its process group."""

from __future__ import annotations

import base64
import fcntl
import json
import os
import select
import signal
import struct
import termios
import threading
from collections.abc import Callable

from .http import HTTPError, Request, decode_b64, invalid, string_map
from .loop import Timer
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


def serve_pty(
    req: Request, procs: Processes, base_env: dict[str, str], resolve: Callable[[str], str]
) -> None:
    """The ``GET /pty`` route: upgrade, read the init frame, run the session to its end."""
    ws = accept(req)
    req.conn.sock.settimeout(PTY_INIT_TIMEOUT)
    try:
        text = ws.recv()
    except TimeoutError:
        ws.close(4400, "init frame not received within 10 s")
        return
    req.conn.sock.settimeout(None)
    if text is None:
        return
    try:
        argv, env, cwd, size = parse_init(text, base_env, resolve)
    except HTTPError as exc:
        ws.send_json({"type": "error", "message": exc.message})
        ws.close(4400, "bad init frame")
        return
    session = PtySession(procs, ws)
    try:
        session.spawn(argv, env, cwd, size)
    except OSError as exc:
        message = spawn_failure(exc, argv[0], cwd)["error"]
        ws.send_json({"type": "error", "message": message})
        ws.close(4500, "spawn failed")
        return
    session.run()


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
    """One command on a pseudo-terminal, driven by the JSON frames of a WebSocket: the
    connection's thread runs the session, one thread receives frames, one forwards output."""

    def __init__(self, procs: Processes, ws: WebSocket) -> None:
        self.procs = procs
        self.ws = ws
        self.master = -1
        self.pid = 0
        self.returncode: int | None = None  # set on the loop when the command exited
        self.client_gone = False  # the peer closed, or the connection broke
        self.output_ended = False
        self.stopping = False
        self.state = threading.Condition()
        self.kill_timer: Timer | None = None
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC)  # wakes the output thread

    def spawn(self, argv: list[str], env: dict[str, str], cwd: str, size: tuple[int, int]) -> None:
        master, slave = os.openpty()
        try:
            set_winsize(master, *size)
            proc = self.procs.spawn(
                argv, (), tty=True, cwd=cwd, env=env, stdin=slave, stdout=slave, stderr=slave
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

        def watch() -> None:
            self.procs.pty_roots.add(proc.pid)
            self.procs.watch_child(proc, self._exited)

        self.procs.loop.call(watch)

    def _exited(self, returncode: int) -> None:
        with self.state:
            self.returncode = returncode
            self.state.notify_all()
            self._wake_pump()

    def _wake_pump(self) -> None:
        if self._wake_w >= 0:  # not after the session's end (a late exit)
            os.write(self._wake_w, b"x")

    def _update(self, **state: object) -> None:
        with self.state:
            for name, value in state.items():
                setattr(self, name, value)
            self.state.notify_all()

    def _wait(self, done: Callable[[], bool], timeout: float | None = None) -> None:
        with self.state:
            self.state.wait_for(done, timeout)

    def kill(self) -> None:
        """On the loop: SIGKILL everything the session's command started while it runs
        (:func:`kill_tree`); once it has exited (and been reaped: its pid may be reused),
        only its group."""
        self.procs.reap()
        if self.returncode is None:
            kill_tree(self.pid)
        else:
            signal_group(self.pid, signal.SIGKILL)

    def run(self) -> None:
        receiver = threading.Thread(target=self._recv, daemon=True)
        pump = threading.Thread(target=self._pump, daemon=True)
        try:
            self.ws.send_json({"type": "ready", "pid": self.pid})
            receiver.start()
            pump.start()
            self._wait(lambda: self.client_gone or self.output_ended)
            if not self.client_gone:
                # Output ended (or the command exited): report the exit unless the client left.
                self._wait(lambda: self.client_gone or self.returncode is not None)
                if not self.client_gone:
                    self.ws.send_json({"type": "exit", "code": self.returncode})
                    self.ws.send_close(1000)
                    self._wait(lambda: self.client_gone, 2.0)  # the peer's close frame
        except OSError:
            pass  # the connection broke
        finally:
            with self.state:
                self.stopping = True
                self._wake_pump()
            loop = self.procs.loop
            if self.kill_timer is not None:
                loop.call(self.kill_timer.cancel)
            loop.call(self.kill)
            loop.call(self.procs.pty_roots.discard, self.pid)
            self.ws.conn.close()  # wakes the receiver
            for thread in (receiver, pump):
                if thread.ident is not None:  # started
                    thread.join()
            with self.state:
                for fd in (self.master, self._wake_r, self._wake_w):
                    os.close(fd)
                self._wake_w = -1

    def _pump(self) -> None:
        """Forward terminal output until it ends, or until the command exited and it drained."""
        poller = select.poll()
        poller.register(self.master, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        try:
            while not self.stopping:
                try:
                    data = os.read(self.master, PTY_CHUNK)
                except BlockingIOError:
                    if self.returncode is not None:
                        return
                    poller.poll()
                    continue
                except OSError:
                    return  # EIO: no process holds the terminal any more
                if not data:
                    return
                self.ws.send_json({"type": "stdout", "data": base64.b64encode(data).decode()})
        except OSError:
            pass  # the connection broke
        finally:
            self._update(output_ended=True)

    def _recv(self) -> None:
        try:
            while (text := self.ws.recv()) is not None:
                self._frame(text)
        except OSError:
            pass  # the connection broke
        finally:
            self._update(client_gone=True)

    def _frame(self, text: str) -> None:
        try:
            message = json.loads(text)
            kind = message["type"]
            if kind == "stdin":
                write_all(self.master, decode_b64(message.get("data", ""), "data"))
            elif kind == "signal":
                name = str(message.get("sig", "")).upper().removeprefix("SIG")
                if name not in PTY_SIGNALS:
                    raise invalid(f"unknown signal {message.get('sig')!r}")
                if name == "KILL":
                    self.procs.loop.call(self.kill)
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
                    loop = self.procs.loop
                    self.kill_timer = loop.call(loop.call_later, PTY_CLOSE_GRACE, self.kill)
            else:
                raise invalid(f"unknown frame type {kind!r}")
        except HTTPError as exc:
            self.ws.send_json({"type": "error", "message": exc.message})
        except (ValueError, KeyError, TypeError):
            self.ws.send_json({"type": "error", "message": "bad frame: " + text[:200]})
        except OSError as exc:
            if isinstance(exc, ConnectionError):
                raise
            # the terminal is gone: the exit frame follows


def write_all(fd: int, data: bytes) -> None:
    """Write all of ``data`` to a non-blocking ``fd``, waiting while it is full."""
    view = memoryview(data)
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    while view:
        try:
            written = os.write(fd, view)
        except BlockingIOError:
            poller.poll()
            continue
        view = view[written:]


def set_winsize(fd: int, rows: int, cols: int) -> None:
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
